"""Conformance kit: checks every registered strategy against the ``reference`` backend.

Run it against whatever is installed with ``pytest --pyargs hicache_core.testing``
(filters: ``--hicache-layout``, ``--hicache-io-backend``, ``--hicache-device``).
"""

from .conformance import CASES, INDEX_VARIANTS, Case, check_strategy, make_device_buffers

__all__ = ["CASES", "INDEX_VARIANTS", "Case", "check_strategy", "make_device_buffers"]
