"""Fixtures for every test under tests/ (the conformance kit in hicache_core/testing is left alone: run it with
``HICACHE_AUTO_FORWARD`` set to check ``auto`` that way), and tests/fakes.py importable from the test modules (the
suite imports them with ``--import-mode=importlib``, so they cannot import one another)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _auto_forward_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``'s decisions under test assume its default forward pass and backup room, whatever the calling shell
    sets."""
    monkeypatch.delenv("HICACHE_AUTO_FORWARD", raising=False)
    monkeypatch.delenv("HICACHE_AUTO_BACKUP_ROOM", raising=False)


@pytest.fixture(autouse=True)
def _log_once_forgotten() -> None:
    """Messages logged once per process (``hicache_core.logonce``) are logged again in each test: a test that checks
    such a warning must not depend on whether an earlier test (or an earlier run of itself: reruns, repeats) logged it
    first."""
    from hicache_core.logonce import forget_logged

    forget_logged()


@pytest.fixture(scope="session")
def _empty_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("home"))


@pytest.fixture(autouse=True)
def _shipped_calibration(monkeypatch: pytest.MonkeyPatch, _empty_home: str) -> None:
    """``auto``'s decisions under test assume the shipped calibration, whatever this machine calibrated: neither
    ``$HICACHE_CALIBRATION`` nor a file at the default path (``~/.cache/hicache/calibration.json``, which ``hicache
    calibrate`` writes, or a hand-written ``"cpu"`` entry) may change them.  ``HOME`` is an empty folder of the session
    (a test that reads a calibration names its own file); Triton's kernel cache and Python's user site stay where
    ``HOME`` put them."""
    from pathlib import Path

    monkeypatch.delenv("HICACHE_CALIBRATION", raising=False)
    if "TRITON_CACHE_DIR" not in os.environ and "TRITON_HOME" not in os.environ:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    if "PYTHONUSERBASE" not in os.environ:
        import site

        monkeypatch.setenv("PYTHONUSERBASE", site.getuserbase())
    monkeypatch.setenv("HOME", _empty_home)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every kernel launch (``Launcher.__call__`` wrapped): ``(kernel, grid, {parameter: value})``; no replays, so
    each call launches.  (tests/test_rowcopy.py has its own, with the row kernel forced.)"""
    from hicache_core.launch import Launcher  # imported here: a test module sets TRITON_INTERPRET before Triton

    log: list = []
    real = Launcher.__call__

    def counting(self, grid, args, **kw):  # type: ignore[no-untyped-def]
        log.append((self.kernel, grid, dict(zip(self.arg_names, args))))
        real(self, grid, args, **kw)  # returns None: no replay is recorded, every call is logged here
    monkeypatch.setattr(Launcher, "__call__", counting)
    return log
