"""Settings precedence (CLI > env > YAML > defaults), one test per pair, and clear errors,
from settings and from the CLI (``chat`` included)."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import _base_url, _overrides, build_parser, main
from gateway.errors import ConfigError
from gateway.settings import PROJECT_ROOT, load_settings, unknown_env


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "GATEWAY_CONFIG",
        "GATEWAY_ENGINE__MAX_NUM_SEQS",
        "GATEWAY_SERVER__PORT",
        "GATEWAY_AUTH__KEYS",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def empty_config(env: pytest.MonkeyPatch, tmp_path: Path) -> str:
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    return str(path)


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text("engine:\n  max_num_seqs: 7\n  dtype: bfloat16\nserver:\n  port: 9001\n")
    return path


def test_defaults_without_config(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    s = load_settings({"config": str(empty)})
    assert s.engine.max_num_seqs == 16
    assert s.engine.model is None
    assert s.server.workers == 1


def test_yaml_beats_defaults(env: pytest.MonkeyPatch, yaml_file: Path) -> None:
    s = load_settings({"config": str(yaml_file)})
    assert s.engine.max_num_seqs == 7
    assert s.engine.dtype == "bfloat16"
    assert s.engine.max_loras == "auto"  # untouched default survives a partial section


def test_env_beats_yaml(env: pytest.MonkeyPatch, yaml_file: Path) -> None:
    env.setenv("GATEWAY_CONFIG", str(yaml_file))
    env.setenv("GATEWAY_ENGINE__MAX_NUM_SEQS", "11")
    s = load_settings()
    assert s.engine.max_num_seqs == 11
    assert s.engine.dtype == "bfloat16"  # the rest still comes from YAML


def test_cli_beats_env(env: pytest.MonkeyPatch, yaml_file: Path) -> None:
    env.setenv("GATEWAY_ENGINE__MAX_NUM_SEQS", "11")
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(yaml_file),
            "--max-num-seqs",
            "3",
            "--set",
            "engine.engine_args.enforce_eager=true",
        ]
    )
    s = load_settings(_overrides(args))
    assert s.engine.max_num_seqs == 3
    assert s.engine.engine_args == {"enforce_eager": True}
    assert s.server.port == 9001


@pytest.mark.parametrize(("flag", "slots"), [("auto", "auto"), ("6", 6)])
def test_max_loras_takes_a_number_or_auto(empty_config: str, flag: str, slots: object) -> None:
    args = build_parser().parse_args(["serve", "--config", empty_config, "--max-loras", flag])
    assert load_settings(_overrides(args)).engine.max_loras == slots


@pytest.mark.parametrize("value", ["many", 0, True, "-1"])
def test_max_loras_that_is_no_slot_count_is_one_line(empty_config: str, value: object) -> None:
    with pytest.raises(
        ConfigError, match=r"^engine\.max_loras: .*a number of GPU slots \(1 or more\) or 'auto'"
    ):
        load_settings({"config": empty_config, "engine.max_loras": value})


def test_relative_paths_are_anchored_at_the_project(env: pytest.MonkeyPatch, yaml_file: Path) -> None:
    s = load_settings({"config": str(yaml_file), "catalog": "configs/adapters.yaml"})
    assert s.catalog == PROJECT_ROOT / "configs" / "adapters.yaml"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"engine.max_num_seqs": "many"}, "engine.max_num_seqs"),
        ({"engine.gpu_memory_utilization": 1.5}, "engine.gpu_memory_utilization"),
        ({"server.workers": 2}, "server.workers"),
        ({"engine.no_such_field": 1}, "engine.no_such_field"),
        ({"engine.dtype": "float99"}, "engine.dtype"),  # was vLLM's error, after the engine's imports
    ],
)
def test_invalid_setting_is_one_line_naming_the_field(
    env: pytest.MonkeyPatch, yaml_file: Path, overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"config": str(yaml_file), **overrides})
    message = str(info.value)
    assert message.startswith(field + ":")
    assert "\n" not in message


@pytest.mark.parametrize(
    "origin", ["https://app.example.com/", "https://app.example.com/chat", "app.example.com", "*.example.com"]
)
def test_a_cors_origin_written_like_a_url_is_refused(empty_config: str, origin: str) -> None:
    """A browser's Origin has no path or trailing slash: such an entry would match no request."""
    with pytest.raises(ConfigError, match=r"^server\.cors_allow_origins: .*is not an origin"):
        load_settings({"config": empty_config, "server.cors_allow_origins": [origin]})


def test_cors_origins_default_to_any_and_take_a_list(empty_config: str) -> None:
    assert load_settings({"config": empty_config}).server.cors_allow_origins == ["*"]
    listed = ["https://app.example.com", "http://localhost:5173"]
    assert (
        load_settings({"config": empty_config, "server.cors_allow_origins": listed}).server.cors_allow_origins
        == listed
    )


@pytest.mark.parametrize(
    ("entry", "secret"),
    [
        ({"name": "a", "key": "sk-shrt"}, "sk-shrt"),  # below min_length
        ({"name": "a", "api_key": "sk-live-0123456789abcdef"}, "sk-live-0123456789abcdef"),  # misspelt field
        ({"name": "a", "key": 1234567890123}, "1234567890123"),  # YAML reads an all-digit key as int
        # under auth, in fields not named like a secret: a key pasted into the wrong one
        ({"name": "a", "sha256": "sk-live-SECRET-0001"}, "sk-live-SECRET-0001"),
        ({"name": "a", "key": "sk-live-SECRET-0002", "max_concurrency": "sk-live-SECRET-0002"}, "SECRET"),
    ],
)
def test_a_rejected_api_key_is_not_echoed(empty_config: str, entry: dict[str, object], secret: str) -> None:
    with pytest.raises(ConfigError, match=r"^auth\.keys\.0\.") as info:
        load_settings({"config": empty_config, "auth.keys": [entry]})
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("server.api_key", "sk-live-SECRET-123456"),  # vLLM's spelling, outside auth: an unknown field
        ("engine.hf_token", "hf_SECRET123456"),
        ("server.bearer", "SECRET-123456"),  # any unknown field, named like a secret or not
        ("engine.download_dir_pw", "SECRET-123456"),
    ],
)
def test_a_secret_outside_auth_is_not_echoed(empty_config: str, field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: Extra inputs are not permitted") as info:
        load_settings({"config": empty_config, field: value})
    assert "SECRET" not in str(info.value)


def test_keys_given_as_a_string_are_not_echoed(env: pytest.MonkeyPatch, empty_config: str) -> None:
    env.setenv("GATEWAY_AUTH__KEYS", '"sk-live-SECRET-0003"')
    with pytest.raises(ConfigError, match=r"^auth\.keys: ") as info:
        load_settings({"config": empty_config})
    assert "SECRET" not in str(info.value)


@pytest.mark.parametrize("name", ["hf_token", "access_token", "private_key"])
def test_a_value_under_a_secret_name_is_not_echoed(empty_config: str, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"config": empty_config, f"engine.limit_mm_per_prompt.{name}": "hf_SECRETVALUE"})
    assert "SECRETVALUE" not in str(info.value)


def test_a_rejected_plain_value_is_echoed(empty_config: str) -> None:
    with pytest.raises(ConfigError, match=r"^limits.default_max_tokens: .* \(got 'many'\)"):
        load_settings({"config": empty_config, "limits.default_max_tokens": "many"})


@pytest.mark.parametrize("key", ["sk-pässwort-0001", "sk-trailing-space ", " sk-leading-space"])
def test_a_key_no_header_can_carry_is_refused(empty_config: str, key: str) -> None:
    """The header is read as latin-1 and the bearer token stripped: such a key never matches."""
    with pytest.raises(ConfigError, match=r"^auth\.keys\.0\.key: .*printable ASCII") as info:
        load_settings({"config": empty_config, "auth.keys": [{"name": "a", "key": key}]})
    assert key.strip() not in str(info.value)


def test_two_keys_with_one_name_are_refused(empty_config: str) -> None:
    """The name is the identity for max_concurrency and the owner of stored responses."""
    keys = [{"name": "team", "key": "sk-team-key-one"}, {"name": "team", "key": "sk-team-key-two"}]
    with pytest.raises(ConfigError, match=r"^auth\.keys: .*two keys are named 'team'") as info:
        load_settings({"config": empty_config, "auth.keys": keys})
    assert "sk-team" not in str(info.value)


def test_one_key_under_two_names_is_refused(empty_config: str) -> None:
    keys = [{"name": "a", "key": "sk-shared-key"}, {"name": "b", "key": "sk-shared-key"}]
    with pytest.raises(ConfigError, match=r"^auth\.keys: .*keys 'a' and 'b' are the same key") as info:
        load_settings({"config": empty_config, "auth.keys": keys})
    assert "sk-shared" not in str(info.value)


def test_invalid_env_value_names_the_field(env: pytest.MonkeyPatch, yaml_file: Path) -> None:
    env.setenv("GATEWAY_SERVER__PORT", "not-a-port")
    with pytest.raises(ConfigError, match=r"^server\.port:"):
        load_settings({"config": str(yaml_file)})


def test_gateway_variables_that_name_no_setting_are_reported() -> None:
    environ = {
        "GATEWAY_SERVER_PORT": "9000",  # one underscore: pydantic-settings never looks it up
        "GATEWAY_BOGUS": "1",
        "GATEWAY_SERVER__PORT": "9000",
        "gateway_engine__max_num_seqs": "4",  # env names are case-insensitive
        "GATEWAY_CONFIG": "x.yaml",
        "GATEWAY_API_KEY": "sk-x",  # the chat CLI's
        "GATEWAY_SERVICE_HOST": "10.0.0.1",  # Kubernetes, for a Service named gateway
        "GATEWAY_PORT_8000_TCP": "tcp://10.0.0.1:8000",
        "HOME": "/root",
    }
    assert unknown_env(environ) == [
        "GATEWAY_BOGUS is not a setting and is ignored",
        "GATEWAY_SERVER_PORT is not a setting and is ignored; nested settings take two underscores: "
        "GATEWAY_SERVER__PORT",
    ]


def test_the_two_underscore_hint_names_only_a_setting_that_exists() -> None:
    """``catalog`` and ``config`` are values, not sections: ``GATEWAY_CATALOG_POLL`` was told
    to write ``GATEWAY_CATALOG__POLL``, which pydantic-settings ignores as silently, and that
    one itself passed unreported."""
    environ = {
        "GATEWAY_CATALOG_POLL": "1",
        "GATEWAY_CATALOG__X": "1",  # nesting under a value: never read
        "GATEWAY_CATALOG_POLL_S": "1",  # a setting
        "GATEWAY_SERVER_PORTS": "1",  # no field of server: no hint
        "GATEWAY_LIMITS_MAX_N": "1",
    }
    assert unknown_env(environ) == [
        "GATEWAY_CATALOG_POLL is not a setting and is ignored",
        "GATEWAY_CATALOG__X is not a setting and is ignored",
        "GATEWAY_LIMITS_MAX_N is not a setting and is ignored; nested settings take two underscores: "
        "GATEWAY_LIMITS__MAX_N",
        "GATEWAY_SERVER_PORTS is not a setting and is ignored",
    ]


def test_cli_warns_of_a_gateway_variable_that_names_no_setting(
    empty_config: str, env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env.setenv("GATEWAY_LIMITS_MAX_INFLIGHT", "8")
    assert main(["adapters", "list", "--config", empty_config]) == 0
    assert capsys.readouterr().err.startswith(
        "warning: GATEWAY_LIMITS_MAX_INFLIGHT is not a setting and is ignored; "
        "nested settings take two underscores: GATEWAY_LIMITS__MAX_INFLIGHT\n"
    )


def test_missing_config_file_is_reported(env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="config: file not found"):
        load_settings({"config": "/nonexistent/gateway.yaml"})


def test_a_section_given_twice_is_refused_with_its_line(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PyYAML keeps the last of two ``engine:`` sections: the first was dropped without a word."""
    dup = tmp_path / "dup.yaml"
    dup.write_text("engine:\n  max_num_seqs: 8\nserver:\n  port: 8123\nengine:\n  max_model_len: 512\n")
    with pytest.raises(ConfigError) as info:
        load_settings({"config": str(dup)})
    assert str(info.value) == (
        f"config: {dup}: line 5, column 1: key 'engine' is given twice (while reading a mapping)"
    )
    dup.write_text("engine:\n  max_num_seqs: 8\n  max_num_seqs: 16\n")  # in a section too
    with pytest.raises(ConfigError, match="line 3, column 3: key 'max_num_seqs' is given twice"):
        load_settings({"config": str(dup)})


@pytest.mark.parametrize(("text", "what"), [("- 1\n- 2\n", "list"), ("just words\n", "single value")])
def test_a_config_file_that_is_not_a_mapping_is_one_line(
    env: pytest.MonkeyPatch, tmp_path: Path, text: str, what: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as info:  # was a TypeError (a traceback) or a dict-update message
        load_settings({"config": str(bad)})
    assert str(info.value) == (
        f"config: {bad}: the file must be a mapping of sections (server:, engine:, ...), not a {what}"
    )


@pytest.mark.parametrize("text", ["8000: port\n", "on: true\n", "null: 1\n"])
def test_a_section_name_that_is_not_a_string_is_one_line(
    env: pytest.MonkeyPatch, tmp_path: Path, text: str
) -> None:
    bad = tmp_path / "bad.yaml"  # `on:` is a boolean in YAML 1.1
    bad.write_text(text)
    with pytest.raises(ConfigError, match="section names must be strings"):  # was an AttributeError
        load_settings({"config": str(bad)})


def test_a_config_path_that_is_a_directory_says_so(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^config: not a file: {tmp_path}$"):
        load_settings({"config": str(tmp_path)})


def test_malformed_yaml_is_one_line(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_settings({"config": str(bad)})
    assert "\n" not in str(info.value)


def test_cli_invalid_setting_exits_2_without_traceback(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], yaml_file: Path
) -> None:
    code = main(["adapters", "validate", "--config", str(yaml_file), "--set", "engine.max_num_seqs=0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: engine.max_num_seqs:")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "engine.dtype=[unclosed"], "error: --set engine.dtype: the value is not valid YAML ("),
        (
            ["--max-lora-rank", "4", "--set", "engine.max_lora_rank.x=1"],
            "error: engine.max_lora_rank.x: engine.max_lora_rank is a value, not a section\n",
        ),
    ],
)
def test_cli_bad_set_is_one_line_and_exit_2(
    empty_config: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["adapters", "list", "--config", empty_config, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_lora_scheduling_knobs(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    s = load_settings({"config": str(empty)})
    limits = s.limits
    assert (limits.lora_scheduling, limits.lora_quantum_s, limits.max_adapter_wait_s) == ("fair", 0.5, 5.0)
    assert s.engine.scheduling_policy == "fcfs"
    env.setenv("GATEWAY_LIMITS__LORA_SCHEDULING", "off")
    keys = '[{"name": "ci", "key": "sk-ci-000001", "weight": 2, "priority": -1}]'
    env.setenv("GATEWAY_AUTH__KEYS", keys)
    s = load_settings({"config": str(empty), "engine.scheduling_policy": "priority"})
    assert s.limits.lora_scheduling == "off" and s.engine.scheduling_policy == "priority"
    assert (s.auth.keys[0].weight, s.auth.keys[0].priority) == (2.0, -1)
    for bad in ({"limits.lora_scheduling": "fifo"}, {"limits.max_adapter_wait_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load_settings({"config": str(empty), **bad})


@pytest.mark.parametrize("word", ["off", "on"])
def test_lora_scheduling_takes_yaml_switch_words(env: pytest.MonkeyPatch, tmp_path: Path, word: str) -> None:
    """README writes ``limits.lora_scheduling: off``; YAML 1.1 reads a bare off/on as a bool,
    in the settings file and in ``--set`` alike."""
    expected = {"off": "off", "on": "fair"}[word]
    config = tmp_path / "gateway.yaml"
    config.write_text(f"limits:\n  lora_scheduling: {word}\n")
    assert load_settings({"config": str(config)}).limits.lora_scheduling == expected
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    args = build_parser().parse_args(["serve", "--set", f"limits.lora_scheduling={word}"])
    assert load_settings({**_overrides(args), "config": str(empty)}).limits.lora_scheduling == expected


class FakeGateway(http.server.ThreadingHTTPServer):
    """Answers every request with ``reply``: (status, content type, body)."""

    reply = (200, "application/json", b"{}")
    models_reply = (200, "application/json", b'{"data": []}')  # GET /v1/models
    posted: list[Any]  # the bodies of the POSTs, in order (set by the fixture)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Reply(http.server.BaseHTTPRequestHandler):
    server: FakeGateway

    def do_GET(self) -> None:
        self._send(*self.server.models_reply)

    def do_POST(self) -> None:
        self.server.posted.append(json.loads(self.rfile.read(int(self.headers.get("content-length") or 0))))
        self._send(*self.server.reply)

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_gateway() -> Iterator[FakeGateway]:
    with FakeGateway(("127.0.0.1", 0), _Reply) as server:
        server.posted = []
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server
        server.shutdown()


def chat(url: str) -> list[str]:
    return ["chat", "--url", url, "--model", "m", "hi"]


def test_cli_chat_with_the_server_down_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeGateway(("127.0.0.1", 0), _Reply) as server:
        url = server.url  # a port nothing listens on once closed
    assert main(chat(url)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url}: ") and err.count("\n") == 1


def test_cli_chat_url_without_a_scheme_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(chat("localhost:8000")) == 2
    assert (
        capsys.readouterr().err == "error: --url must start with http:// or https:// (got 'localhost:8000')\n"
    )


def test_cli_chat_error_body_that_is_not_json(
    fake_gateway: FakeGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_gateway.reply = (502, "text/html", b"<html>502 Bad Gateway</html>")  # a proxy in front
    assert main(chat(fake_gateway.url)) == 1
    assert capsys.readouterr().err == "error 502: <html>502 Bad Gateway</html>\n"


def test_cli_chat_error_event_mid_stream_is_reported(
    fake_gateway: FakeGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    error = {
        "error": {"message": "engine died", "type": "server_error", "param": None, "code": "engine_error"}
    }
    body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\n".encode()
    fake_gateway.reply = (200, "text/event-stream", body)
    assert main(chat(fake_gateway.url)) == 1
    out, err = capsys.readouterr()
    assert out == "[None] Hel\n" and err == "error: engine died\n"


def test_cli_chat_reads_past_a_model_list_that_is_not_json(
    fake_gateway: FakeGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_gateway.models_reply = (200, "text/html", b"<html>a proxy page</html>")
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    fake_gateway.reply = (200, "text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
    assert main(["chat", "--url", fake_gateway.url, "hi"]) == 0  # no --model: the list is read
    assert capsys.readouterr().out == "[None] Hi\n"


def test_cli_chat_reports_an_unreadable_event(
    fake_gateway: FakeGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_gateway.reply = (200, "text/event-stream", b"data: {not json\n\n")
    assert main(chat(fake_gateway.url)) == 1
    assert capsys.readouterr().err == "error: unreadable event: {not json\n"


def test_cli_chat_stream_cut_short_is_an_error(
    fake_gateway: FakeGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stream whose body ends before ``data: [DONE]`` (a connection closed cleanly mid-answer,
    a proxy's 200 page) is not a whole answer."""
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Once"}}]}
    fake_gateway.reply = (200, "text/event-stream", f"data: {json.dumps(chunk)}\n\n".encode())
    assert main(chat(fake_gateway.url)) == 1
    out, err = capsys.readouterr()
    assert out == "[None] Once\n" and "ended without its [DONE] line" in err
    fake_gateway.reply = (200, "text/html", b"<html>a proxy page</html>")
    assert main(chat(fake_gateway.url)) == 1


def test_cli_chat_session_goes_on_after_a_failed_turn(
    fake_gateway: FakeGateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interactive session reports a refused turn (here a 429) and asks again, without it in
    the history; its status at the end of input is 1."""
    error = {"error": {"message": "over capacity", "type": "rate_limit_error", "param": None, "code": None}}
    fake_gateway.reply = (429, "application/json", json.dumps(error).encode())
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    assert main(["chat", "--url", fake_gateway.url, "--model", "m"]) == 1
    assert capsys.readouterr().err == "error 429: over capacity\n" * 2
    assert [body["messages"] for body in fake_gateway.posted] == [
        [{"role": "user", "content": "first"}],
        [{"role": "user", "content": "second"}],
    ]


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("http://h/proxy/V1", "http://h/proxy"),
        ("http://h:8000", "http://h:8000"),
        ("http://v1", "http://v1"),  # a host named v1 is not the SDK's /v1
        ("http://v1:8000/", "http://v1:8000/"),
    ],
)
def test_chat_takes_the_sdk_base_url_only_from_the_path(url: str, root: str) -> None:
    assert _base_url(url) == root


def test_an_env_var_that_is_not_json_is_named(env: pytest.MonkeyPatch) -> None:
    """pydantic-settings said 'error parsing value for field "auth"': which variable, and why?"""
    env.setenv("GATEWAY_AUTH__KEYS", "notjson")
    with pytest.raises(ConfigError) as info:
        load_settings({})
    assert str(info.value) == (
        "config: GATEWAY_AUTH__KEYS: not valid JSON (a list or a mapping in an environment variable "
        "is written as JSON)"
    )


def test_a_model_path_under_home_reaches_the_engine_expanded(empty_config: str) -> None:
    """The start checked ``~/models/x`` as a path (expanding it there), but vLLM
    was given it as written, and took it for a Hugging Face repo id."""
    settings = load_settings({"config": empty_config, "engine.model": "~/models/gemma"})
    assert settings.engine.model == str(Path.home() / "models" / "gemma")
    assert load_settings({"config": empty_config, "engine.model": "org/model"}).engine.model == "org/model"


def test_an_env_var_that_is_not_json_is_named_alone(env: pytest.MonkeyPatch) -> None:
    """The section's other variables, fine as they are, were named with it."""
    env.setenv("GATEWAY_ENGINE__ENGINE_ARGS", "{enforce_eager: true}")
    env.setenv("GATEWAY_ENGINE__MAX_NUM_SEQS", "4")
    with pytest.raises(ConfigError) as info:
        load_settings({})
    assert str(info.value).startswith("config: GATEWAY_ENGINE__ENGINE_ARGS: not valid JSON")


# -- found by a review of the operator's settings ------------------------------------------------
@pytest.mark.parametrize("names", [["max_loras"], ["max_num_seqs", "model"], ["enable_lora"]])
def test_engine_args_may_not_set_the_gateways_engine_fields(empty_config: str, names: list[str]) -> None:
    """``engine_args: {max_loras: 2}`` reached vLLM while the scheduler, pins and limits were
    sized from ``engine.max_loras``: pins the engine has no room for."""
    with pytest.raises(ConfigError) as refused:
        load_settings({"config": empty_config, "engine.engine_args": {name: 2 for name in names}})
    for name in names:
        assert f"engine.{name}" in str(refused.value)


def test_engine_args_pass_vllms_other_arguments(empty_config: str) -> None:
    args = {"enforce_eager": True, "max_seq_len_to_capture": 512}
    assert load_settings({"config": empty_config, "engine.engine_args": args}).engine.engine_args == args


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_model_is_the_embedded_one(env: pytest.MonkeyPatch, empty_config: str, value: str) -> None:
    """compose's ``GATEWAY_ENGINE__MODEL: ${MODEL:-}`` and ``--model ""`` (vLLM got model="")."""
    env.setenv("GATEWAY_ENGINE__MODEL", value)
    assert load_settings({"config": empty_config}).engine.model is None
    env.delenv("GATEWAY_ENGINE__MODEL")
    settings = load_settings({"config": empty_config, "engine.model": value, "engine.tokenizer": ""})
    assert settings.engine.model is None and settings.engine.tokenizer is None


def test_a_key_given_as_key_and_sha256_is_refused(empty_config: str) -> None:
    """Which one? A rotation half done: the old key kept working while the new hash was dropped."""
    keys = [{"name": "ci", "key": "sk-old-key-1234", "sha256": "0" * 64}]
    with pytest.raises(ConfigError, match="key or sha256, not both"):
        load_settings({"config": empty_config, "auth.keys": keys})


def test_the_config_variable_is_read_in_any_case(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("engine:\n  max_num_seqs: 3\n")
    env.setenv("gateway_config", str(mine))
    assert load_settings().engine.max_num_seqs == 3


def test_path_flags_are_the_current_directorys(
    env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``--config``: a path typed on the command line; the settings' own paths stay the
    project's (``catalog: configs/adapters.yaml`` in a file)."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "adapters.yaml").write_text("routes:\n  - name: here\n    system_prompt: Hi.\n")
    (tmp_path / "empty.yaml").write_text("{}\n")
    env.chdir(tmp_path)
    args = build_parser().parse_args(
        ["serve", "--config", "empty.yaml", "--catalog", "configs/adapters.yaml"]
    )
    assert _overrides(args)["catalog"] == str(tmp_path / "configs" / "adapters.yaml")
    settings = load_settings({"config": "empty.yaml", "catalog": "configs/adapters.yaml"})  # --set's
    assert settings.catalog == PROJECT_ROOT / "configs" / "adapters.yaml"
    assert main(["adapters", "list", "--config", "empty.yaml", "--catalog", "configs/adapters.yaml"]) == 0
    assert "here" in capsys.readouterr().out


def test_engine_args_variables_are_read_as_yaml(env: pytest.MonkeyPatch, empty_config: str) -> None:
    """As ``--set`` reads its values: vLLM's engine arguments take what they are given, and the
    string "false" is true. The JSON form is typed already, its strings stay strings."""
    env.setenv("GATEWAY_ENGINE__ENGINE_ARGS__ENFORCE_EAGER", "false")
    env.setenv("GATEWAY_ENGINE__ENGINE_ARGS__MAX_SEQ_LEN_TO_CAPTURE", "512")
    env.setenv("GATEWAY_ENGINE__ENGINE_ARGS__TOKENIZER_MODE", "slow")
    args = load_settings({"config": empty_config}).engine.engine_args
    assert args == {"enforce_eager": False, "max_seq_len_to_capture": 512, "tokenizer_mode": "slow"}
    for name in ("ENFORCE_EAGER", "MAX_SEQ_LEN_TO_CAPTURE", "TOKENIZER_MODE"):
        env.delenv(f"GATEWAY_ENGINE__ENGINE_ARGS__{name}")
    env.setenv("GATEWAY_ENGINE__ENGINE_ARGS", '{"revision": "1234"}')
    assert load_settings({"config": empty_config}).engine.engine_args == {"revision": "1234"}


def test_a_settings_file_nested_too_deeply_is_one_line(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("engine: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_settings({"config": str(deep)})
