"""Settings: one ``GatewaySettings`` built from CLI flags > env vars > YAML > defaults.

Env vars use the ``GATEWAY_`` prefix and ``__`` for nesting
(``GATEWAY_ENGINE__MAX_NUM_SEQS=32``). The YAML file is ``configs/gateway.yaml`` unless
``GATEWAY_CONFIG`` (or ``--config``) names another. Engine fields keep vLLM's engine-arg
names, and ``engine.engine_args`` passes anything else through to vLLM unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from gateway import yaml_file
from gateway.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "gateway.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSettings(_Section):
    """Engine arguments, named as vLLM names them."""

    model: str | None = Field(
        None, description="model directory or Hugging Face repo id; empty = embedded Gemma 3 270M"
    )
    served_model_name: str | None = None
    tokenizer: str | None = None
    # vLLM's own choices (ModelConfig.dtype): checked here, not after the engine's imports.
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    max_model_len: int | None = Field(2048, gt=0)
    max_num_seqs: int = Field(16, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["mp", "ray", "uni"] | None = None
    trust_remote_code: bool = False
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=dict)
    enable_lora: bool = True
    max_loras: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="adapters in GPU slots at once; auto: one per catalog adapter plus one, at least 4, "
        "at most max_num_seqs (and max_cpu_loras where set), while the slots take at most 1 GiB",
    )
    max_lora_rank: int = Field(16, ge=1)
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters in the engine's CPU cache; left out: sized to the catalog"
    )
    report_lora_slots: bool = Field(
        True,
        description="mix the gateway's slot report into vLLM's workers (worker_extension_cls), so residency "
        "says gpu or cpu; off where the workers cannot import gateway.engine",
    )
    enable_prefix_caching: bool | None = None
    load_format: str | None = None
    seed: int | None = 0
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM's scheduler; with 'priority' an API key's priority reaches the engine"
    )
    cpu_kvcache_space_gib: int = Field(2, ge=1, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="passed to vLLM unchanged")

    @field_validator("max_loras", mode="before")
    @classmethod
    def _slots(cls, value: object) -> object:
        # One message for both branches of the union, not one per branch.
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
            return int(value)
        raise ValueError("expected a number of GPU slots (1 or more) or 'auto'")

    @property
    def gpu_slots(self) -> int:
        """``max_loras`` as a number: ``auto`` is sized before the engine starts
        (``state.with_adapter_slots``)."""
        if self.max_loras == "auto":
            raise RuntimeError("engine.max_loras is 'auto': it is sized before the engine starts")
        return self.max_loras

    @field_validator("model", "tokenizer")
    @classmethod
    def _home(cls, value: str | None) -> str | None:
        """``~/models/x`` (YAML, or ``--model=~/...`` where the shell leaves it) is a path to
        vLLM only once expanded: as written it reads as a Hugging Face repo id. Empty (compose's
        ``${MODEL:-}``, ``--model ""``) is left out: the embedded model, the model's tokenizer."""
        if value is not None and not value.strip():
            return None
        return os.path.expanduser(value) if value is not None and value.startswith("~") else value

    @field_validator("engine_args")
    @classmethod
    def _not_ours(cls, value: dict[str, Any]) -> dict[str, Any]:
        """An engine field given again in ``engine_args`` would reach vLLM while the gateway
        sizes its scheduler, pins and limits from the field (``max_loras: 2`` there, 4 slots
        here: pins the engine has no room for)."""
        ours = sorted(set(value) & (set(cls.model_fields) - {"engine_args"}))
        if ours:
            fields = ", ".join(f"engine.{name}" for name in ours)
            raise ValueError(f"{', '.join(ours)} are the gateway's engine settings: set {fields} instead")
        return value


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    timeout_keep_alive: int = Field(5, ge=1)
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="larger request heads are refused")
    log_prompts: bool = Field(False, description="put prompt text in the access log (off: privacy)")
    cors_allow_origins: list[str] = Field(
        ["*"],
        description="origins a browser app may call from: '*' any (as vLLM's server), [] none (no CORS)",
    )

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        # A browser's Origin is scheme://host[:port], never with a path or a trailing slash:
        # an entry written like a URL would match no request, and every call would be refused.
        for origin in value:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s*]+", origin):
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port] "
                    "(e.g. https://app.example.com, no path or trailing slash), or '*'"
                )
        return value

    @field_validator("workers")
    @classmethod
    def _one_worker(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                "must be 1: each uvicorn worker would load its own copy of the model; "
                "scale with replicas instead"
            )
        return value


class ApiKey(_Section):
    """One API key. Config holds its SHA-256 (``sha256``); a plaintext ``key`` (handy in
    env vars) is hashed at load and not kept."""

    name: str = Field(min_length=1, max_length=64)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    key: str | None = Field(None, min_length=8, exclude=True, repr=False)
    routes: list[str] | None = Field(None, description="routes this key may use (name or alias); none = all")
    admin: bool = False
    max_concurrency: int | None = Field(
        None, ge=1, description="sequences at once for this key (a request counts its prompts x n)"
    )
    weight: float = Field(1.0, gt=0, le=1000, description="share of contended LoRA slots (fair queuing)")
    priority: int = Field(
        0, ge=-1000, le=1000, description="lower goes first, as vLLM's priority: LoRA queue, engine"
    )

    @field_validator("key")
    @classmethod
    def _sendable(cls, value: str | None) -> str | None:
        # The middleware reads the header as latin-1 and strips the bearer token, so a key
        # outside printable ASCII, or with whitespace around it, could never match.
        if value is not None and not (value.isascii() and value.isprintable() and value == value.strip()):
            raise ValueError("must be printable ASCII with no whitespace around it")
        return value

    @model_validator(mode="after")
    def _hash_plaintext(self) -> ApiKey:
        if self.key is not None and self.sha256 is not None:  # which one? a rotation half done
            raise ValueError("give key or sha256, not both")
        if self.key is not None:
            self.sha256 = hashlib.sha256(self.key.encode()).hexdigest()
            self.key = None
        if self.sha256 is None:
            raise ValueError("needs sha256 (or key)")
        return self


class AuthSettings(_Section):
    """Deny by default: every path needs a key but /health, /ready, /playground and
    /openapi.json (and /metrics with ``public_metrics``)."""

    keys: list[ApiKey] = Field(default_factory=list)
    public_metrics: bool = False

    @field_validator("keys")
    @classmethod
    def _distinct(cls, keys: list[ApiKey]) -> list[ApiKey]:
        """A key's name is its identity (its ``max_concurrency`` count, the owner of its stored
        responses), so two keys may not share one; nor may two names share a key."""
        named: dict[str, str] = {}  # sha256 -> name
        for key in keys:
            if key.name in named.values():
                raise ValueError(f"two keys are named {key.name!r}")
            if key.sha256 in named:
                raise ValueError(f"keys {named[key.sha256]!r} and {key.name!r} are the same key")
            named[key.sha256 or ""] = key.name
        return keys


class LimitSettings(_Section):
    max_body_bytes: int = Field(2 * 1024 * 1024, gt=0)
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="the whole request body must arrive within it; else 408 (a stalled upload holds a slot)",
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a stream whose client takes no data this long is ended as a client that left (499)",
    )
    max_n: int = Field(8, ge=1)
    max_stop: int = Field(8, ge=0)
    max_logprobs: int = Field(20, ge=0)
    default_max_tokens: int = Field(256, gt=0)
    max_inflight: int | None = Field(
        None,
        ge=1,
        description="running + queued sequences (a request counts its prompts x n); above it, 429 "
        "(default: 4 x engine.max_num_seqs)",
    )
    retry_after_s: int = Field(1, ge=1)
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, time for in-flight requests")
    lora_scheduling: Literal["fair", "off"] = Field(
        "fair",
        description="order LoRA requests by adapter slot; off: straight to the engine",
    )
    lora_quantum_s: float = Field(
        0.5, gt=0, description="an adapter holding a slot this long while others wait stops taking requests"
    )
    max_adapter_wait_s: float = Field(
        5.0, gt=0, description="a request waiting this long for its adapter's turn goes to the engine anyway"
    )

    @field_validator("lora_scheduling", mode="before")
    @classmethod
    def _yaml_switch(cls, value: object) -> object:
        """YAML 1.1 reads a bare ``off`` (and ``on``) as a bool: take them as the words meant."""
        if isinstance(value, bool):
            return "fair" if value else "off"
        return value


class ResponsesSettings(_Section):
    """The ``/v1/responses`` store (``store: true``, ``previous_response_id``, retrieve)."""

    store_path: str | None = Field(
        None, description="SQLite file; empty = <cache_dir>/responses.sqlite3; ':memory:' = not kept"
    )
    ttl_s: float = Field(30 * 24 * 3600, gt=0, description="stored responses expire after this (30 days)")
    max_bytes: int = Field(
        1 << 30, ge=0, description="bound on the JSON kept, in bytes (1 GiB); the oldest go first; 0 = none"
    )
    max_bytes_per_key: int = Field(
        0, ge=0, description="one API key's bound, its oldest going first; 0 = none (max_bytes only)"
    )

    @field_validator("store_path")
    @classmethod
    def _known_home(cls, value: str | None) -> str | None:
        if value:
            expand_home(value)  # a ``~user`` that names no user: this setting's error
        return value

    def resolved_path(self, cache_dir: Path) -> str:
        if not self.store_path:
            return str(cache_dir / "responses.sqlite3")
        if self.store_path == ":memory:":
            return self.store_path
        path = Path(expand_home(self.store_path))
        return str(path if path.is_absolute() else PROJECT_ROOT / path)


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
        nested_model_default_partial_update=True,
    )

    config: Path = Field(DEFAULT_CONFIG, description="YAML settings file (GATEWAY_CONFIG)")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    catalog: Path = Field(PROJECT_ROOT / "configs" / "adapters.yaml", description="adapter catalog")
    adapters_root: Path = Field(PROJECT_ROOT / "adapters", description="adapter files must live here")
    catalog_poll_s: float = Field(
        0.5,
        gt=0,
        description="how often drained adapter versions are removed from the engine (file changes "
        "are seen through the kernel's notifications, not by polling)",
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "gateway", description="prepared models, adapter copies the engine loads"
    )

    @field_validator("catalog", "adapters_root", "cache_dir", mode="before")
    @classmethod
    def _left_out_when_empty(cls, value: Any, info: ValidationInfo) -> Any:
        """Empty (``GATEWAY_CACHE_DIR=``, compose's ``${CACHE:-}``) is the default, as for
        ``engine.model``; as a path it would be the project folder itself."""
        if isinstance(value, str | Path) and not str(value).strip():
            return cls.model_fields[info.field_name or ""].get_default(call_default_factory=True)
        return value

    @field_validator("catalog", "adapters_root", "cache_dir")
    @classmethod
    def _anchor(cls, value: Path) -> Path:
        # Relative paths are relative to the project, not to wherever the process started.
        value = Path(expand_home(str(value)))
        return value if value.is_absolute() else PROJECT_ROOT / value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs = getattr(init_settings, "init_kwargs", {})
        path = Path(init_kwargs.get("config") or _config_env() or DEFAULT_CONFIG)
        yaml_source = YamlConfigSettingsSource(settings_cls, yaml_file=path if path.exists() else None)
        return (init_settings, _EngineArgsEnvSettingsSource(settings_cls), yaml_source)


class _EngineArgsEnvSettingsSource(EnvSettingsSource):
    """The ``GATEWAY_*`` variables, with ``GATEWAY_ENGINE__ENGINE_ARGS__<NAME>`` values read as
    YAML, as ``--set`` reads its values: pydantic-settings leaves them strings under
    ``engine_args`` (a dict of anything), and vLLM's engine arguments take them as they come
    (``enforce_eager: "false"``, which is true). ``GATEWAY_ENGINE__ENGINE_ARGS`` as JSON is
    typed already."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        engine = data.get("engine")
        args = engine.get("engine_args") if isinstance(engine, dict) else None
        if isinstance(args, dict):
            for name, raw in os.environ.items():
                key = name[len(_ENGINE_ARGS_ENV) :].lower()
                if name.upper().startswith(_ENGINE_ARGS_ENV) and "__" not in key and args.get(key) == raw:
                    with contextlib.suppress(yaml.YAMLError, ValueError):
                        args[key] = yaml.safe_load(raw)
        return data


_ENGINE_ARGS_ENV = "GATEWAY_ENGINE__ENGINE_ARGS__"


# GATEWAY_* names that are not settings: the chat CLI's key, compose's model folder on the
# host, the bench's commit; and what Kubernetes sets for a Service named "gateway"
# (GATEWAY_SERVICE_HOST, GATEWAY_PORT_8000_TCP, ...).
NOT_SETTINGS = frozenset({"GATEWAY_API_KEY", "GATEWAY_MODELS_DIR", "GATEWAY_GIT_SHA", "GATEWAY_PORT"})
_NOT_SETTINGS_PREFIXES = ("GATEWAY_SERVICE_", "GATEWAY_PORT_")


def expand_home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded; ValueError (the setting's error)
    where it names no user or no home (``Path.expanduser`` raises RuntimeError, a traceback)."""
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise ValueError(f"{path.split('/', 1)[0]!r} names no user with a home directory")
    return expanded


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One line for each ``GATEWAY_*`` variable that names no setting. pydantic-settings
    looks up the names it knows and never sees the others, so ``GATEWAY_SERVER_PORT`` (one
    underscore) would change nothing, silently, and so would ``GATEWAY_CATALOG__X`` (nesting
    under a setting that is not a section). (A name under a known section,
    ``GATEWAY_ENGINE__NOPE``, is an error of the settings already.) The two-underscore hint
    names only a field the section has."""
    fields = GatewaySettings.model_fields
    sections = {
        name.upper(): field.annotation
        for name, field in fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    values = {name.upper() for name in fields} - sections.keys()
    found = []
    for name in sorted(environ):
        upper = name.upper()
        if (
            not upper.startswith("GATEWAY_")
            or upper in NOT_SETTINGS
            or upper.startswith(_NOT_SETTINGS_PREFIXES)
        ):
            continue
        rest = upper.removeprefix("GATEWAY_")
        if rest in values or rest.split("__", 1)[0] in sections:
            continue
        meant = next(
            (
                f"GATEWAY_{section}__{rest[len(section) + 1 :]}"
                for section, model in sections.items()
                if rest.startswith(section + "_")
                and rest[len(section) + 1 :].split("__", 1)[0].lower() in model.model_fields
            ),
            None,
        )
        hint = f"; nested settings take two underscores: {meant}" if meant else ""
        found.append(f"{name} is not a setting and is ignored{hint}")
    return found


def _deep_set(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for depth, part in enumerate(parents, 1):
        target = target.setdefault(part, {})
        if not isinstance(target, dict):  # e.g. --max-num-seqs 4 --set engine.max_num_seqs.x=1
            raise ConfigError(f"{dotted}: {'.'.join(parents[:depth])} is a value, not a section")
    if isinstance(value, dict) and isinstance(target.get(leaf), dict):  # a section given whole
        _merge(target[leaf], value)  # keeps what the flags set in it, as the file's is kept
        return
    target[leaf] = value


def _merge(target: dict[str, Any], more: dict[Any, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def check_model_path(model: str | None) -> None:
    """``engine.model`` written as a path (``/``, ``./``, ``../``; the settings expand a
    ``~``) must exist: vLLM takes a missing one for a Hugging Face repo id and says "Repo id
    must be in the form 'repo_name' or 'namespace/repo_name'". A repo id
    (``google/gemma-3-27b-it``) is vLLM's."""
    if model is None or not model.startswith(("/", "./", "../")):
        return
    if not Path(model).exists():
        raise ConfigError(f"engine.model: no such file or directory: {model}")


def _config_env() -> str | None:
    """``GATEWAY_CONFIG``, named in any case as pydantic-settings matches the other variables
    (``gateway_config`` was shown as ``settings.config`` while another file was read)."""
    return next((v for k, v in os.environ.items() if k.upper() == "GATEWAY_CONFIG" and v), None)


def load_settings(overrides: dict[str, Any] | None = None) -> GatewaySettings:
    """Build settings; ``overrides`` are dotted keys from the CLI (``engine.dtype``), each
    applied, null included (``--set engine.max_model_len=null``: the model's whole context).

    Raises ``ConfigError`` with one line naming the field when anything is invalid.
    """
    init: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        _deep_set(init, key, value)
    config = init.get("config") or _config_env()
    if config is not None and not isinstance(config, str | os.PathLike):  # ``--set config=5``
        raise ConfigError(f"config: expected a file path (got {config!r})")
    path = Path(config) if config else DEFAULT_CONFIG
    if config and not path.is_file():
        raise ConfigError(f"config: {'not a file' if path.exists() else 'file not found'}: {config}")
    try:
        if path.is_file():
            _check_top_level(path)
        return GatewaySettings(**init)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except yaml.YAMLError as exc:  # malformed, or a key given twice
        described = yaml_file.describe(exc)
        detail = f"{path}: {described}" if described else " ".join(str(exc).split())
        raise ConfigError(f"config: {detail}") from None
    except SettingsError as exc:  # an env var that should hold JSON (a list, a mapping) does not
        raise ConfigError(_env_error(exc)) from None
    except (OSError, ValueError) as exc:  # unreadable
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config: {detail}") from None
    except RecursionError:  # thousands of nested brackets
        raise ConfigError(f"config: {path}: the file is nested too deeply") from None


def _env_error(exc: SettingsError) -> str:
    """pydantic-settings names the section ("error parsing value for field "auth" from source
    "EnvSettingsSource""), not the variable: name the variables that can be it."""
    field = re.search(r'field "(\w+)"', str(exc))
    if field is None or "EnvSettingsSource" not in str(exc):
        return f"config: {' '.join(str(exc).split())}"
    prefix = f"GATEWAY_{field.group(1).upper()}"
    names = sorted(n for n in os.environ if n.upper() == prefix or n.upper().startswith(prefix + "__"))
    # the section's other variables (GATEWAY_ENGINE__MAX_NUM_SEQS=4) are not it
    names = [n for n in names if not _is_json(os.environ[n])] or names
    return (
        f"config: {', '.join(names) or prefix}: not valid JSON "
        "(a list or a mapping in an environment variable is written as JSON)"
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _check_top_level(path: Path) -> None:
    """The file must hold a mapping of sections: pydantic-settings fails on a list or a
    scalar there with a bare TypeError (a traceback) or a message about dict updates. A
    key given twice is refused here too: the YAML source would keep the last silently."""
    data = yaml_file.load(path.read_text(encoding="utf-8"))
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"config: {path}: the file must be a mapping of sections (server:, engine:, ...), "
            f"not a {'list' if isinstance(data, list) else 'single value'}"
        )
    for key in data or {}:
        if not isinstance(key, str):  # `on:` is a boolean in YAML 1.1; pydantic-settings fails on it
            raise ConfigError(f"config: {path}: section names must be strings, not {key!r}")


_SECRET_NAME = re.compile(r"api_?key|secret|password|credential|(^|[._])(key|token)$", re.IGNORECASE)


def describe_validation_error(exc: ValidationError) -> str:
    """The first error in one line, with the rejected value unless it may be a secret (this
    line goes to stderr and the logs): under ``auth``, in an unknown field (``server.api_key``
    as vLLM spells it), or in a field named like one."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "settings"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    value = first.get("input")
    secret = (
        first["loc"][:1] == ("auth",)
        or first["type"] == "extra_forbidden"
        or _SECRET_NAME.search(field) is not None
    )
    shown = f" (got {value!r})" if isinstance(value, (str, int, float)) and not secret else ""
    return f"{field}: {first['msg']}{shown}{more}"
