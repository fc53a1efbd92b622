"""The batch path of the tokenizing thread with the embedded model's real tokenizer: prompts
that queue together are encoded in one call and each gets exactly the ids of encoding it alone.
And with vLLM's own tokenizer, a prompt that cannot fit is refused before it is tokenized."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.embedded import embedded_model_dir
from gateway.settings import GatewaySettings
from gateway.tokenizing import PromptTokenizer
from tests.helpers import assert_openai_error
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


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(
    gateway: LiveGateway, base_model: str
) -> None:
    """The bound is read from vLLM's tokenizer at start (Gemma 3: 31 characters a token at
    most); a 1.5 MB prompt, 2 s of tokenizing on 2 cores, is refused by its length alone."""
    huge = "Hello world. " * 120_000
    with gateway.client() as http:
        for path, body, param in [
            ("/v1/completions", {"prompt": huge}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ]:
            err = assert_openai_error(http.post(path, json={"model": base_model, **body}), 400)
            assert err["code"] == "context_length_exceeded" and err["param"] == param, err
            assert "but the prompt has at least " in err["message"], err
        # Too long for the context but not by the bound: counted, and refused by its count.
        r = http.post("/v1/completions", json={"model": base_model, "prompt": "word " * 5000})
        err = assert_openai_error(r, 400, "context_length_exceeded")
        assert err["message"].endswith("but the prompt has 5002 tokens."), err  # with <bos>
    assert "(a token stands for 31 at most)" in gateway.log.read_text()
