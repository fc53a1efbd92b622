#!/usr/bin/env bash
# The GPU run of `python -m bench.run` on the nvidia-h200 device, across several `run` calls.
# Needs vllm 0.25.1 and the 1B-shaped model already installed by the staging recipe
# (shared/gpu: device.sh recv/install -> /root/site, /root/model). From the repo root:
#
#   bash bench/device.sh start [run.py args]   copy the repo to /root/repo and start
#                                              run.py --profile gpu in its own session
#                                              (it outlives the call while the machine is warm);
#                                              wheels carried in .whl/ are unpacked into
#                                              /root/site first (the image lacks httptools,
#                                              pydantic-settings, python-dotenv), then the
#                                              gateway's imports are checked
#   bash bench/device.sh wait SECONDS          follow it for up to SECONDS, then copy the
#                                              results (and a tar.gz of the logs) to $OUT
#
# Results: /root/bench-out/results.{json,md,png}, logs/*.log; the run's own log /root/bench.log.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RES=/root/bench-out
case "${1:?start|wait}" in
start)
  shift
  rm -rf /root/repo "$RES" && mkdir -p /root/repo "$RES"
  cp -r "$REPO/gateway" "$REPO/bench" "$REPO/configs" "$REPO/pyproject.toml" /root/repo/
  rm -rf /root/repo/bench/results
  cd /root/repo
  export PYTHONPATH=/root/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
  for w in "$REPO"/.whl/*.whl; do  # other carried wheels (httptools): into the staged site dir
    case "$w" in */py_spy-*|*'*'*) ;; *) python3 -m zipfile -e "$w" /root/site && echo "added $(basename "$w")" ;; esac
  done
  # The gateway's own imports must work before any engine starts (a missing package would
  # fail every gateway pass minutes into the run, after vLLM's passes spent the budget).
  PYTHONPATH=/root/site:/root/repo python3 -c "import gateway.app, gateway.cli" \
    || { echo "the gateway cannot be imported on this image: carry the missing wheels in .whl/" >&2; exit 3; }
  spy=()  # a carried py-spy wheel (.whl/py_spy-*.whl): profile both front ends in an extra pass
  for w in "$REPO"/.whl/py_spy-*.whl; do
    [ -f "$w" ] || continue
    rm -rf /root/pyspy && python3 -m zipfile -e "$w" /root/pyspy
    b=$(ls /root/pyspy/*.data/scripts/py-spy) && chmod +x "$b" && spy=(--pyspy "$b")
  done
  setsid nohup python3 -m bench.run --profile gpu --model /root/model --out "$RES" "${spy[@]}" "$@" \
    > /root/bench.log 2>&1 < /dev/null &
  echo $! > /root/bench.pid
  echo "started run.py (pid $(cat /root/bench.pid))" ;;
wait)
  limit=${2:?seconds}
  t0=$(date +%s)
  pid=$(cat /root/bench.pid 2>/dev/null || echo 0)
  while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
  if kill -0 "$pid" 2>/dev/null; then echo "RUNNING after ${limit}s"; else echo "FINISHED"; fi
  grep -v -e ' INFO ' -e 'WARNING' /root/bench.log | tail -n 60
  mkdir -p "${OUT:=/root/out}"
  for f in results.json results.md results.png; do [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"; done
  cp /root/bench.log "$OUT/bench.log" 2>/dev/null
  tar -C "$RES" -czf "$OUT/logs.tar.gz" logs 2>/dev/null
  ls -l "$OUT" ;;
*) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
