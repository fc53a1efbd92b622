"""The adapter copies the engine loads: ``<cache_dir>/adapters/run-*/<digest>``.

vLLM reads an adapter's files again when an evicted adapter is used, and keys its prefix
cache by (LoRA name, path). Files edited in place must therefore never be read under an
old id or name: the engine is given a copy named by its content digest, so a LoRA id
always means the same bytes. The copy holds only the files vLLM reads (the config and the
weights): not a trainer's checkpoints, nor links that do not resolve here.

Each gateway process copies into a directory of its own, locked (``flock``) while the
process lives, so gateways sharing a cache directory never delete each other's copies;
a directory whose lock is free (its process is gone) is removed at the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
from pathlib import Path
from typing import IO

from gateway.adapters_check import adapter_digest, engine_files

_LOCK = ".lock"
_STAGING = ".new-"  # a process's folder until it holds its lock


class SnapshotDir:
    """This process's directory of adapter copies."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(root)
        # Locked before it is named ``run-*``: a gateway starting beside this one takes a
        # ``run-*`` folder whose lock is free for an abandoned one, and removes it.
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=root))
        self._lock: IO[str] = (staging / _LOCK).open("w")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path = root / f"run-{staging.name.removeprefix(_STAGING)}"
        staging.rename(self.path)

    def copy(self, adapter: Path, digest: str | None = None) -> tuple[Path, str]:
        """A copy of ``adapter`` named by its digest, and the digest. Unchanged files cost a
        hash (none if ``digest`` is given); changed ones one copy, renamed into place whole."""
        digest = digest or adapter_digest(adapter)
        target = self.path / digest
        if target.is_dir():
            return target, digest
        staging = Path(tempfile.mkdtemp(prefix=".copy-", dir=self.path))
        try:
            for name in engine_files(adapter):
                shutil.copyfile(adapter / name, staging / name)
            digest = adapter_digest(staging)  # the bytes copied, if the files moved meanwhile
            target = self.path / digest
            with contextlib.suppress(OSError):  # the same bytes were copied meanwhile
                staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target, digest

    def close(self) -> None:
        """Remove this process's copies (the engine that read them has stopped) and its lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.close()

    def discard(self, copy: Path) -> None:
        """Remove one copy (its version has left the engine)."""
        if copy.parent == self.path:
            shutil.rmtree(copy, ignore_errors=True)


def _remove_abandoned(root: Path) -> None:
    for run in root.glob("run-*"):
        try:
            with (run / _LOCK).open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: its process is gone
        except OSError:
            continue  # alive (or unreadable): leave it
        shutil.rmtree(run, ignore_errors=True)
