"""The playground page's script in Node, with a DOM stand-in (the whole page runs in
Chromium in tests/integration/test_playground.py). Outside CI the test skips without Node;
in CI (``CI`` set) it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import gateway

NODE = shutil.which("node")
PAGE = Path(gateway.__file__).parent / "playground.html"
SCRIPT = Path(__file__).parent / "js" / "playground_race.mjs"


def test_a_key_changed_while_routes_load_shows_the_new_keys_routes() -> None:
    # The previous key's /v1/models body arrived after the new key's: its routes were shown.
    if NODE is None:
        if os.environ.get("CI"):
            pytest.fail("node is missing (.ci/run installs it)")
        pytest.skip("node is not installed")
    done = subprocess.run([NODE, str(SCRIPT), str(PAGE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
