"""`python -m gateway chat` against the live gateway: one-shot and interactive."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.conftest import ROOT, USER_KEY, LiveGateway


def chat(gw: LiveGateway, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gateway", "chat", "--url", gw.url, "--api-key", USER_KEY, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, input=stdin, timeout=120)


def test_one_shot_chat_names_the_adapter_and_streams_its_answer(gateway: LiveGateway) -> None:
    done = chat(gateway, "--model", "loud", "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[shout] ")
    answer = done.stdout.removeprefix("[shout] ")
    letters = [c for c in answer if c.isalpha()]
    assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.8


def test_interactive_chat_keeps_history_until_eof(gateway: LiveGateway) -> None:
    done = chat(gateway, "--task", "outline", stdin="How do I stay healthy?\nAnd how do I sleep well?\n")
    assert done.returncode == 0, done.stderr
    answers = [line for line in done.stdout.split("> ") if line.strip()]
    assert len(answers) == 2 and all(a.startswith("[bullets] ") for a in answers)


def test_unknown_route_is_reported(gateway: LiveGateway) -> None:
    done = chat(gateway, "--model", "nope", "hi")
    assert done.returncode == 1
    assert "error 404" in done.stderr and "does not exist" in done.stderr
