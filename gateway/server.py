"""uvicorn with a drain: the first SIGTERM/SIGINT refuses new work (503, ``/ready`` 503)
and lets in-flight requests finish within ``limits.drain_timeout_s``; then uvicorn shuts
down, and the lifespan stops the engine last. A second signal stops at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Any) -> None:
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        admission = self.gateway.admission
        if admission.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        admission.draining = True
        log.info("%s: draining %d request(s)", signal.Signals(sig).name, admission.inflight)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.gateway.settings.limits.drain_timeout_s
        while self.gateway.admission.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True

    def exit_now(self) -> None:
        self.should_exit = True
