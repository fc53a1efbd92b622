"""The command line: --help everywhere, adapters list/validate and chat's errors without an engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
Stub = Callable[[type[BaseHTTPRequestHandler]], str]


@pytest.fixture
def stub() -> Iterator[Stub]:
    """``stub(handler)``: the URL of a small HTTP server answering with ``handler`` (shut
    down after the test), for the chat CLI to talk to without an engine."""
    servers: list[ThreadingHTTPServer] = []

    def start(handler: type[BaseHTTPRequestHandler]) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


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
    assert done.stderr.count("evil") == 1, done.stderr  # once, not also as a log line
    assert "shout" in done.stdout


def shout_for_another_model(tmp_path: Path) -> tuple[str, ...]:
    """The flags of a catalog whose one adapter names another base model (a warning)."""
    root = tmp_path / "adapters"
    shutil.copytree(ROOT / "adapters" / "shout", root / "shout")
    config = root / "shout" / "adapter_config.json"
    config.write_text(config.read_text().replace('"gemma-3-270m"', '"another-model"'))
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text("routes:\n  - name: shout\n    adapter: shout\n")
    return ("--catalog", str(catalog), "--adapters-root", str(root))


def test_adapters_list_reports_a_warning_once(tmp_path: Path) -> None:
    done = gateway("adapters", "list", *shout_for_another_model(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "WARNING shout:" in done.stderr and "another-model" in done.stderr
    assert done.stderr.count("another-model") == 1, done.stderr


def test_adapters_validate_says_when_it_had_no_model_to_check_shapes_against(tmp_path: Path) -> None:
    """Without the model's weights here (a GPU profile's model on another machine), validate
    said "catalog OK" and that each adapter's weights fit the model: none had been compared."""
    done = gateway(
        "adapters", "validate", *shout_for_another_model(tmp_path), "--model", str(tmp_path / "absent")
    )
    assert done.returncode == 0, done.stderr
    assert f"no safetensors weights of the model at {tmp_path / 'absent'}" in done.stderr
    assert "weights fit the model" not in done.stderr and "no model here" in done.stderr


def test_serve_refuses_several_workers() -> None:
    done = gateway("serve", "--workers", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("error: server.workers:") and "replicas" in done.stderr
    assert "Traceback" not in done.stderr


# -- chat: clear errors and exit codes, never a traceback ------------------------------------
CLOSED = "http://127.0.0.1:9"  # nothing listens there: these fail before any request


def chat_bytes(*args: bytes | str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """``python -m gateway chat`` with arguments and input that may not be UTF-8."""
    cmd = [
        sys.executable.encode(),
        b"-m",
        b"gateway",
        b"chat",
        *(a if isinstance(a, bytes) else a.encode() for a in args),
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, input=stdin, timeout=120)


@pytest.mark.parametrize(
    ("args", "stdin", "code", "message"),
    [
        (["--url", "http://a..b:8000", "hi"], b"", 1, b"not a valid host name"),
        (["--url", "http://xn--a.com", "hi"], b"", 1, b"not a valid host name"),
        (["--url", CLOSED, "--model", "m", b"caf\xe9"], b"", 1, b"the message is not valid UTF-8"),
        (["--url", CLOSED, "--model", "m"], b"caf\xe9\n", 1, b"not valid UTF-8"),
        (["--url", CLOSED, "--api-key", "cl\u00e9", "hi"], b"", 2, b"--api-key must be printable ASCII"),
        # an empty message is not an interactive session waiting on stdin
        (["--url", CLOSED, "--model", "m", ""], b"hi\n", 2, b"the message is empty"),
        (["--url", CLOSED, "--model", "m", " ", ""], b"hi\n", 2, b"the message is empty"),
    ],
)
def test_chat_bad_input_is_one_error_line(
    args: list[bytes | str], stdin: bytes, code: int, message: bytes
) -> None:
    done = chat_bytes(*args, stdin=stdin)
    assert done.returncode == code, done.stderr
    assert message in done.stderr and b"Traceback" not in done.stderr


class _SlowStream(BaseHTTPRequestHandler):
    """A gateway that starts an answer and never finishes it."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("x-adapter", "slow")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "Once upon"}, "finish_reason": None}]}
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.flush()
        time.sleep(30)

    def log_message(self, *args: Any) -> None:
        pass


class _LongStream(BaseHTTPRequestHandler):
    """A gateway that streams a long answer, a word every 10 ms."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}]}
        for _ in range(1000):
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


class _Recorder(BaseHTTPRequestHandler):
    """A gateway that answers "ok" and keeps each request's Authorization header."""

    seen: list[str | None] = []
    paths: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        _Recorder.seen.append(self.headers.get("Authorization"))
        _Recorder.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("flag", "env", "sent"),
    [
        ([], "sk-from-env", "Bearer sk-from-env"),
        (["--api-key", "sk-from-flag"], "sk-from-env", "Bearer sk-from-flag"),  # the flag first
        ([], "", None),
    ],
)
def test_chat_reads_its_key_from_gateway_api_key(
    flag: list[str], env: str, sent: str | None, stub: Stub
) -> None:
    """A key in $GATEWAY_API_KEY stays out of ps and shell history, as the OpenAI SDK's does."""
    url = stub(_Recorder)
    _Recorder.seen = []
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "chat", "--url", url, "--model", "m", *flag, "hi"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GATEWAY_API_KEY": env},
    )
    assert done.returncode == 0, done.stderr
    assert _Recorder.seen == [sent]


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_chat_takes_the_gateway_root_or_the_sdk_base_url(suffix: str, stub: Stub) -> None:
    """README's OpenAI SDK example uses ``.../v1`` as base_url; the CLI takes it too."""
    url = stub(_Recorder) + suffix
    _Recorder.paths = []
    done = chat_bytes("--url", url, "--model", "m", "hi")
    assert done.returncode == 0, done.stderr
    assert _Recorder.paths == ["/v1/chat/completions"]


def test_chat_names_gateway_api_key_when_it_is_not_ascii() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "chat", "--url", CLOSED, "hi"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GATEWAY_API_KEY": "cl\u00e9"},
    )
    assert done.returncode == 2
    assert "GATEWAY_API_KEY must be printable ASCII" in done.stderr and "Traceback" not in done.stderr


class _ScopedModels(_Recorder):
    """A gateway whose model list, for this key, lacks the base model (``routes: [shout]``)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        cards = [{"id": "shout", "kind": "lora"}, {"id": "loud", "kind": "lora", "alias_of": "shout"}]
        body = json.dumps({"object": "list", "data": cards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_chat_without_a_route_tells_a_scoped_key_to_pass_one(stub: Stub) -> None:
    """Not the server's bare "you must provide a model parameter": what to pass, and which."""
    url = stub(_ScopedModels)
    _Recorder.seen = []
    done = chat_bytes("--url", url, "hi")
    assert done.returncode == 1, done.stderr
    assert b"--model" in done.stderr and b"shout, loud" in done.stderr and b"--task" in done.stderr
    assert _Recorder.seen == []  # nothing sent that could only fail


def test_chat_into_a_closed_pipe_stops_quietly(stub: Stub) -> None:
    """``python -m gateway chat ... | head -c 20``: no BrokenPipeError traceback."""
    url = stub(_LongStream)
    cmd = [sys.executable, "-m", "gateway", "chat", "--url", url, "--model", "m", "Tell me a story"]
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.read(20)
        child.stdout.close()  # as head does once it has its bytes
        err = child.stderr.read()
        child.wait(timeout=30)
    finally:
        child.kill()
        child.stderr.close()  # type: ignore[union-attr]
    assert child.returncode == 141, err
    assert b"Traceback" not in err and b"BrokenPipeError" not in err


def test_chat_ctrl_c_mid_answer_exits_130_without_a_traceback(stub: Stub) -> None:
    url = stub(_SlowStream)
    cmd = [sys.executable, "-m", "gateway", "chat", "--url", url, "--model", "m", "Tell me a story"]
    # SIGINT as a terminal sends it (a shell may start tests with it ignored)
    child = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert child.stdout is not None
        assert child.stdout.read(len(b"[slow] Once upon")) == b"[slow] Once upon"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err
