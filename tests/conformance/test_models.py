"""Ported from vLLM's tests/entrypoints/openai/models/test_models.py and, for the LoRA
listing, lora/test_lora_adapters.py. The gateway's models are the base model, the
catalog's routes (LoRA adapters and prompt presets) and their aliases; adapters are added
by editing the catalog (hot swap), not through vLLM's ``/v1/load_lora_adapter``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import yaml

from tests.conformance.conftest import BASE, LORA
from tests.integration.conftest import ROOT, LiveGateway


def catalog_routes() -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = yaml.safe_load(Path(ROOT / "configs" / "adapters.yaml").read_text())[
        "routes"
    ]
    return routes


async def test_check_models(client: openai.AsyncOpenAI) -> None:
    """vLLM models/test_models.py::test_check_models. Difference: a LoRA's ``root`` is the
    base model's name, not the adapter's path on disk (which the gateway does not show)."""
    models = (await client.models.list()).data
    served, others = models[0], models[1:]
    assert served.id == BASE
    assert served.root == BASE  # type: ignore[attr-defined]
    loras = [m for m in others if getattr(m, "kind", None) == "lora" and not getattr(m, "alias_of", None)]
    assert [m.id for m in loras] == [r["name"] for r in catalog_routes() if "adapter" in r]
    assert all(m.root == BASE for m in loras)  # type: ignore[attr-defined]
    assert loras[0].id == LORA


async def test_retrieve_base_model(client: openai.AsyncOpenAI) -> None:
    """vLLM models/test_models.py::test_retrieve_base_model"""
    model = await client.models.retrieve(BASE)
    assert model.id == BASE
    assert model.root == BASE  # type: ignore[attr-defined]


async def test_retrieve_lora_model(client: openai.AsyncOpenAI) -> None:
    """vLLM models/test_models.py::test_retrieve_lora_model (``root``: the base model's name,
    see test_check_models)"""
    model = await client.models.retrieve(LORA)
    assert model.id == LORA
    assert model.root == BASE  # type: ignore[attr-defined]


async def test_retrieve_unknown_model(client: openai.AsyncOpenAI) -> None:
    """vLLM models/test_models.py::test_retrieve_unknown_model"""
    try:
        await client.models.retrieve("this-model-does-not-exist")
    except openai.NotFoundError as exc:
        assert "does not exist" in str(exc)
    else:
        raise AssertionError("an unknown model was found")


async def test_static_lora_lineage(client: openai.AsyncOpenAI) -> None:
    """vLLM lora/test_lora_adapters.py::test_static_lora_lineage: the base model first with
    no parent; every adapter's parent is the base model. The gateway also lists presets
    (parent: the base model) and aliases (``alias_of``; the base model's have no parent)."""
    models = (await client.models.list()).data
    served = models[0]
    assert (served.id, served.root, served.parent) == (BASE, BASE, None)  # type: ignore[attr-defined]
    for card in models[1:]:
        if getattr(card, "alias_of", None) == BASE:
            assert (card.root, card.parent) == (BASE, None)  # type: ignore[attr-defined]
        else:
            assert (card.root, card.parent) == (BASE, BASE), card  # type: ignore[attr-defined]
    assert [m.id for m in models if getattr(m, "kind", None) == "lora"][0] == LORA


async def test_dynamic_lora_lineage(gateway: LiveGateway) -> None:
    """vLLM lora/test_lora_adapters.py::test_dynamic_lora_lineage. Difference: there is no
    ``POST /v1/load_lora_adapter`` (404; likewise ``unload``): add an entry to the catalog
    and the adapter is live within 2 s (tests/integration/test_hot_swap.py)."""
    with gateway.admin() as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = http.post(
                path, json={"lora_name": "shout-2", "lora_path": str(gateway.adapters_root / "shout")}
            )
            assert r.status_code == 404, r.text
