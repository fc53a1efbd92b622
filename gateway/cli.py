"""Command line: argv -> settings -> uvicorn (or a one-shot command).

python -m gateway serve [flags]        run the gateway (no flags: embedded Gemma 3 270M)
python -m gateway prepare-model        build the embedded model directory now
python -m gateway adapters list        show the catalog's routes
python -m gateway adapters validate    check a catalog without starting an engine
python -m gateway chat                 stream answers from a running gateway
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from gateway.errors import ConfigError
from gateway.settings import GatewaySettings, load_settings, unknown_env

# The chat CLI's key when --api-key is not given (the OpenAI SDK reads OPENAI_API_KEY the same
# way; not that one, which may hold a key for OpenAI itself, not to be sent to a gateway).
API_KEY_ENV = "GATEWAY_API_KEY"
CONNECT_TIMEOUT_S = 10.0  # `chat`: a gateway that does not accept the connection by then is not there

# flag -> dotted settings key; each is also settable via GATEWAY_... env vars and YAML
_FLAGS: list[tuple[str, str, type, str]] = [
    ("--host", "server.host", str, "address to bind"),
    ("--port", "server.port", int, "port to bind"),
    ("--workers", "server.workers", int, "uvicorn workers (must be 1: one engine per process)"),
    ("--log-level", "server.log_level", str, "debug, info, warning or error"),
    ("--model", "engine.model", str, "model directory or Hugging Face repo id (default: embedded Gemma 3)"),
    ("--served-model-name", "engine.served_model_name", str, "name of the base model route"),
    ("--dtype", "engine.dtype", str, "auto, float32, bfloat16, float16 (half), float"),
    ("--max-model-len", "engine.max_model_len", int, "context length"),
    ("--max-num-seqs", "engine.max_num_seqs", int, "concurrent sequences in the engine"),
    ("--gpu-memory-utilization", "engine.gpu_memory_utilization", float, "fraction of GPU memory"),
    ("--tensor-parallel-size", "engine.tensor_parallel_size", int, "GPUs per engine"),
    ("--max-loras", "engine.max_loras", str, "adapters in GPU slots at once, or auto"),
    ("--max-lora-rank", "engine.max_lora_rank", int, "largest adapter rank accepted"),
    ("--max-cpu-loras", "engine.max_cpu_loras", int, "adapters in host memory (default: catalog+max-loras)"),
    ("--load-format", "engine.load_format", str, "vLLM load format (e.g. dummy)"),
    ("--catalog", "catalog", str, "adapter catalog YAML"),
    ("--adapters-root", "adapters_root", str, "folder adapters must live in"),
]
# Relative paths in the settings (file, GATEWAY_*, --set) are the project's; these flags' the cwd's.
_PATH_FLAGS = frozenset({"catalog", "adapters_root"})
# What `adapters list` / `validate` read: the catalog, and the model its adapters are checked against.
_CATALOG_FLAGS = frozenset(
    {"--model", "--served-model-name", "--max-lora-rank", "--catalog", "--adapters-root"}
)


def _settings_args(parser: argparse.ArgumentParser, only: frozenset[str] | None = None) -> None:
    parser.add_argument("--config", help="settings YAML (default configs/gateway.yaml, or GATEWAY_CONFIG)")
    for flag, key, kind, help_text in _FLAGS:
        if only is None or flag in only:
            parser.add_argument(flag, dest=key, type=kind, help=help_text)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting by dotted key, value as YAML (e.g. engine.engine_args.enforce_eager=true)",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given (argparse leaves the others None), then each ``--set`` item, whose
    null is a value: ``--set engine.max_model_len=null``."""
    found: dict[str, Any] = {"config": args.config} if args.config is not None else {}
    for _, key, _, _ in _FLAGS:
        if getattr(args, key, None) is not None:  # a command may not take every flag
            found[key] = getattr(args, key)
            if key in _PATH_FLAGS:  # a path typed on the command line is the shell's: from here
                found[key] = os.path.abspath(os.path.expanduser(found[key]))
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        found[key.strip()] = _yaml_value(key.strip(), value)
    return found


def _yaml_value(key: str, value: str) -> Any:
    """``value`` read as YAML; the error names the problem, not the value (it may be a key)."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "unreadable"
        raise ConfigError(f"--set {key}: the value is not valid YAML ({problem})") from None
    except ValueError as exc:  # a tag's value it cannot build: !!int x, a date 2024-02-30
        raise ConfigError(f"--set {key}: the value is not valid YAML ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="An OpenAI-compatible LLM gateway: one vLLM engine, and for each request a LoRA\n"
        "adapter or prompt preset chosen by its `model` or `task`.",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway", description="Run the gateway (one engine).")
    _settings_args(serve)

    prep = sub.add_parser(
        "prepare-model",
        help="prepare the embedded model",
        description="Build the embedded Gemma 3 270M directory in the cache (engine.model is not "
        "read: a model of your own needs no preparing).",
    )
    _settings_args(prep)
    prep.add_argument("--force", action="store_true", help="rebuild even if prepared")

    adapters = sub.add_parser(
        "adapters", help="inspect the adapter catalog", description="Inspect the adapter catalog."
    )
    adapters_sub = adapters.add_subparsers(dest="adapters_command", required=True)
    for name, text in (("list", "list routes"), ("validate", "check the catalog without starting an engine")):
        p = adapters_sub.add_parser(name, help=text, description=text)
        _settings_args(p, _CATALOG_FLAGS)

    chat = sub.add_parser(
        "chat", help="chat with a running gateway", description="Stream answers from a running gateway."
    )
    chat.add_argument(
        "--url", default="http://127.0.0.1:8000", help="gateway base URL (or the OpenAI SDK's, ending in /v1)"
    )
    chat.add_argument("--model", default=None, help="route (model name or alias)")
    chat.add_argument("--task", default=None, help="route by task")
    chat.add_argument(
        "--api-key",
        default=None,
        help=f"API key (default: ${API_KEY_ENV}, which, unlike a flag, stays out of ps and shell history)",
    )
    chat.add_argument("message", nargs="*", help="one message; omit for an interactive session")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "chat":
            return _chat(args)
        settings = load_settings(_overrides(args))
        for line in unknown_env(os.environ):
            print(f"warning: {line}", file=sys.stderr)
        _configure_logging(settings.server.log_level)
        if args.command == "serve":
            return _serve(settings)
        if args.command == "prepare-model":
            from gateway.embedded import prepare_embedded_model

            try:
                print(prepare_embedded_model(settings.cache_dir / "models", force=args.force))
            except OSError as exc:  # as ``serve`` says it (state.snapshot_dir), not a traceback
                why = exc.strerror or exc
                raise ConfigError(f"cache_dir: cannot write under {settings.cache_dir}: {why}") from None
            return 0
        return _adapters(settings, args.adapters_command)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The access log is one JSON object per line, nothing around it, for log shippers.
    access = logging.getLogger("gateway.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.propagate = False


def _serve(settings: GatewaySettings) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import DrainingServer, bind_socket

    # Listen first: a port in use must fail now, before minutes of engine start (and GPU memory).
    sock = bind_socket(settings.server.host, settings.server.port)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_keep_alive=settings.server.timeout_keep_alive,
        # Draining happens before uvicorn's own shutdown (see DrainingServer), so what is
        # left by then has had its time; don't wait long again.
        timeout_graceful_shutdown=2,
        access_log=False,  # replaced by the JSON access log (gateway.access)
    )
    gateway = app.state.gateway
    server = DrainingServer(config, gateway)
    gateway.request_exit = server.exit_now
    server.run(sockets=[sock])
    if gateway.startup_error:  # the last line, after uvicorn's shutdown lines
        print(f"error: {gateway.startup_error}", file=sys.stderr)
    return int(gateway.exit_code)


def _adapters(settings: GatewaySettings, command: str) -> int:
    from gateway.adapters_check import model_shapes
    from gateway.catalog import LoraIds, load_table

    model = settings.engine.model
    if model is None:
        from gateway.embedded import EMBEDDED_NAME, embedded_model_dir, is_prepared

        base_name = settings.engine.served_model_name or EMBEDDED_NAME
        embedded = embedded_model_dir(settings.cache_dir / "models")
        modules = model_shapes(embedded) if is_prepared(embedded) else None
        where, model_names = str(embedded), (EMBEDDED_NAME,)
    else:
        base_name = settings.engine.served_model_name or model.rstrip("/").rsplit("/", 1)[-1]
        modules = model_shapes(model)
        where, model_names = model, (model,)
    if modules is None:  # as the gateway's start says it (state.py), not a silent pass
        print(
            f"NOTE: no safetensors weights of the model at {where}: adapters are checked without "
            "the model's module shapes (their own tensors still are; vLLM does not check that they "
            "fit the model)",
            file=sys.stderr,
        )
    # load_table logs nothing: this command reports each rejected entry and warning (below).
    table = load_table(
        settings.catalog,
        base_name=base_name,
        adapters_root=settings.adapters_root,
        max_lora_rank=settings.engine.max_lora_rank,
        model_modules=modules,
        lora_ids=LoraIds(),
        model_names=model_names,
    )
    for route in table.all_routes():
        detail = (
            f"adapter={route.lora.path} digest={route.digest[:12]} rank={route.rank}"
            if route.lora and route.digest
            else ""
        )
        names = ",".join(route.aliases) or "-"
        tasks = ",".join(route.tasks) or "-"
        print(f"{route.name:<20} {route.kind:<7} aliases={names} tasks={tasks} {detail}".rstrip())
    for route in table.routes.values():
        for warning in route.warnings:
            print(f"WARNING {route.name}: {warning}", file=sys.stderr)
    for name, error in table.errors.items():
        print(f"REJECTED {name}: {error}", file=sys.stderr)
    if command == "validate":
        print("catalog OK" if not table.errors else f"catalog has {len(table.errors)} rejected entries")
        return 0 if not table.errors else 1
    return 0


class _BadInput(Exception):
    """A message the gateway could not be sent (the CLI says so and exits 1)."""


def _chat(args: argparse.Namespace) -> int:
    import httpx

    if not args.url.lower().startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https:// (got {args.url!r})")
    if args.message and not " ".join(args.message).strip():  # ``chat ""``: not a session on stdin
        raise ConfigError("the message is empty (leave it out for an interactive session)")
    api_key, source = args.api_key, "--api-key"
    if api_key is None:
        api_key, source = os.environ.get(API_KEY_ENV), API_KEY_ENV
    if api_key and not (api_key.isascii() and api_key.isprintable()):
        raise ConfigError(f"{source} must be printable ASCII (it is sent in an HTTP header)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        base_url = httpx.URL(_base_url(args.url))
    except (ValueError, httpx.InvalidURL) as exc:  # "http://[::1", "http://]:9"
        raise ConfigError(f"--url is not a valid URL ({exc})") from None
    if base_url.port is not None and not 0 < base_url.port < 65536:
        raise ConfigError(f"--url has no valid port (1 to 65535): {base_url.port}")
    try:
        # No bound on reading an answer (it streams for as long as it is), but on connecting.
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as client:
            return _converse(client, args)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 1
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except UnicodeError as exc:  # a host name IDNA refuses ("a..b"), which httpx lets through
        print(f"error: {args.url}: not a valid host name ({exc})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: leaving the stream closes it, which stops the answer
        print(flush=True)
        return 130
    except BrokenPipeError:  # stdout closed (``| head``): stop quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141


def _base_url(url: str) -> str:
    """The gateway's root: the OpenAI SDK's base URL (README: ``.../v1``) names it too, and
    the paths below are /v1/... from the root (else /v1/v1/chat/completions, a 404)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.lower().endswith("/v1"):  # only a path names the SDK's base URL, never a host "v1"
        return url
    return urlunsplit(parts._replace(path=path[: -len("/v1")]))


def _converse(client: Any, args: argparse.Namespace) -> int:
    """One answer (status 0 or 1), or a session until end of input. A turn that fails is
    reported and left out of the history, and the session goes on; its status is then 1."""
    history: list[dict[str, str]] = []
    one_shot = " ".join(args.message)
    model = args.model or (None if args.task else _base_model(client))
    failed = False
    while True:
        text = one_shot or _ask()
        if text is None:
            return 1 if failed else 0
        _check_utf8(text)
        body: dict[str, Any] = {"model": model, "messages": [*history, {"role": "user", "content": text}]}
        if args.task:
            body["task"] = args.task
        answer = _answer(client, body)
        if one_shot:
            return 0 if answer is not None else 1
        if answer is None:
            failed = True
            continue
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def _answer(client: Any, body: dict[str, Any]) -> str | None:
    """Stream one answer to stdout; None, with the error on stderr, if it failed."""
    pieces = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            print(f"error {response.status_code}: {_error_message(response)}", file=sys.stderr)
            return None
        print(f"[{response.headers.get('x-adapter')}] ", end="", flush=True)
        finished = False
        for line in response.iter_lines():
            if line == "data: [DONE]":
                finished = True
                break
            if not line.startswith("data: {"):
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                event = {"error": {"message": f"unreadable event: {line[6:206]}"}}
            if "error" in event:  # the stream failed after it started
                print()
                print(f"error: {_message(event, line[6:206])}", file=sys.stderr)
                return None
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content") or ""
                pieces.append(piece)
                print(piece, end="", flush=True)
    print()
    if not finished:  # a proxy's 200 page, or a connection closed cleanly mid-answer
        print("error: the stream ended without its [DONE] line: the answer may be cut short", file=sys.stderr)
        return None
    return "".join(pieces)


def _error_message(response: Any) -> str:
    """The message of an error answer; the start of its body when that is not OpenAI's error
    JSON (a proxy in front answering with an HTML page)."""
    try:
        data = response.json()
    except ValueError:
        data = None
    return _message(
        data, response.text[:200] or f"{response.reason_phrase or 'no reason given'} (empty body)"
    )


def _message(data: Any, fallback: str) -> str:
    try:
        return str(data["error"]["message"])
    except (KeyError, TypeError):
        return fallback


def _base_model(client: Any) -> str | None:
    """The base model's name (/v1/* requires a model or a task); None if it cannot be read,
    and the server's answer will say why. A key that may not use it (``routes:`` in
    auth.keys) is told to pick a route, and which ones it may use."""
    response = client.get("/v1/models")
    if response.status_code != 200:
        return None
    try:
        cards = response.json()["data"]
        base = next((c["id"] for c in cards if c.get("kind") == "base" and not c.get("alias_of")), None)
        usable = ", ".join(str(c["id"]) for c in cards[:_LISTED]) + (", ..." if len(cards) > _LISTED else "")
        ours = all("kind" in c for c in cards)  # another server's list (vLLM's) has no kinds
    except (ValueError, KeyError, TypeError, AttributeError):  # not the gateway's model list
        return None
    if base is None and ours:
        raise _BadInput(
            f"this key may not use the base model: pass --model (it may use: {usable or 'none'}) or --task"
        )
    return None if base is None else str(base)


_LISTED = 10  # routes named in the hint above


def _ask() -> str | None:
    """The next question; blank lines are skipped (a loop: a long run of them is no recursion)."""
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            return None
        except UnicodeDecodeError:
            raise _BadInput("the input is not valid UTF-8") from None
        if text:
            return text


def _check_utf8(text: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no JSON body carries."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadInput("the message is not valid UTF-8") from None
