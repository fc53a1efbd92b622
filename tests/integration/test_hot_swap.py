"""Hot swap: edit adapters.yaml and adapter files under load; nothing fails, nothing leaks."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time

import httpx
import pytest

from tests.helpers import chat_body, eventually_async, still_serves
from tests.integration.conftest import LiveGateway

SWAP_DEADLINE_S = 2.0


def models(gw: LiveGateway) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in gw.client().get("/v1/models").json()["data"]}


def admin(gw: LiveGateway) -> dict[str, object]:
    return gw.admin().get("/admin/adapters").json()  # type: ignore[no-any-return]


def answer(gw: LiveGateway, model: str) -> str:
    with gw.client() as http:
        r = http.post(
            "/v1/chat/completions", json=chat_body(model, "Name a color.", max_tokens=12, temperature=0)
        )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def shouted(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isupper() for c in letters) >= 0.8 * len(letters)


def reloads_settled(gw: LiveGateway, quiet: float = 0.5) -> bool:
    before = admin(gw)["reloads"]
    time.sleep(quiet)
    return admin(gw)["reloads"] == before


Outcome = tuple[str, int, str, float, float]  # route, status (-1: broken stream), tail, start, end


async def load(gw: LiveGateway, names: list[str], stop: asyncio.Event, results: list[Outcome]) -> None:
    """Keep requests running (streaming and not) until told to stop; record every outcome."""
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=60) as http:
        i = 0
        while not stop.is_set():
            name = names[i % len(names)]
            body = chat_body(name, "Name a color.", max_tokens=12, temperature=0)
            start = time.monotonic()
            if i % 2:
                async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    raw = (await r.aread()).decode()
                    ok = r.status_code == 200 and raw.endswith("data: [DONE]\n\n") and '"error"' not in raw
                    results.append((name, r.status_code if ok else -1, raw[-200:], start, time.monotonic()))
            else:
                r = await http.post("/v1/chat/completions", json=body)
                results.append((name, r.status_code, r.text[:200], start, time.monotonic()))
            i += 1


async def test_swap_under_load(gateway: LiveGateway) -> None:
    original = gateway.catalog.read_text()
    hot = gateway.adapters_root / "hot"
    shutil.rmtree(hot, ignore_errors=True)
    shutil.copytree(gateway.adapters_root / "shout", hot)
    stop = asyncio.Event()
    results: list[Outcome] = []
    swaps: list[float] = []  # when each edit was written
    workers = [
        asyncio.create_task(load(gateway, ["shout", "json", "concise", "base"], stop, results))
        for _ in range(3)
    ]
    try:
        await asyncio.sleep(1.0)
        # 1. A new route appears within the deadline.
        swaps.append(time.monotonic())
        gateway.catalog.write_text(original + "\n  - name: hot\n    adapter: hot\n    aliases: [hot-alias]\n")
        await eventually_async(lambda: "hot" in models(gateway), SWAP_DEADLINE_S, "the new route listed")
        assert time.monotonic() - swaps[-1] <= SWAP_DEADLINE_S
        workers.append(asyncio.create_task(load(gateway, ["hot", "hot-alias"], stop, results)))
        first_digest = models(gateway)["hot"]["digest"]
        assert first_digest == models(gateway)["shout"]["digest"]  # same files, same version
        assert shouted(loud := answer(gateway, "hot")), loud  # the engine runs shout's weights
        await asyncio.sleep(1.5)

        # 2. Changed adapter files: a new digest (a new LoRA id), picked up without a restart.
        swaps.append(time.monotonic())
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(gateway.adapters_root / "json" / name, hot / name)
        await eventually_async(
            lambda: models(gateway)["hot"]["digest"] != first_digest, SWAP_DEADLINE_S, "a new digest"
        )
        assert models(gateway)["hot"]["digest"] == models(gateway)["json"]["digest"]
        assert not shouted(quiet := answer(gateway, "hot")), quiet  # and now json's, not shout's
        await asyncio.sleep(1.5)

        # 3. A save caught half-way (an editor truncates, then writes) is an error, not "no routes";
        #    a broken edit after it keeps the table from before both and reports the error.
        swaps.append(time.monotonic())
        gateway.catalog.write_text("")
        await eventually_async(
            lambda: "empty" in str(admin(gateway)["last_error"]), SWAP_DEADLINE_S, "the empty file reported"
        )
        assert "hot" in models(gateway)
        gateway.catalog.write_text("routes: [this is not yaml\n")
        await eventually_async(
            lambda: "empty" not in str(admin(gateway)["last_error"]),
            SWAP_DEADLINE_S,
            "the broken file reported",
        )
        assert admin(gateway)["last_error"] is not None
        assert "hot" in models(gateway)
        await asyncio.sleep(1.0)

        # 4. The route leaves; new requests to it get 404 within the deadline.
        swaps.append(time.monotonic())
        gateway.catalog.write_text(original)
        await eventually_async(lambda: "hot" not in models(gateway), SWAP_DEADLINE_S, "the route gone")
        assert admin(gateway)["last_error"] is None
        for gone in ("hot", "hot-alias"):
            r = gateway.client().post("/v1/chat/completions", json=chat_body(gone, max_tokens=2))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        workers.pop().cancel()  # the 'hot' worker would now only see 404s
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
        gateway.catalog.write_text(original)
        shutil.rmtree(hot, ignore_errors=True)

    failures = [r for r in results if r[1] != 200]
    assert failures == [], failures[:5]
    for moment in swaps:  # every edit landed while requests were running
        assert any(start <= moment <= end for _, _, _, start, end in results), (
            "no request in flight at a swap"
        )
    assert {"shout", "json", "hot"} <= {r[0] for r in results}

    # 5. Drained: the engine holds only live versions, no leftover ids (a live one may have
    #    left the engine's LRU cache: it is loaded again on demand).
    def no_leftovers() -> bool:
        state = admin(gateway)
        return set(state["engine_loras"]) <= set(state["live_loras"]) and not state["in_use"]  # type: ignore[arg-type]

    await eventually_async(
        no_leftovers, 10, "the engine holds only the live adapters", lambda: str(admin(gateway))
    )


def test_admin_reload_endpoint(gateway: LiveGateway) -> None:
    r = gateway.admin().post("/admin/adapters/reload")
    assert r.status_code == 200
    assert r.json()["reloaded"] is True and "shout" in r.json()["routes"]


@pytest.mark.parametrize("entry", ["adapter: ../shout", "adapter: /etc", "adapter: missing-dir"])
def test_a_bad_entry_is_rejected_and_the_rest_serve(gateway: LiveGateway, entry: str) -> None:
    original = gateway.catalog.read_text()
    try:
        gateway.catalog.write_text(original + f"\n  - name: evil\n    {entry}\n")
        r = gateway.admin().post("/admin/adapters/reload")
        assert r.status_code == 200
        state = admin(gateway)
        assert "evil" in state["rejected"]  # type: ignore[operator]
        assert "evil" not in models(gateway)
        still_serves(gateway, "shout")
    finally:
        gateway.catalog.write_text(original)
        gateway.admin().post("/admin/adapters/reload")


async def test_sighup_reloads_even_without_a_file_change(gateway: LiveGateway) -> None:
    # Earlier tests' catalog edits each bring a watcher reload; count from after they landed.
    await eventually_async(lambda: reloads_settled(gateway), 10, "no reload in flight")
    before = admin(gateway)["reloads"]
    gateway.process.send_signal(signal.SIGHUP)
    await eventually_async(
        lambda: admin(gateway)["reloads"] == before + 1, SWAP_DEADLINE_S, "a reload on SIGHUP"
    )  # type: ignore[operator]
    assert gateway.process.poll() is None  # SIGHUP reloads; it does not stop the gateway
