"""The listening socket is bound before anything else starts: a port in use ends the
process at once, with one line on stderr, a non-zero status, and no engine built."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
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


def test_a_failed_start_exits_with_one_error_line_and_no_engine(tmp_path: Path) -> None:
    """A start that fails (here the response store, checked before the engine) ends the
    process with the CLI's config status: a process left answering 503 is never restarted."""
    store = tmp_path / "responses.sqlite3"
    store.write_bytes(b"not a database " * 100)
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--port", str(free_port())]
        + ["--set", f"responses.store_path={store}"],
        cwd=ROOT,
        env=gateway_env(),
        capture_output=True,
        text=True,
        timeout=60,  # a bound for a hung process: before this change it never exited
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error: responses.store_path: cannot open '{store}': file is not a database", last
    assert "Traceback" not in result.stderr and "starting vLLM engine" not in result.stderr


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "No such file or directory"),
        ("", "the file is empty"),
        ("routes: [broken\n", "line 2, column 1: expected ',' or ']'"),
    ],
    ids=["missing", "empty", "not-yaml"],
)
def test_a_catalog_that_cannot_be_read_fails_the_start_before_the_engine(
    tmp_path: Path, text: str | None, reason: str
) -> None:
    catalog = tmp_path / "adapters.yaml"
    if text is not None:
        catalog.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()), "--catalog", str(catalog)],
        cwd=ROOT,
        env=gateway_env(),
        capture_output=True,
        text=True,
        timeout=60,  # a bound: the engine's start (75 s and more) must not happen
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {catalog}: ") and reason in last, last
    assert "starting vLLM engine" not in result.stderr
