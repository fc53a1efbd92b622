"""Deployment files: compose.yaml through a real compose parser, the GPU profile through the
settings loader, and the Dockerfile against the repo it builds from (no Docker engine needed)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from gateway.errors import ConfigError
from gateway.settings import PROJECT_ROOT, load_settings

COMPOSE = PROJECT_ROOT / "compose.yaml"
DOCKERFILE = PROJECT_ROOT / "Dockerfile"
DOCKERIGNORE = PROJECT_ROOT / ".dockerignore"
GPU_PROFILE = PROJECT_ROOT / "configs" / "gpu-gemma3.yaml"
PROMETHEUS = PROJECT_ROOT / "deploy" / "prometheus.yml"
METRICS_TOKEN = PROJECT_ROOT / "deploy" / "metrics_token"


# -- compose: parsed by docker-compose (Debian's package, v1) or the docker compose v2 plugin --


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.fixture(scope="module")
def compose_cmd() -> list[str]:
    cmd = _compose_command()
    if cmd is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing: .ci/run installs it (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    return cmd


def _compose_config(cmd: list[str], *profiles: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "GATEWAY_", "DOCKER_"))}
    args = [*cmd, "--project-directory", str(PROJECT_ROOT), "-f", str(COMPOSE)]
    for profile in profiles:
        args += ["--profile", profile]
    result = subprocess.run([*args, "config"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, f"{' '.join(args)} config failed:\n{result.stderr}"
    parsed = yaml.safe_load(result.stdout)  # v1 prints YAML; v2's default output is YAML too
    assert isinstance(parsed, dict) and "services" in parsed
    return parsed


@pytest.fixture(scope="module")
def compose(compose_cmd: list[str]) -> dict[str, Any]:
    return _compose_config(compose_cmd)


@pytest.fixture(scope="module")
def compose_cpu(compose_cmd: list[str]) -> dict[str, Any]:
    return _compose_config(compose_cmd, "cpu")


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only), from v1's short strings or v2's long form."""
    found: dict[str, tuple[str, bool]] = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            parts = volume.split(":")
            source, target = parts[0], parts[1]
            found[target] = (source, len(parts) > 2 and "ro" in parts[2].split(","))
        else:
            found[volume["target"]] = (str(volume.get("source", "")), bool(volume.get("read_only")))
    return found


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices = reservations.get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" or "gpu" in d.get("capabilities", [])]


def _healthcheck_text(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return test if isinstance(test, str) else " ".join(test)


def _run_healthcheck_locally(service: dict[str, Any], port: int) -> int:
    """Run the healthcheck's command here, pointed at ``port`` (CMD form only)."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", "exec-form healthcheck expected (no shell in the check)"
    argv = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in test[1:]]
    argv[0] = shutil.which(argv[0]) or argv[0]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


def test_compose_gateway_is_the_gpu_build_with_nvidia_gpus(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["build"]["target"] == "gpu"
    assert "profiles" not in gateway  # `docker compose up` starts it
    devices = _gpu_devices(gateway)
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    count = devices[0].get("count")
    tp = load_settings({"config": str(GPU_PROFILE)}).engine.tensor_parallel_size
    assert count in ("all", -1) or int(count) == tp, "reserve as many GPUs as tensor_parallel_size"
    assert gateway.get("ipc") == "host" or gateway.get("shm_size"), "vLLM workers need shared memory"
    assert str(gateway["environment"]["GATEWAY_CONFIG"]) == "/app/configs/gpu-gemma3.yaml"
    assert "8000" in _port_targets(gateway)


def _port_targets(service: dict[str, Any]) -> set[str]:
    return {
        str(p["target"]) if isinstance(p, dict) else str(p).split(":")[-1].split("/")[0]
        for p in service.get("ports", [])
    }


def test_compose_mounts_configs_adapters_and_model_where_settings_look(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    mounts = _mounts(gateway)
    # /app is the project root in the image (editable install): configs/ and adapters/ under it.
    for name in ("configs", "adapters"):
        source, read_only = mounts[f"/app/{name}"]
        assert Path(source).resolve() == (PROJECT_ROOT / name).resolve()
        assert read_only
    # the container reads the GPU profile through the configs mount, and its model through /models
    settings = load_settings({"config": str(GPU_PROFILE)})
    assert settings.catalog == PROJECT_ROOT / "configs" / "adapters.yaml"
    assert settings.adapters_root == PROJECT_ROOT / "adapters"
    model = PurePosixPath(str(settings.engine.model))
    others = [target for target in mounts if target not in ("/app/configs", "/app/adapters")]
    assert any(model.is_relative_to(target) for target in others), f"{model} is on no mounted volume"


def test_compose_keeps_the_gpu_gateways_cache_dir_on_a_volume(compose: dict[str, Any]) -> None:
    """The response store (30 days by default) and the adapter copies live under
    GATEWAY_CACHE_DIR: in the container's own layer they were lost at every `up --build`."""
    cache_dir = re.search(r"GATEWAY_CACHE_DIR=(\S+)", (PROJECT_ROOT / "Dockerfile").read_text())
    assert cache_dir is not None
    source, read_only = _mounts(compose["services"]["gateway"])[cache_dir.group(1)]
    assert source in compose.get("volumes", {}) and not read_only
    store = load_settings({"config": str(GPU_PROFILE)}).responses.resolved_path(Path(cache_dir.group(1)))
    assert str(store).startswith(cache_dir.group(1) + "/") or str(store) == ":memory:"


def test_compose_healthchecks_hit_ready(compose: dict[str, Any], compose_cpu: dict[str, Any]) -> None:
    for service in (compose["services"]["gateway"], compose_cpu["services"]["gateway-cpu"]):
        assert "/ready" in _healthcheck_text(service)
        assert "Authorization" not in _healthcheck_text(service)  # /ready needs no key


def test_compose_healthcheck_command_fails_until_ready(compose: dict[str, Any]) -> None:
    """The check's own command line: non-zero on 503 and on no server, zero on 200."""
    import http.server
    import threading

    status = {"code": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status["code"] if self.path == "/ready" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gateway = compose["services"]["gateway"]
        port = server.server_address[1]
        assert _run_healthcheck_locally(gateway, port) != 0
        status["code"] = 200
        assert _run_healthcheck_locally(gateway, port) == 0
    finally:
        server.shutdown()
        server.server_close()


def test_compose_prometheus_scrapes_the_gateway_with_a_metrics_only_key(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    mounts = _mounts(prometheus)
    source, _ = mounts["/etc/prometheus/prometheus.yml"]
    assert Path(source).resolve() == PROMETHEUS.resolve()

    scrape = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    job = jobs["gateway"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert "gateway:8000" in targets

    # Bearer token from a compose secret; its hash is the `prometheus` key of the GPU profile.
    auth = job["authorization"]
    assert auth.get("type", "Bearer") == "Bearer"
    secret_names = [s if isinstance(s, str) else s["source"] for s in prometheus["secrets"]]
    assert auth["credentials_file"] in {f"/run/secrets/{name}" for name in secret_names}
    secret_file = Path(compose["secrets"][secret_names[0]]["file"])
    assert secret_file.resolve() == METRICS_TOKEN.resolve()
    token = METRICS_TOKEN.read_text().strip()  # Prometheus trims the file too
    settings = load_settings({"config": str(GPU_PROFILE)})
    assert not settings.auth.public_metrics
    keys = {k.name: k for k in settings.auth.keys}
    key = keys["prometheus"]
    assert key.sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert key.routes == [] and not key.admin  # can read /metrics, nothing else


def test_compose_cpu_profile_runs_without_gpus(compose_cpu: dict[str, Any]) -> None:
    cpu = compose_cpu["services"]["gateway-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert cpu["build"]["target"] == "cpu"
    assert _gpu_devices(cpu) == []
    mounts = _mounts(cpu)
    assert {"/app/configs", "/app/adapters"} <= set(mounts)
    config = str(cpu.get("environment", {}).get("GATEWAY_CONFIG", "/app/configs/gateway.yaml"))
    settings = load_settings({"config": str(PROJECT_ROOT / PurePosixPath(config).relative_to("/app"))})
    assert settings.engine.model is None  # the embedded model, prepared in the cpu image


# -- the GPU profile through the real settings loader ------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_gpu_profile_loads_with_production_values(clean_env: pytest.MonkeyPatch) -> None:
    s = load_settings({"config": str(GPU_PROFILE)})
    e = s.engine
    assert e.tensor_parallel_size == 2
    assert e.dtype == "bfloat16"
    assert e.gpu_memory_utilization == 0.75
    assert e.max_num_seqs == 16
    assert e.max_model_len == 4096
    assert e.limit_mm_per_prompt == {"image": 0}
    assert e.enable_lora and e.max_loras >= 1 and e.max_lora_rank >= 1
    assert e.model == "/models/gemma-3-27b-it" and e.served_model_name == "gemma-3-27b-it"
    assert s.server.host == "0.0.0.0" and s.server.port == 8000 and s.server.workers == 1


def test_gpu_profile_refuses_several_workers(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="workers"):
        load_settings({"config": str(GPU_PROFILE), "server.workers": 2})
    clean_env.setenv("GATEWAY_SERVER__WORKERS", "2")
    with pytest.raises(ConfigError, match="workers"):
        load_settings({"config": str(GPU_PROFILE)})


def test_gpu_profile_has_no_laptop_dev_key(clean_env: pytest.MonkeyPatch) -> None:
    dev = hashlib.sha256(b"sk-gateway-dev").hexdigest()
    assert dev not in {k.sha256 for k in load_settings({"config": str(GPU_PROFILE)}).auth.keys}


# -- Dockerfile against the repo -----------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in _instructions():
        if word == "FROM":
            match = re.search(r"\s+AS\s+(\S+)\s*$", rest, re.IGNORECASE)
            assert match, f"unnamed stage: FROM {rest}"
            current = stages.setdefault(match.group(1), [])
            current.append((word, rest))
        elif current is not None:
            current.append((word, rest))
    return stages


def _copy_sources(args: str) -> tuple[list[str], str]:
    parts = [p for p in shlex.split(args) if not p.startswith("--")]
    return parts[:-1], parts[-1]


def _dockerignored(path: str) -> bool:
    lines = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()]
    patterns = [p for p in lines if p and not p.startswith(("#", "!"))]
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pat.rstrip("/").removeprefix("/").removeprefix("**/"))
        for pat in patterns
        for prefix in prefixes
    )


@pytest.mark.parametrize("stage", ["cpu", "gpu"])
def test_the_dependency_layers_stub_package_builds(stage: str, tmp_path: Path) -> None:
    """Dependencies install against a stub package before the code is copied; pyproject.toml
    reads the version from ``gateway.__version__``, so a bare stub failed the build's metadata
    step (every ``docker build`` stopped there). Runs the stub's commands, then that step."""
    (run,) = [rest for word, rest in _stages()[stage] if word == "RUN" and "mkdir gateway" in rest]
    stub = run.split("&& pip install")[0].split("&& python3 -m pip install")[0]
    shutil.copy(PROJECT_ROOT / "pyproject.toml", tmp_path)
    subprocess.run(["bash", "-ec", stub], cwd=tmp_path, check=True)
    build = "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('meta'))"
    (tmp_path / "meta").mkdir()
    done = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_dockerfile_has_cpu_and_gpu_targets() -> None:
    stages = _stages()
    assert {"cpu", "gpu"} <= set(stages)
    assert stages["cpu"][0][1].startswith("python:3.11")


def test_dockerfile_copies_only_what_exists_and_is_in_the_context() -> None:
    for name, instructions in _stages().items():
        copied: list[str] = []
        for word, rest in instructions:
            if word in ("COPY", "ADD"):
                assert "--from" not in rest
                sources, _ = _copy_sources(rest)
                for source in sources:
                    assert (PROJECT_ROOT / source).exists(), f"{name}: COPY {source}: not in the repo"
                    assert not _dockerignored(source), f"{name}: COPY {source}: excluded by .dockerignore"
                    copied.append(source.rstrip("/"))
        assert "pyproject.toml" in copied and "gateway" in copied, name
        assert "configs" in copied, name  # the templates the embedded model needs live there


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".venv", ".git", "bench/results", ".pytest_cache", ".cache"):
        assert _dockerignored(path), path
    for path in ("pyproject.toml", "gateway/app.py", "configs/adapters.yaml", "adapters"):
        assert not _dockerignored(path), path


def test_dockerfile_installs_extras_that_exist() -> None:
    pyproject = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    extras_defined = set(pyproject["project"]["optional-dependencies"])
    stages = _stages()
    for name, extra in (("cpu", "cpu"), ("gpu", "gpu")):
        runs = " ".join(rest for word, rest in stages[name] if word == "RUN")
        extras = {e for group in re.findall(r"\.\[([A-Za-z0-9_,-]+)\]", runs) for e in group.split(",")}
        assert extra in extras, f"{name} stage does not install .[{extra}]"
        assert extras <= extras_defined, f"unknown extras {extras - extras_defined}"


def test_dockerfile_gpu_pins_vllm_that_pyproject_accepts() -> None:
    text = DOCKERFILE.read_text()
    version = re.search(r"^ARG VLLM_VERSION=(\S+)$", text, re.MULTILINE)
    assert version and version.group(1) == "0.25.1"
    gpu = _stages()["gpu"]
    assert "${VLLM_VERSION}" in gpu[0][1]
    assert any("vllm==${VLLM_VERSION}" in rest for word, rest in gpu if word == "RUN")
    pyproject = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    spec = pyproject["project"]["optional-dependencies"]["gpu"]
    vllm = next(Requirement(r) for r in spec if Requirement(r).name == "vllm")
    assert vllm.specifier.contains(version.group(1))


def test_dockerfile_cpu_prepares_the_embedded_model_into_the_cache_dir() -> None:
    cpu = _stages()["cpu"]
    env = " ".join(rest for word, rest in cpu if word == "ENV")
    assert re.search(r"GATEWAY_CACHE_DIR=/\S+", env)
    runs = " ".join(rest for word, rest in cpu if word == "RUN")
    assert "prepare-model" in runs
    assert "uninstall" in runs and "torchvision" in runs


def test_dockerfile_runs_the_gateway_as_non_root_on_8000() -> None:
    for name, instructions in _stages().items():
        words = [w for w, _ in instructions]
        users = [rest for word, rest in instructions if word == "USER"]
        assert users and users[-1] not in ("root", "0"), f"{name}: runs as root"
        assert ("EXPOSE", "8000") in instructions, name
        entry = json.loads(next(rest for word, rest in instructions if word == "ENTRYPOINT"))
        assert entry[1:] == ["-m", "gateway", "serve", "--host", "0.0.0.0"], name
        assert words.index("ENTRYPOINT") > words.index("USER")
