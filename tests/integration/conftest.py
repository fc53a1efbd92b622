"""A live gateway for integration tests: the real CLI, a real vLLM engine, a real model.

The gateway runs as a subprocess (``python -m gateway serve``) on a free port with its
own copy of the catalog and adapters, so tests may edit both (hot swap) and may signal
or kill it. Each test talks to it over HTTP only: the OpenAI SDK and httpx.

Tests that start other processes live here too and do not use the ``gateway`` fixture
(so they start no engine): ``test_server`` (uvicorn with a small app), ``test_cli``
(``python -m gateway``), ``test_deploy`` (docker-compose).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import eventually, free_port

ROOT = Path(__file__).resolve().parents[2]
USER_KEY = "sk-test-user-0001"
ADMIN_KEY = "sk-test-admin-0001"
SHOUT_ONLY_KEY = "sk-test-shout-only"
SINGLE_KEY = "sk-test-one-at-a-time"
TEST_SETTINGS = f"""
auth:
  keys:
    - {{name: user, key: {USER_KEY}}}
    - {{name: admin, key: {ADMIN_KEY}, admin: true}}
    - {{name: shout-only, key: {SHOUT_ONLY_KEY}, routes: [shout]}}
    - {{name: single, key: {SINGLE_KEY}, max_concurrency: 1}}
"""
START_TIMEOUT_S = 900  # first run prepares the model (~80 s) and starts the engine (~75 s on 2 cores)


@dataclass
class LiveGateway:
    url: str
    catalog: Path
    adapters_root: Path
    log: Path
    process: subprocess.Popen[bytes]
    # Every client made by client()/admin(), closed by stop_gateway: tests may write
    # gw.client().post(...), and a client left to the garbage collector leaks its socket.
    clients: list[httpx.Client] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    headers = {"Authorization": f"Bearer {USER_KEY}"}
    admin_headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def client(self, **kw: object) -> httpx.Client:
        return self._keep(httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw))  # type: ignore[arg-type]

    def admin(self) -> httpx.Client:
        return self._keep(httpx.Client(base_url=self.url, headers=self.admin_headers, timeout=60))

    def _keep(self, client: httpx.Client) -> httpx.Client:
        self.clients[:] = [c for c in self.clients if not c.is_closed]
        self.clients.append(client)
        return client

    def status(self) -> dict[str, Any]:
        """``GET /admin/status``: in flight, draining, the engine's unfinished requests."""
        with self.admin() as admin:
            return admin.get("/admin/status").json()  # type: ignore[no-any-return]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def gateway_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_gateway(
    workdir: Path,
    *extra: str,
    catalog_text: str | None = None,
    settings_text: str = TEST_SETTINGS,
    wait: bool = True,
) -> LiveGateway:
    adapters = workdir / "adapters"
    if not adapters.exists():
        shutil.copytree(
            ROOT / "adapters", adapters, ignore=shutil.ignore_patterns("*.py", "*.json.bak", "__pycache__")
        )
    catalog = workdir / "adapters.yaml"
    catalog.write_text(
        catalog_text if catalog_text is not None else (ROOT / "configs" / "adapters.yaml").read_text()
    )
    config = workdir / "gateway.yaml"
    config.write_text(settings_text)
    port = free_port()
    log = workdir / f"gateway-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--catalog",
        str(catalog),
        "--adapters-root",
        str(adapters),
        "--max-num-seqs",
        "8",
        "--set",
        "catalog_poll_s=0.2",
        *extra,
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, cwd=ROOT, env=gateway_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    gw = LiveGateway(f"http://127.0.0.1:{port}", catalog, adapters, log, process)
    if wait:
        wait_ready(gw)
    return gw


def wait_ready(gw: LiveGateway) -> None:
    def ready() -> bool:
        if gw.process.poll() is not None:
            raise RuntimeError(f"gateway exited with {gw.process.returncode}:\n{gw.log_tail()}")
        try:
            return httpx.get(gw.url + "/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        eventually(ready, START_TIMEOUT_S, "gateway ready", lambda: "\n" + gw.log_tail(), interval=0.5)
    except AssertionError as exc:
        stop_gateway(gw)
        raise RuntimeError(str(exc)) from None


def stop_gateway(gw: LiveGateway, timeout: float = 60) -> int:
    for client in gw.clients:
        client.close()
    if gw.process.poll() is None:
        gw.process.send_signal(signal.SIGTERM)
        try:
            gw.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(gw.process.pid, signal.SIGKILL)
            gw.process.wait()
    return gw.process.returncode


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    gw = start_gateway(tmp_path_factory.mktemp("gateway"))
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="session")
def base_model(gateway: LiveGateway) -> str:
    return str(httpx.get(gateway.url + "/ready").json()["model"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ is marked ``integration`` (it starts processes);
    ``pytest -m "not integration"`` runs the rest."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.integration)
