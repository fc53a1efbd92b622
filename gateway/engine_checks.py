"""Checks of a request against the engine, made before its stream starts.

vLLM checks a request's sampling parameters (logprobs, logit_bias, stop token ids against
the model) and its structured-output constraint (against the grammar backend) only when
the request is queued, after a stream's 200 has gone out. ``RequestChecks`` runs the same
checks first, through vLLM's own methods on the objects ``gateway.engine`` hands it (no
vllm import here), so what vLLM would refuse is a 400 instead of an error event.

The backend's verdict on a constraint is remembered (bounded), so a schema that every
request of an app repeats is converted once: vLLM checks each request again when it is
queued anyway, and the conversion is front-end CPU that delays every first token. A
refusal is remembered too, with its message: a strict tool whose schema the backend
cannot hold (``format: uri``) is checked beside every formatted answer an agent asks for.
The other checks are cheap and run for every request, constrained or not.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from gateway.errors import InvalidRequest
from gateway.structured import xgrammar_gap

log = logging.getLogger(__name__)

_REMEMBERED_MAX = 256
_REMEMBERED_MAX_CHARS = 64 * 1024


class RequestChecks:
    def __init__(self) -> None:
        # a constraint's key: None (accepted) or why the backend refused it
        self._verdicts: OrderedDict[tuple[Any, ...], str | None] = OrderedDict()
        self._lock = threading.Lock()  # ``structured`` runs in the service's check threads

    def verify(self, engine: Any, params: Any, tokenizer: Any) -> None:
        """vLLM's checks of every request (logprobs and prompt logprobs against the engine's
        ``max_logprobs``, logit_bias, stop token ids) but its constraint's, which is
        ``structured``'s (and remembered there). Raises what vLLM raises (the engine
        translates it)."""
        if getattr(params, "verify", None) is None:
            return
        if params.structured_outputs is not None:
            # vLLM's verify also has the grammar backend take the constraint: check a copy
            # without it, so a remembered constraint is not converted again.
            params = copy.copy(params)
            params.structured_outputs = None
        verify = params.verify
        cfg = engine.vllm_config
        try:
            verify(cfg.model_config, cfg.speculative_config, cfg.structured_outputs_config, tokenizer)
        except TypeError:  # another vLLM's signature: it checks when the request is queued
            log.debug("SamplingParams.verify has another signature; skipped")

    def structured(self, engine: Any, params: Any, tokenizer: Any) -> None:
        """Have the grammar backend take the constraint now, as ``add_request`` would
        later: one it refuses, or a schema it would take without enforcing all of it, is an
        InvalidRequest (``param`` response_format; the service names the field it came
        from). Whatever it raises here is about the constraint."""
        key = _constraint_key(params.structured_outputs)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                refused = self._verdicts[key]
                if refused is None:
                    return
                raise InvalidRequest(refused, param="response_format")
        try:
            refused = _refusal(engine, params, tokenizer)
        except MemoryError:  # about this moment, not the constraint: not remembered
            raise InvalidRequest("the grammar backend ran out of memory", param="response_format") from None
        if refused is None:
            log.debug("structured output backend: %s", params.structured_outputs._backend)
        if sum(len(str(part)) for part in key) <= _REMEMBERED_MAX_CHARS:
            with self._lock:
                self._verdicts[key] = refused
                if len(self._verdicts) > _REMEMBERED_MAX:
                    self._verdicts.popitem(last=False)
        if refused is not None:
            raise InvalidRequest(refused, param="response_format")


def _refusal(engine: Any, params: Any, tokenizer: Any) -> str | None:
    """Why the grammar backend refuses the constraint, or would take it without enforcing
    all of it; None if it takes it. Whatever the backend raises is about the constraint."""
    gap = _unenforced(engine, params.structured_outputs)
    if gap is not None:
        return f"the JSON schema {gap}"
    try:
        _verify_structured(engine, params, tokenizer)
    except MemoryError:
        raise
    except Exception as exc:
        message = _one_line(exc)
        if exc.__cause__ is not None and str(exc.__cause__).strip() not in message:
            message = f"{message} ({_one_line(exc.__cause__)})"
        return message[:500]
    return None


def _unenforced(engine: Any, so: Any) -> str | None:
    """What xgrammar would decode without enforcing in a JSON schema (keywords it ignores,
    ``structured.xgrammar_gap``), when the engine's backend is xgrammar: it takes such a
    schema, and vLLM passes it. Another backend checks what it supports itself."""
    config = getattr(engine.vllm_config, "structured_outputs_config", None)
    if so.json is None or getattr(config, "backend", None) != "xgrammar":
        return None
    return xgrammar_gap(json.loads(so.json) if isinstance(so.json, str) else so.json)


def _verify_structured(engine: Any, params: Any, tokenizer: Any) -> None:
    """vLLM's own check of a structured-output request, which also picks the backend
    (``auto``: xgrammar, falling back to guidance for what xgrammar cannot compile).
    Its arguments changed across versions (0.32 added ``model_config``), so they are
    passed by name; ``verify`` (which also runs the other checks) is the fallback."""
    config = engine.vllm_config
    known = {
        "model_config": config.model_config,
        "structured_outputs_config": config.structured_outputs_config,
        "tokenizer": tokenizer,
    }
    check = getattr(params, "_validate_structured_outputs", None)
    if check is not None:
        wanted = inspect.signature(check).parameters
        check(**{name: value for name, value in known.items() if name in wanted})
    else:
        params.verify(
            config.model_config, config.speculative_config, config.structured_outputs_config, tokenizer
        )


def _constraint_key(so: Any) -> tuple[Any, ...]:
    """What the grammar backend's verdict on ``so`` depends on (the engine is fixed)."""
    choice = tuple(so.choice) if so.choice is not None else None
    return (so.json, so.regex, choice, so.grammar, so.json_object, so.structural_tag)


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
