"""A pytest plugin that reorders the collected tests, to find tests whose outcome depends on what ran before them in
the same process (once-per-process state: ``log_once`` messages, caches, registries).

``HICACHE_TEST_ORDER=reverse`` runs the items last to first; ``twice`` runs them all, then all again (a test that
passes alone but fails on its second run leans on state an earlier test may leave).  Usage, from the repository root::

    HICACHE_TEST_ORDER=twice PYTHONPATH=dev .venv/bin/python -m pytest -q -p order_plugin tests/sglang

"""

from __future__ import annotations

import os
from typing import Any

ORDERS = ("reverse", "twice")


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    order = os.environ.get("HICACHE_TEST_ORDER", "reverse")
    if order not in ORDERS:
        raise ValueError(f"HICACHE_TEST_ORDER={order!r}: use one of {ORDERS}")
    if order == "reverse":
        items.reverse()
    else:
        items[:] = list(items) + list(items)
