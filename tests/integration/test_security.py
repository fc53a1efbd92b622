"""Auth is deny-by-default and cannot be bypassed with Host or path tricks; keys are scoped."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import openai
import pytest

from tests.integration.conftest import ADMIN_KEY, SHOUT_ONLY_KEY, USER_KEY, LiveGateway


def raw_request(gw: LiveGateway, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes exactly as written (no client normalisation); return status and body."""
    url = urlparse(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                head_part, _, rest = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head_part.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    None,
                )
                if length is not None and len(rest) >= length:
                    break
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_public_paths_need_no_key(gateway: LiveGateway) -> None:
    assert httpx.get(gateway.url + "/health").status_code == 200
    assert httpx.get(gateway.url + "/ready").status_code == 200


@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/models/shout", "/admin/adapters", "/admin/status", "/v1/nothing", "/", "/metrics"],
)
def test_everything_else_needs_a_key(gateway: LiveGateway, path: str) -> None:
    r = httpx.get(gateway.url + path)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "invalid_request_error"  # as OpenAI
    assert r.headers["www-authenticate"] == "Bearer"


def test_wrong_key_is_401_for_the_sdk(gateway: LiveGateway) -> None:
    with (
        openai.OpenAI(base_url=gateway.v1, api_key="sk-wrong-key-000", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        client.chat.completions.create(model="shout", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401


@pytest.mark.parametrize(
    "head",
    [
        "GET //v1/models HTTP/1.1\nHost: x",
        "GET /%2Fv1/models HTTP/1.1\nHost: x",
        "GET /v1/models HTTP/1.1\nHost: x/?",
        "GET /v1/models HTTP/1.1\nHost: localhost/health?",
        "GET /v1/models HTTP/1.1\nHost: x/health#",
        "GET /v1/models?/health HTTP/1.1\nHost: x",
        "GET /health/../v1/models HTTP/1.1\nHost: x",
        "GET http://x/health/../v1/models HTTP/1.1\nHost: x",
        "GET //admin/adapters HTTP/1.1\nHost: x",
        "GET /admin%2Fadapters HTTP/1.1\nHost: x/?",
        "GET /ADMIN/adapters HTTP/1.1\nHost: x",
    ],
)
def test_host_and_path_tricks_do_not_bypass_auth(gateway: LiveGateway, head: str) -> None:
    status, body = raw_request(gateway, head + "\nConnection: close\n")
    assert status in (400, 401, 404), (status, body[:200])
    assert b'"data"' not in body and b"routes" not in body  # nothing protected leaked
    post = head.replace("GET", "POST").replace("/v1/models", "/v1/chat/completions", 1)
    payload = b'{"model":"shout","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    status, body = raw_request(
        gateway,
        post + f"\nContent-Type: application/json\nContent-Length: {len(payload)}\nConnection: close\n",
        payload,
    )
    assert status in (400, 401, 404, 405), (status, body[:200])
    assert b"choices" not in body


def test_admin_needs_an_admin_key(gateway: LiveGateway) -> None:
    user = gateway.client().get("/admin/adapters")
    assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"
    assert gateway.client().post("/admin/adapters/reload").status_code == 403
    assert gateway.admin().get("/admin/adapters").status_code == 200


def test_a_key_limited_to_routes_sees_only_those(gateway: LiveGateway, base_model: str) -> None:
    with openai.OpenAI(base_url=gateway.v1, api_key=SHOUT_ONLY_KEY, max_retries=0) as client:
        ok = client.chat.completions.create(
            model="loud", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert ok.model == "shout"
        for other in ("json", base_model, "concise"):
            with pytest.raises(openai.NotFoundError) as info:
                client.chat.completions.create(
                    model=other, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert info.value.code == "model_not_found"  # as if the route did not exist
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model=base_model, messages=[{"role": "user", "content": "hi"}], extra_body={"task": "extract"}
            )
        assert {m.id for m in client.models.list()} == {"shout", "loud", "caps"}
    r = httpx.post(
        gateway.url + "/chat",
        json={"question": "hi", "model": "json"},
        headers={"Authorization": f"Bearer {SHOUT_ONLY_KEY}"},
    )
    assert r.status_code == 404


def test_x_api_key_header_is_accepted(gateway: LiveGateway) -> None:
    assert httpx.get(gateway.v1 + "/models", headers={"x-api-key": USER_KEY}).status_code == 200
    assert httpx.get(gateway.url + "/admin/status", headers={"x-api-key": ADMIN_KEY}).status_code == 200
