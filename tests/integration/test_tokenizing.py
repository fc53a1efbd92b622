"""The batch path of the tokenizing thread with the embedded model's real tokenizer: prompts
that queue together are encoded in one call and each gets exactly the ids of encoding it alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.embedded import embedded_model_dir
from gateway.settings import GatewaySettings
from gateway.tokenizing import PromptTokenizer
from tests.integration.conftest import LiveGateway
from tests.unit.test_tokenizing import queued_behind_a_gate


@pytest.fixture(scope="module")
def tokenizer(gateway: LiveGateway) -> object:  # the gateway fixture has prepared the model
    model_dir = embedded_model_dir(Path(GatewaySettings.model_fields["cache_dir"].default) / "models")
    return AutoTokenizer.from_pretrained(model_dir)


async def test_a_batch_gives_each_prompt_the_ids_it_gets_alone(tokenizer: object) -> None:
    rng = random.Random(7)
    words = ["river", "stone", "Paris", "naïve", "日本", "  spaced", "\n", "émoji 🙂", "x" * 40]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(50, 400))) for _ in range(24)]
    tok = PromptTokenizer(lambda: tokenizer)
    results = await queued_behind_a_gate(tok, [(t, i % 3 == 0) for i, t in enumerate(texts)])
    assert tok.batches == 2  # one batch per add_special_tokens value
    for i, (text, ids) in enumerate(zip(texts, results[1:], strict=True)):
        assert ids == tokenizer.encode(text, add_special_tokens=i % 3 == 0)  # type: ignore[attr-defined]
    assert results[1][0] == 2 and results[2][0] != 2  # <bos> only where asked for
