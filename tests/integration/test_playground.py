"""The /playground page, end to end in headless Chromium (Debian's, driven by Playwright).

Outside CI the test skips when Chromium or Playwright is missing; in CI (``CI`` set) it fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.conftest import USER_KEY, LiveGateway

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = "/tmp/playground.png"
QUESTION = "What is the capital of France?"
STREAM_TIMEOUT_MS = 180_000


def missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if not os.access(CHROMIUM, os.X_OK):
        return "chromium is not installed (apt-get install chromium)"
    return None


if missing() and not os.environ.get("CI"):
    pytest.skip(str(missing()), allow_module_level=True)  # and don't start an engine for nothing


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    reason = missing()
    if reason:
        pytest.fail(f"CI must run the playground test: {reason}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 820})
            yield context.new_page()
        finally:
            browser.close()


def wait_state(page: Any, state: str) -> None:
    page.wait_for_selector(f'#status[data-state="{state}"]', timeout=STREAM_TIMEOUT_MS)


def test_playground_streams_and_shows_the_adapter(page: Any, gateway: LiveGateway, base_model: str) -> None:
    with gateway.client() as http:
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    shout_digest = cards["shout"]["digest"]
    assert len(shout_digest) == 64

    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)

    # The page is public (no key needed to load it) and locked down by its headers.
    response = page.goto(gateway.url + "/playground")
    assert response is not None and response.status == 200
    assert "default-src 'none'" in response.headers["content-security-policy"]
    assert page.title().startswith("Playground")
    assert httpx.get(gateway.url + "/v1/models").status_code == 401  # the rest still needs a key

    # Key -> the route list loads with it.
    page.fill("#api-key", USER_KEY)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#route option')].some(o => o.value === 'shout')", timeout=30_000
    )
    assert page.evaluate("sessionStorage.getItem('gateway.playground.key')") == USER_KEY

    # shout, house format: the answer grows chunk by chunk, in upper case.
    page.select_option("#route", "shout")
    page.select_option("#format", "house")
    page.fill("#message", QUESTION)
    page.fill("#max-tokens", "20")  # short: the answer's first sentence is what shows the adapter
    page.evaluate(
        """() => {
            const answer = document.getElementById('answer');
            window.answerLengths = [];
            new MutationObserver(() => window.answerLengths.push(answer.textContent.length))
                .observe(answer, {childList: true, characterData: true, subtree: true});
        }"""
    )
    page.click("#send")
    wait_state(page, "done")
    lengths = [n for n in page.evaluate("window.answerLengths") if n > 0]
    answer = page.inner_text("#answer")
    assert len(set(lengths)) >= 3, f"the answer did not stream: lengths seen {lengths}, answer {answer!r}"
    assert lengths == sorted(lengths), lengths
    letters = [c for c in answer if c.isalpha()]
    assert len(letters) >= 5, answer
    assert sum(c.isupper() for c in letters) / len(letters) >= 0.8, f"shout should shout: {answer!r}"
    assert page.inner_text("#adapter") == "shout"
    assert page.inner_text("#digest") == shout_digest
    assert page.inner_text("#error") == ""
    page.screenshot(path=SCREENSHOT, full_page=True)

    # Base model, OpenAI SSE: an answer arrives, served by the base model, no digest.
    page.select_option("#format", "openai")
    page.select_option("#route", base_model)
    page.fill("#max-tokens", "24")
    page.click("#send")
    wait_state(page, "done")
    assert page.inner_text("#answer").strip()
    assert page.inner_text("#adapter") == base_model
    assert "none" in page.inner_text("#digest")  # the base model has no adapter digest
    assert page.inner_text("#error") == ""

    # A wrong key: the route list and a send both show the gateway's error message.
    page.fill("#api-key", "sk-wrong-key")
    wait_state(page, "error")
    assert "API key" in page.inner_text("#error")
    page.click("#send")
    page.wait_for_function("() => document.getElementById('status').textContent === 'Failed.'")
    assert page.inner_text("#error").startswith("401: Missing or invalid API key")
    assert page.inner_text("#answer") == ""

    assert problems == []


@pytest.fixture(scope="module")
def app_origin() -> Iterator[str]:
    """A web app on another origin (another port of this host): a blank page to run fetch from."""
    import http.server
    import threading

    class Blank(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>app</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blank)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


CROSS_ORIGIN_FETCH = """async ([url, key, stream]) => {
    const r = await fetch(url + '/v1/chat/completions', {
        method: 'POST',
        headers: {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'},
        body: JSON.stringify({model: 'shout', messages: [{role: 'user', content: 'Hi'}],
                              max_tokens: 4, stream: stream}),
    });
    return {status: r.status, requestId: r.headers.get('x-request-id'),
            adapter: r.headers.get('x-adapter'), text: await r.text()};
}"""


def test_a_browser_app_on_another_origin_can_call_the_api(
    page: Any, gateway: LiveGateway, app_origin: str
) -> None:
    """Chromium itself enforces CORS here: its preflight (no key) must pass, and the page must
    be let read the answer, the exposed headers and a refusal."""
    app = page.context.new_page()
    try:
        app.goto(app_origin + "/")
        plain = app.evaluate(CROSS_ORIGIN_FETCH, [gateway.url, USER_KEY, False])
        assert plain["status"] == 200, plain
        assert plain["requestId"] and plain["adapter"] == "shout"
        assert '"chat.completion"' in plain["text"]
        streamed = app.evaluate(CROSS_ORIGIN_FETCH, [gateway.url, USER_KEY, True])
        assert streamed["status"] == 200 and streamed["text"].rstrip().endswith("data: [DONE]"), streamed
        refused = app.evaluate(CROSS_ORIGIN_FETCH, [gateway.url, "sk-wrong-key", False])
        assert refused["status"] == 401 and '"invalid_api_key"' in refused["text"], refused
    finally:
        app.close()
