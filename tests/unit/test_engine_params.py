"""The conversion of a SamplingSpec to vLLM's SamplingParams (no engine: vLLM's types only)."""

from __future__ import annotations

import json

from vllm.v1.serial_utils import MsgpackEncoder

from gateway.engine import _sampling_params
from gateway.types import Constraint, SamplingSpec


def test_a_schema_with_an_integer_beyond_64_bits_reaches_the_engine_core() -> None:
    # Found by fuzzing: msgpack cannot carry 10**30, so a dict schema failed in add_request (500).
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}}
    params = _sampling_params(SamplingSpec(max_tokens=4, constraint=Constraint("json", schema)))
    MsgpackEncoder().encode(params)  # what crosses to the engine core process
    assert json.loads(params.structured_outputs.json) == schema
