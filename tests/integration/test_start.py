"""The listening socket is bound before anything else starts: a port in use ends the
process at once, with one line on stderr, a non-zero status, and no engine built."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.integration.conftest import ROOT, gateway_env


def test_a_port_in_use_exits_at_once_without_starting_the_engine() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port)],
            cwd=ROOT,
            env=gateway_env(),
            capture_output=True,
            text=True,
            timeout=60,  # a bound for a hung process, not a measurement: the engine start is what must not happen
        )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], result.stderr
    everything = result.stdout + result.stderr
    assert "starting vLLM engine" not in everything and "prepare-model" not in everything
