"""Fixtures for every test under tests/ (the conformance kit in hicache_core/testing is left alone: run it with
``HICACHE_AUTO_FORWARD`` set to check ``auto`` that way)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _auto_forward_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``'s decisions under test assume its default forward pass, whatever the calling shell sets."""
    monkeypatch.delenv("HICACHE_AUTO_FORWARD", raising=False)
