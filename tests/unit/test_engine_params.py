"""The conversion of a SamplingSpec to vLLM's SamplingParams and its checks (no engine:
vLLM's types only)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.serial_utils import MsgpackEncoder

from gateway.catalog import Catalog, Route, RoutingTable
from gateway.engine import (
    EngineManager,
    LoraSlotsReport,
    _sampling_params,
    model_defaults,
    one_grammar_backend,
)
from gateway.errors import EngineFailed, EngineUnavailable, GatewayError, InvalidRequest, RateLimited
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.service import ChatService
from gateway.settings import EngineSettings, LimitSettings
from gateway.types import Constraint, ModelDefaults, SamplingSpec
from tests.unit.fakes import FakeEngine

# vLLM imports parts of itself lazily (``_translate``, the grammar backend), and those pull in
# torch.jit, which warns: under filterwarnings=error the import would fail, and ``prepare``
# would report that as the request's 400, hiding what a test checks.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


def _vllm_engine(max_logprobs: int = 20, generate: Any = None) -> Any:
    """An AsyncLLM stand-in with what ``prepare`` and ``generate`` read of it: vLLM's own
    structured-outputs config, so the checks are vLLM's."""
    from vllm.config import StructuredOutputsConfig

    model_config = SimpleNamespace(
        is_diffusion=False, max_logprobs=max_logprobs, get_vocab_size=lambda: 1000, max_model_len=100
    )
    config = SimpleNamespace(
        model_config=model_config,
        speculative_config=None,
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"),
    )
    return SimpleNamespace(errored=False, vllm_config=config, generate=generate)


_NOT = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}


def _manager_on(engine: Any) -> EngineManager:
    manager = EngineManager(EngineSettings(), Path("."))
    manager._engine = engine
    manager._tokenizer = object()
    return manager


def test_a_schema_with_an_integer_beyond_64_bits_reaches_the_engine_core() -> None:
    # Found by fuzzing: msgpack cannot carry 10**30, so a dict schema failed in add_request (500).
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}}
    params = _sampling_params(SamplingSpec(max_tokens=4, constraint=Constraint("json", schema)))
    MsgpackEncoder().encode(params)  # what crosses to the engine core process
    assert json.loads(params.structured_outputs.json) == schema


class _Checks:
    """Stands in for vLLM's structured-output check: counts calls, refuses regexes."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, engine: object, params: Any, tokenizer: object) -> None:
        self.calls += 1
        if params.structured_outputs.regex is not None:
            raise ValueError("the backend cannot compile this")


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> tuple[EngineManager, _Checks]:
    checks = _Checks()
    monkeypatch.setattr("gateway.engine_checks._verify_structured", checks)
    return _manager_on(_vllm_engine()), checks


def test_an_accepted_constraint_is_checked_once(manager: tuple[EngineManager, _Checks]) -> None:
    engine, checks = manager
    for _ in range(3):
        params = engine.prepare(SamplingSpec(max_tokens=4, constraint=Constraint("json", {"type": "object"})))
        assert json.loads(params.structured_outputs.json) == {"type": "object"}
    assert checks.calls == 1
    engine.prepare(SamplingSpec(max_tokens=4, constraint=Constraint("json", {"type": "array"})))
    assert checks.calls == 2


def test_a_refused_constraint_is_refused_every_time_and_checked_once(
    manager: tuple[EngineManager, _Checks],
) -> None:
    # The Agents SDK sends a strict tool the backend cannot hold with every turn.
    engine, checks = manager
    for _ in range(3):
        with pytest.raises(InvalidRequest, match="cannot compile") as refused:
            engine.prepare(SamplingSpec(max_tokens=4, constraint=Constraint("regex", "a+")))
        assert refused.value.param == "response_format"
    assert checks.calls == 1
    with pytest.raises(InvalidRequest):
        engine.prepare(SamplingSpec(max_tokens=4, constraint=Constraint("regex", "b+")))
    assert checks.calls == 2


def test_a_backend_out_of_memory_is_refused_but_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def short_of_memory(engine: object, params: Any, tokenizer: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError

    monkeypatch.setattr("gateway.engine_checks._verify_structured", short_of_memory)
    engine = _manager_on(_vllm_engine())
    spec = SamplingSpec(max_tokens=4, constraint=Constraint("json", {"type": "object"}))
    with pytest.raises(InvalidRequest, match="out of memory"):
        engine.prepare(spec)
    engine.prepare(spec)  # checked again, and taken
    engine.prepare(spec)
    assert len(calls) == 2


def test_vllm_sampling_extensions_become_sampling_params() -> None:
    spec = SamplingSpec(max_tokens=4, min_p=0.2, stop_token_ids=(5, 6), include_stop_str_in_output=True)
    params = _sampling_params(spec)
    assert (params.min_p, params.stop_token_ids, params.include_stop_str_in_output) == (0.2, [5, 6], True)
    assert _sampling_params(SamplingSpec(max_tokens=4)).stop_token_ids == []


@pytest.mark.parametrize(
    ("given", "backend"),
    [
        (None, "xgrammar"),
        ({}, "xgrammar"),
        ({"backend": "auto", "disable_any_whitespace": True}, "xgrammar"),
        ({"backend": "guidance"}, "guidance"),
    ],
)
def test_the_engine_gets_one_named_grammar_backend(given: Any, backend: str) -> None:
    # Under "auto" the engine core compiles with the backend of the first structured request,
    # whichever backend checked a later one: the gateway names it, so the check is the enforcer.
    config = one_grammar_backend(given)
    assert config["backend"] == backend
    assert {k: v for k, v in config.items() if k != "backend"} == {
        k: v for k, v in (given or {}).items() if k != "backend"
    }


def test_a_python_structured_outputs_config_is_named_too() -> None:
    from vllm.config import StructuredOutputsConfig

    given = StructuredOutputsConfig()
    assert given.backend == "auto"
    assert one_grammar_backend(given) is given and given.backend == "xgrammar"
    assert one_grammar_backend(StructuredOutputsConfig(backend="guidance")).backend == "guidance"


async def test_an_engine_finish_reason_error_is_an_engine_failure() -> None:
    # vLLM's FINISHED_ERROR (the grammar refused a token, a compile or KV load failure) is no
    # OpenAI finish_reason: vLLM's server answers a 500, or an error event when streaming.
    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        for reason in (None, "error"):
            out = SimpleNamespace(index=0, text="a", token_ids=[7], finish_reason=reason, logprobs=None)
            yield SimpleNamespace(
                outputs=[out], prompt_token_ids=[1], finished=bool(reason), prompt_logprobs=None
            )

    engine = _manager_on(_vllm_engine(generate=generate))
    texts = []
    with pytest.raises(EngineFailed):
        async for step in engine.generate([1], _sampling_params(SamplingSpec(max_tokens=4)), "r", None):
            texts += [chunk.text for chunk in step.chunks]
    assert texts == ["a"]


async def test_steps_carry_the_prompt_tokens_read_from_the_prefix_cache() -> None:
    """vLLM's ``num_cached_tokens``, on every output from the first on; None (a version or an
    output that has none) or missing is 0."""
    for given, expected in ((7, 7), (None, 0), ("missing", 0)):
        cached = {} if given == "missing" else {"num_cached_tokens": given}

        async def generate(*args: Any, cached: dict[str, Any] = cached, **kwargs: Any) -> AsyncIterator[Any]:
            for reason in (None, "stop"):
                out = SimpleNamespace(index=0, text="a", token_ids=[7], finish_reason=reason, logprobs=None)
                yield SimpleNamespace(
                    outputs=[out], prompt_token_ids=[1] * 9, finished=bool(reason), **cached
                )

        engine = _manager_on(_vllm_engine(generate=generate))
        params = _sampling_params(SamplingSpec(max_tokens=4))
        steps = [step async for step in engine.generate([1] * 9, params, "r", None)]
        assert [(s.prompt_tokens, s.cached_tokens) for s in steps] == [(9, expected)] * 2


async def test_a_full_engine_queue_is_a_503_not_an_engine_failure(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's admission control (``max_num_queued_reqs`` in ``engine.engine_args``) turns a
    request away with a 503, as vLLM's server answers it: it was a 500 "the engine failed to
    process the request", and an "engine error" in the log, for an engine that only was busy."""
    from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError

    for refusal in (QueueOverflowError(), MaxQueuedTokensError()):

        async def generate(*args: Any, refusal: Exception = refusal, **kwargs: Any) -> AsyncIterator[Any]:
            raise refusal
            yield

        engine = _manager_on(_vllm_engine(generate=generate))
        with pytest.raises(EngineUnavailable) as info:
            async for _ in engine.generate([1], _sampling_params(SamplingSpec(max_tokens=4)), "r", None):
                pass
        assert info.value.status_code == 503 and "try again later" in info.value.message
    assert not caplog.records


@pytest.mark.parametrize("status", [429, 409])
async def test_the_engines_other_graceful_refusals_keep_their_status_or_fail(status: int) -> None:
    """vLLM's GracefulHTTPError carries the status its server answers: 429 (a limit the client
    waits out) stays a 429; another (409, a profiling session already running) is no busy
    engine to retry on, but a request the engine failed."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise GracefulHTTPError("turned away", HTTPStatus(status))
        yield

    engine = _manager_on(_vllm_engine(generate=generate))
    with pytest.raises(GatewayError) as info:
        async for _ in engine.generate([1], _sampling_params(SamplingSpec(max_tokens=4)), "r", None):
            pass
    assert type(info.value) is (RateLimited if status == 429 else EngineFailed)
    assert info.value.status_code == (429 if status == 429 else 500)


def test_a_constrained_request_gets_the_checks_of_a_plain_one(manager: tuple[EngineManager, _Checks]) -> None:
    # vLLM checks logprobs against the engine's max_logprobs when the request is queued, after
    # a stream's 200: a constrained request is checked first too, remembered constraint or not.
    engine, checks = manager
    engine._engine = _vllm_engine(max_logprobs=5)
    json_object = Constraint("json_object")
    engine.prepare(SamplingSpec(max_tokens=4, logprobs=5, constraint=json_object))
    for constraint in (None, json_object):
        with pytest.raises(InvalidRequest, match="logprobs of 10"):
            engine.prepare(SamplingSpec(max_tokens=4, logprobs=10, constraint=constraint))
        with pytest.raises(InvalidRequest, match="prompt logprobs"):
            engine.prepare(SamplingSpec(max_tokens=4, prompt_logprobs=10, constraint=constraint))
        with pytest.raises(InvalidRequest, match="stop_token_ids"):
            engine.prepare(SamplingSpec(max_tokens=4, stop_token_ids=(5000,), constraint=constraint))
    assert checks.calls == 1


def test_the_constraint_check_leaves_the_request_its_constraint(
    manager: tuple[EngineManager, _Checks],
) -> None:
    engine, _ = manager
    params = engine.prepare(SamplingSpec(max_tokens=4, constraint=Constraint("json_object")))
    assert params.structured_outputs.json_object is True


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}, "required": ["a"]},
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        {"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
    ],
)
def test_a_schema_xgrammar_would_not_enforce_is_refused(schema: dict[str, Any]) -> None:
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    bad = '{"a": 1}'  # breaks the schema, and xgrammar would let the model write it
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(bad))
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(schema), bad)
    engine = _manager_on(_vllm_engine())
    with pytest.raises(InvalidRequest, match="the JSON schema (uses|has a) '[a-zA-Z]+' \\(at ") as info:
        engine.prepare(SamplingSpec(max_tokens=4, constraint=Constraint("json", schema)))
    assert info.value.param == "response_format"  # the service names the field it came from


def test_a_disjoint_one_of_reaches_xgrammar() -> None:
    schema = {
        "type": "object",
        "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"type": "string"}]}},
        "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}},
    }
    params = _manager_on(_vllm_engine()).prepare(
        SamplingSpec(max_tokens=4, constraint=Constraint("json", schema))
    )
    assert params.structured_outputs._backend == "xgrammar"


def test_another_backend_judges_its_own_keywords(manager: tuple[EngineManager, _Checks]) -> None:
    from vllm.config import StructuredOutputsConfig

    engine, checks = manager
    engine._engine.vllm_config.structured_outputs_config = StructuredOutputsConfig(backend="guidance")
    engine.prepare(
        SamplingSpec(max_tokens=4, constraint=Constraint("json", {"type": "integer", "not": {"const": 1}}))
    )
    assert checks.calls == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _NOT}}},
            "response_format",
        ),
        ({"structured_outputs": {"json": _NOT}}, "structured_outputs"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": _NOT}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
async def test_an_unenforced_schema_is_a_400_on_the_field_it_came_from(
    body: dict[str, Any], param: str
) -> None:
    from gateway.catalog import Catalog, Route, RoutingTable
    from gateway.protocol import ChatCompletionRequest
    from gateway.service import ChatService
    from gateway.settings import LimitSettings
    from tests.unit.fakes import FakeTokenizer

    engine = _manager_on(_vllm_engine())
    engine._tokenizer, engine._max_model_len = FakeTokenizer(), 1000
    table = RoutingTable(base=Route(name="b", kind="base"), routes={}, errors={})
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    with pytest.raises(InvalidRequest, match="'not'") as info:
        await ChatService(engine, LimitSettings()).chat(request, Catalog(lambda ids: table).acquire(None))
    assert info.value.param == param


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("where", ["response_format", "text.format"])
async def test_a_forced_call_beside_plain_text_asked_for_by_name_is_taken(
    monkeypatch: pytest.MonkeyPatch, choice: Any, where: str
) -> None:
    """``response_format`` (or /v1/responses' ``text.format``) ``{"type": "text"}`` is no
    grammar: it reached vLLM as an empty constraint, a 400 with vLLM's own message."""
    from gateway.catalog import Catalog, Route, RoutingTable
    from gateway.protocol import ChatCompletionRequest
    from gateway.service import ChatService
    from gateway.settings import LimitSettings
    from gateway.structured import TEXT
    from tests.unit.fakes import FakeTokenizer

    # the backend takes the tools' grammar (the fake tokenizer is no model's, for xgrammar)
    monkeypatch.setattr("gateway.engine_checks._verify_structured", lambda *args: None)
    engine = _manager_on(_vllm_engine())
    engine._tokenizer, engine._max_model_len = FakeTokenizer(), 1000
    table = RoutingTable(base=Route(name="b", kind="base"), routes={}, errors={})
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": _TOOLS,
        "tool_choice": choice,
    }
    if where == "response_format":
        body["response_format"] = {"type": "text"}
    request = ChatCompletionRequest.model_validate(body)
    given = TEXT if where == "text.format" else None
    gen = await ChatService(engine, LimitSettings()).chat(
        request, Catalog(lambda ids: table).acquire(None), given
    )
    gen.close()
    assert gen.sampling.constraint is not None and gen.sampling.constraint.kind == "json"  # the calls'


async def test_a_refused_pin_keeps_the_engines_reason(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's utility call fails with a bare Exception: it read as 'the engine failed to
    process the request' on the route's rejection, which told the operator nothing."""

    async def pin_lora(lora_id: int) -> None:
        raise Exception(f"Call to pin_lora method failed: Pinning failed. LoRA {lora_id} is not loaded.")

    manager = _manager_on(SimpleNamespace(errored=False, pin_lora=pin_lora))
    with (
        caplog.at_level("ERROR", logger="gateway.engine"),
        pytest.raises(EngineFailed, match="could not pin it to a GPU slot: .*LoRA 3 is not loaded"),
    ):
        await manager.pin_lora(3)
    assert not caplog.records  # the caller logs the rejection once, with the route's name


class _Built:
    """An engine as ``_create_engine`` builds it, whose first round trip fails or never ends."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[set[int]] = asyncio.get_running_loop().create_future()
        self.asked = asyncio.Event()
        self.shut_down = False

    async def list_loras(self) -> set[int]:
        self.asked.set()
        return await self.answer

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.mark.parametrize("how", ["fails", "cancelled"])
async def test_an_engine_whose_first_round_trip_fails_or_is_stopped_is_shut_down(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine was built, then its first ``list_loras`` failed (its engine core died) or
    the gateway was stopped meanwhile: nobody held it, and its workers were left running."""
    built = _Built()
    monkeypatch.setattr(EngineManager, "_created_in_process", False)
    manager = EngineManager(EngineSettings(model="/models/m"), Path("."))
    monkeypatch.setattr(manager, "_create_engine", lambda: built)
    starting = asyncio.create_task(manager.start())
    await asyncio.wait_for(built.asked.wait(), 5)
    if how == "fails":
        built.answer.set_exception(RuntimeError("engine core died"))
    else:
        starting.cancel()
    with pytest.raises((RuntimeError, asyncio.CancelledError)):
        await starting
    assert built.shut_down
    await manager.shutdown()  # nothing left to stop


def test_secret_engine_args_are_not_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``engine.engine_args: {hf_token: ...}`` reaches vLLM, and the log line of the engine's
    arguments says ``***`` for it, as vLLM's server logs its own (``redact_sensitive_args``)."""
    import vllm.engine.arg_utils
    from vllm.v1.engine.async_llm import AsyncLLM

    given: dict[str, Any] = {}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # set by the start: restored after the test
    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", lambda **args: given.update(args))
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda *args, **kwargs: "engine")
    settings = EngineSettings(
        model="/models/m", max_loras=4, engine_args={"hf_token": "hf_secret_0123", "enforce_eager": True}
    )
    with caplog.at_level("INFO", logger="gateway.engine"):
        assert EngineManager(settings, Path("."))._create_engine() == "engine"
    assert given["hf_token"] == "hf_secret_0123"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "starting vLLM engine" in logged and "'enforce_eager': True" in logged
    assert "hf_secret_0123" not in logged and "'hf_token': '***'" in logged


def test_cpu_kv_cache_setting_wins_over_the_environment_only_when_given(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``engine.cpu_kvcache_space_gib: 4`` was ignored without a word when the environment
    already had VLLM_CPU_KVCACHE_SPACE."""
    from gateway.engine import _cpu_kv_cache_space

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    _cpu_kv_cache_space(EngineSettings())  # the default: the environment's value stands
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "8" and not caplog.records
    with caplog.at_level("WARNING", logger="gateway.engine"):
        _cpu_kv_cache_space(EngineSettings(cpu_kvcache_space_gib=4))
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert (
        "engine.cpu_kvcache_space_gib=4 replaces VLLM_CPU_KVCACHE_SPACE=8 of the environment" in caplog.text
    )
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    _cpu_kv_cache_space(EngineSettings())
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_the_shipped_settings_leave_the_cpu_kv_cache_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """configs/gateway.yaml named ``cpu_kvcache_space_gib: 2``, so with the default settings a
    VLLM_CPU_KVCACHE_SPACE of the environment was always replaced by 2: "given" only in name."""
    from gateway.engine import _cpu_kv_cache_space
    from gateway.settings import DEFAULT_CONFIG, load_settings

    for name in [n for n in os.environ if n.upper().startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    with caplog.at_level("WARNING", logger="gateway.engine"):
        _cpu_kv_cache_space(load_settings({"config": str(DEFAULT_CONFIG), "engine.max_num_seqs": 4}).engine)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "8" and not caplog.records


def test_the_workers_carry_the_slot_report_unless_the_settings_name_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM mixes ``worker_extension_cls`` into its workers by name; one the operator names
    wins, and residency then falls back to what ``list_loras`` tells."""
    import vllm.engine.arg_utils
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.engine.async_llm import AsyncLLM

    given: dict[str, Any] = {}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", lambda **args: given.update(args))
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda *args, **kwargs: "engine")
    manager = EngineManager(EngineSettings(model="/models/m", max_loras=4), Path("."))
    manager._create_engine()
    assert resolve_obj_by_qualname(given["worker_extension_cls"]) is LoraSlotsReport
    assert manager._slots_reported
    given.clear()
    settings = EngineSettings(
        model="/models/m", max_loras=4, engine_args={"worker_extension_cls": "mine.Ext"}
    )
    manager = EngineManager(settings, Path("."))
    manager._create_engine()
    assert given["worker_extension_cls"] == "mine.Ext" and not manager._slots_reported
    given.clear()
    manager = EngineManager(
        EngineSettings(model="/models/m", max_loras=4, report_lora_slots=False), Path(".")
    )
    manager._create_engine()
    assert "worker_extension_cls" not in given and not manager._slots_reported


def test_the_slot_report_reads_the_lora_managers_slots() -> None:
    worker = LoraSlotsReport()
    assert worker.gateway_lora_slots() is None  # no LoRA manager: cannot say
    manager = SimpleNamespace(_adapter_manager=SimpleNamespace(lora_index_to_id=[3, None, 5, None]))
    worker.model_runner = SimpleNamespace(lora_manager=manager)  # type: ignore[attr-defined]
    assert worker.gateway_lora_slots() == [3, 5]


async def test_lora_slots_stop_asking_workers_that_cannot_say(caplog: pytest.LogCaptureFixture) -> None:
    asked: list[str] = []
    answers: list[Any] = [[[3, 5]], [None]]

    async def collective_rpc(method: str) -> Any:
        asked.append(method)
        return answers.pop(0)

    manager = _manager_on(SimpleNamespace(errored=False, collective_rpc=collective_rpc))
    assert await manager.lora_slots() is None and asked == []  # the report was not mixed in
    manager._slots_reported = True
    assert await manager.lora_slots() == {3, 5}
    with caplog.at_level("WARNING", logger="gateway.engine"):
        assert await manager.lora_slots() is None  # this version lays its slots out otherwise
        assert await manager.lora_slots() is None
    assert asked == ["gateway_lora_slots"] * 2 and len(caplog.records) == 1

    async def refused(method: str) -> Any:
        raise Exception("Call to gateway_lora_slots method failed: no such method")

    manager = _manager_on(SimpleNamespace(errored=False, collective_rpc=refused))
    manager._slots_reported = True
    assert await manager.lora_slots() is None and not manager._slots_reported


def test_the_models_sampling_defaults_are_read_as_vllms_server_reads_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's own ``get_diff_sampling_param`` (generation_config.json, then the engine's
    ``override_generation_config``), typed; a value of the wrong type is left out, logged.
    The limit on every request is the override's ``max_new_tokens`` (under ``auto``), or the
    merged one under a generation_config folder of the operator's, as in vLLM's server."""
    from vllm.config import ModelConfig

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 64, "top_p": 0.95, "temperature": 1, "max_new_tokens": 40, "min_p": "x"})
    )

    def config(generation_config: str, override: dict[str, Any]) -> SimpleNamespace:
        c = SimpleNamespace(
            generation_config=generation_config,
            override_generation_config=override,
            try_get_generation_config=lambda: json.loads((tmp_path / "generation_config.json").read_text()),
        )
        c.get_diff_sampling_param = lambda: ModelConfig.get_diff_sampling_param(c)  # type: ignore[arg-type]
        return c

    expected = {"temperature": 1.0, "top_p": 0.95, "top_k": 64}
    overridden = config("auto", {"repetition_penalty": 1.1, "max_new_tokens": 30})
    assert model_defaults(overridden) == ModelDefaults(
        **expected, repetition_penalty=1.1, max_tokens=30, max_tokens_limit=30
    )
    assert "min_p='x' is not a number" in caplog.text
    # the model's own max_new_tokens is a default, not a limit
    assert model_defaults(config("auto", {})) == ModelDefaults(**expected, max_tokens=40)
    assert model_defaults(config(str(tmp_path), {})) == ModelDefaults(
        **expected, max_tokens=40, max_tokens_limit=40
    )
    assert model_defaults(SimpleNamespace(generation_config="vllm", get_diff_sampling_param=dict)) == (
        ModelDefaults()
    )


def test_top_k_beyond_64_bits_is_refused_before_the_engine() -> None:
    """msgpack cannot carry it to the engine core: a 500 after admission, before."""
    from pydantic import ValidationError

    from gateway.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError, match="top_k"):
        ChatCompletionRequest.model_validate({**body, "top_k": 2**64})
    params = _sampling_params(SamplingSpec(max_tokens=4, top_k=2**63 - 1))
    MsgpackEncoder().encode(params)


def test_params_with_another_max_tokens_keep_the_rest() -> None:
    """A batch's prompts each get their own room: the checked params, resized; the original
    is left as it was."""
    schema = {"type": "object"}
    spec = SamplingSpec(max_tokens=9, seed=3, stop=("x",), constraint=Constraint("json", schema))
    params = _sampling_params(spec)
    resized = _manager_on(object()).with_max_tokens(params, 4)
    assert (resized.max_tokens, params.max_tokens) == (4, 9)
    assert (resized.seed, resized.stop, resized.structured_outputs) == (3, ["x"], params.structured_outputs)


def test_a_refusal_of_vllms_names_the_field_it_refuses(manager: tuple[EngineManager, _Checks]) -> None:
    engine, _ = manager
    engine._engine = _vllm_engine(max_logprobs=5)
    with pytest.raises(InvalidRequest) as info:
        engine.prepare(SamplingSpec(max_tokens=4, logprobs=10))
    assert info.value.param == "logprobs"
    with pytest.raises(InvalidRequest) as info:
        engine.prepare(SamplingSpec(max_tokens=4, stop_token_ids=(5000,)))
    assert info.value.param == "stop_token_ids"


class _PreparedByVllm(FakeEngine):
    """The fake engine with ``EngineManager.prepare``'s checks (vLLM's own) in front."""

    def __init__(self) -> None:
        super().__init__()
        self._manager = _manager_on(_vllm_engine(max_logprobs=5))

    def prepare(self, sampling: SamplingSpec) -> Any:
        self._manager.prepare(sampling)
        return super().prepare(sampling)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 10},
            "top_logprobs",
        ),
        ({"prompt": "Hi", "logprobs": 10}, "logprobs"),
        ({"prompt": "Hi", "logprobs": 10, "echo": True, "max_tokens": 1}, "logprobs"),
    ],
)
async def test_a_refusal_of_vllms_names_the_clients_field(body: dict[str, Any], param: str) -> None:
    """The gateway's own cap on logprobs (20) is above this engine's (5): vLLM refuses it,
    under its own name for the field (``prompt_logprobs`` for an echo)."""
    table = RoutingTable(base=Route(name="base", kind="base"), routes={}, errors={})
    service, catalog = (
        ChatService(_PreparedByVllm(), LimitSettings(max_logprobs=20)),
        Catalog(lambda ids: table),
    )
    with pytest.raises(InvalidRequest) as info:
        if "messages" in body:
            await service.chat(
                ChatCompletionRequest.model_validate({"model": "base", **body}), catalog.acquire("base")
            )
        else:
            await service.complete(
                CompletionRequest.model_validate({"model": "base", **body}), catalog.acquire("base")
            )
    assert info.value.param == param


async def test_vllms_output_task_stops_before_the_engine_core() -> None:
    """``shutdown`` ran vLLM's ``AsyncLLM.shutdown`` in a thread while its output task kept
    running on the loop: that task read the stopped engine core and logged an ERROR
    traceback (EngineDeadError) on every clean stop (``make serve``, then SIGTERM)."""
    loop = asyncio.get_running_loop()
    core_stopped = asyncio.Event()
    seen: list[str] = []

    async def output_handler() -> None:  # as vLLM's: waits on the engine core's outputs
        await core_stopped.wait()
        seen.append("read a dead engine core")

    class Engine:
        def __init__(self) -> None:
            self.output_handler = asyncio.ensure_future(output_handler())

        def shutdown(self) -> None:  # vLLM: the engine core first, its output task after
            loop.call_soon_threadsafe(core_stopped.set)
            import time

            time.sleep(0.2)  # stopping the core takes seconds; the loop runs meanwhile
            loop.call_soon_threadsafe(self.output_handler.cancel)

    built = Engine()
    manager = EngineManager(EngineSettings(model="/models/m"), Path("."))
    manager._engine = built  # as ``start`` leaves it
    await manager.shutdown()
    await asyncio.sleep(0)
    assert built.output_handler.done() and not seen
