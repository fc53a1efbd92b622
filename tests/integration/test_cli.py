"""The command line: --help everywhere, adapters list/validate without an engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gateway(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
    )


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["serve"],
        ["prepare-model"],
        ["adapters"],
        ["adapters", "list"],
        ["adapters", "validate"],
        ["chat"],
    ],
)
def test_help_everywhere(command: list[str]) -> None:
    done = gateway(*command, "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m gateway")


def test_adapters_list_shows_the_shipped_routes() -> None:
    done = gateway("adapters", "list")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert {"gemma-3-270m", "shout", "json", "bullets", "concise"} <= set(lines)
    assert " lora " in lines["shout"] and "digest=" in lines["shout"] and "rank=8" in lines["shout"]
    assert " preset " in lines["concise"]


def test_adapters_validate_passes_and_fails(tmp_path: Path) -> None:
    assert gateway("adapters", "validate").returncode == 0
    bad = tmp_path / "adapters.yaml"
    bad.write_text("routes:\n  - name: evil\n    adapter: ../../etc\n  - name: shout\n    adapter: shout\n")
    done = gateway("adapters", "validate", "--catalog", str(bad))
    assert done.returncode == 1
    assert "REJECTED evil" in done.stderr and "inside the adapters root" in done.stderr
    assert "shout" in done.stdout


def test_serve_refuses_several_workers() -> None:
    done = gateway("serve", "--workers", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("error: server.workers:") and "replicas" in done.stderr
    assert "Traceback" not in done.stderr
