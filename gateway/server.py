"""uvicorn with a drain: the first SIGTERM/SIGINT refuses new work (503, ``/ready`` 503)
and lets in-flight requests finish within ``limits.drain_timeout_s``; those still running
then end with a 503 or an error event (``Gateway.stop_requests``), uvicorn shuts down, and
the lifespan stops the engine last. A second signal stops at once (what is in flight ends
with a 503 or an error event); the exit status stays 0.

``bind_socket`` opens the listening socket before anything else starts, so an address
in use stops the process at once instead of after the engine was built."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType
from typing import Any

import uvicorn

from gateway.errors import ConfigError

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound, listening-ready TCP socket; ``ConfigError`` (one line) if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Any) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it may run between any two bytecodes of the main thread, so it
        # only flips flags and hands the rest to the loop (no logging, no loop lookup here).
        admission = self.gateway.admission
        if self._loop is None:
            super().handle_exit(sig, frame)
            return
        if admission.draining or self.should_exit:
            # A second signal stops at once: what is still in flight ends now, with a 503 or
            # an error event. Not through uvicorn's handle_exit, which keeps the signal to
            # raise it again once the server has stopped: the process would die by it after
            # a clean stop (SIGTERM: status 143; SIGINT: a KeyboardInterrupt traceback).
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # as uvicorn: Ctrl-C while stopping skips its waits
            self.should_exit = True
            self._loop.call_soon_threadsafe(self.gateway.stop_requests)
            return
        admission.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        log.info("%s: draining %d request(s)", signal.Signals(sig).name, self.gateway.admission.requests)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.gateway.settings.limits.drain_timeout_s
        while self.gateway.admission.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.gateway.admission.requests:
            log.warning("drain timeout: %d request(s) still in flight", self.gateway.admission.requests)
            # They end with a 503 or an error event, aborted in the engine, in the moment
            # uvicorn's own shutdown gives them; it cancels what is left after that.
            self.gateway.stop_requests()
        self.should_exit = True

    def exit_now(self) -> None:
        self.should_exit = True
