"""The drain on SIGTERM (gateway.server.DrainingServer) on a small app without an engine:
the first signal keeps the listener open, /ready says 503, new work gets 503, and open
streams finish; the process exits when they have. A second signal stops at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import eventually, free_port

ROOT = Path(__file__).resolve().parents[2]

# Streams on /s send "start", wait for POST /release, then send "end". The gateway stand-in
# has what the server reads: admission (the real one) and limits.drain_timeout_s.
APP = """
import asyncio, sys
from types import SimpleNamespace
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from gateway.middleware import Admission
from gateway.server import DrainingServer

gw = SimpleNamespace(admission=Admission(100, 1), settings=SimpleNamespace(limits=SimpleNamespace(drain_timeout_s=60)), stop_requests=lambda: None)
release = asyncio.Event()

async def stream(request):
    if gw.admission.admit(None) is not None:
        return JSONResponse({"error": "draining"}, 503)
    async def body():
        try:
            yield "start\\n"
            await release.wait()
            yield "end\\n"
        finally:
            gw.admission.release(None)
    return StreamingResponse(body())

async def release_all(request):
    release.set()
    return JSONResponse({})

async def ready(request):
    return JSONResponse({"inflight": gw.admission.inflight}, 503 if gw.admission.draining else 200)

app = Starlette(routes=[Route("/s", stream, methods=["POST"]), Route("/release", release_all, methods=["POST"]), Route("/ready", ready)])
config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), timeout_graceful_shutdown=2, log_level="warning")
DrainingServer(config, gw).run()
"""


class Server:
    def __init__(self, tmp_path: Path) -> None:
        port = free_port()
        script = tmp_path / "app.py"
        script.write_text(APP)
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(port)], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}
        )
        self.streams: list[str] = []
        self.threads: list[threading.Thread] = []

        def answers() -> bool:
            assert self.process.poll() is None, "the app exited"
            try:
                httpx.get(self.url + "/ready")
                return True
            except httpx.TransportError:
                return False

        eventually(answers, 30, "the app answers")

    def open_stream(self) -> None:
        started = threading.Event()

        def run() -> None:
            try:
                with httpx.stream("POST", self.url + "/s", timeout=30) as r:
                    lines = r.iter_lines()
                    first = next(lines)
                    started.set()
                    self.streams.append(first + "|" + "|".join(lines))
            except httpx.HTTPError as exc:
                self.streams.append(f"error {exc!r}")
                started.set()

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        assert started.wait(10), "the stream did not start"

    def ready(self) -> tuple[int, int]:
        r = httpx.get(self.url + "/ready")
        return r.status_code, r.json()["inflight"]


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    if srv.process.poll() is None:
        srv.process.kill()
    srv.process.wait()
    for t in srv.threads:
        t.join(5)


def test_sigterm_drains_open_streams_and_refuses_new_work(server: Server) -> None:
    server.open_stream()
    server.open_stream()
    assert server.ready() == (200, 2)
    server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 1.0  # the listener stays open for as long as streams are open
    seen = set()
    while time.monotonic() < deadline:
        seen.add(server.ready())
        time.sleep(0.02)
    assert seen - {(200, 2)} == {(503, 2)}, seen  # at most the first look beat the handler
    assert server.ready() == (503, 2)
    refused = httpx.post(server.url + "/s")
    assert refused.status_code == 503
    assert server.process.poll() is None
    httpx.post(server.url + "/release")
    assert server.process.wait(10) == 0
    assert server.streams == ["start|end", "start|end"]


def test_sigterm_with_nothing_in_flight_exits_at_once(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(5) == 0


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_without_waiting_for_streams(server: Server, second: signal.Signals) -> None:
    server.open_stream()
    server.process.send_signal(signal.SIGTERM)
    eventually(lambda: server.ready()[0] == 503, 5, "/ready turns 503", interval=0.02)
    server.process.send_signal(second)
    # uvicorn's own shutdown (2 s for open streams), not the 60 s drain; not killed by the
    # signal raised again (143, or a KeyboardInterrupt traceback for SIGINT)
    assert server.process.wait(10) == 0
    for t in server.threads:
        t.join(5)
    assert server.streams and not server.streams[0].endswith("|end")
