"""Copy plans of the ``direct`` backend: descriptor arrays per pair of index tensors, memoised.

A :class:`Plan` holds everything one ``(host_indices, device_indices)`` pair
needs: the indices on the CPU (range-checked once; device indices on the
pool's GPU only once a route needs their values), the coalesced runs of
every segment, and a :class:`Submission` per layer selection, built on first
use.  A :class:`PlanCache` keeps the last few plans of a pool; a hit needs the
same tensor objects with unchanged version counters on the same stream, so
the per-layer calls of a batch share one plan.  Tensors changed behind torch's
back (a NumPy view) are not seen: pass new tensors then.  Tensors without a
version counter (inference mode) are never memoised.
"""

from __future__ import annotations


# The modules, by role: plans_submission (Submission, coalesce, warn_small_blocks), plans_runs (the helpers plans are
# built with: per-pool address tables, auto staging's facts, index reads), plans_early (EarlyRead), plans_plan (Plan,
# defer_device_read, the STAGE_* thresholds) and plans_cache (PlanCache, MEMO_SLOTS).  Every name of the former
# single module stays importable from here, but nothing is looked up here: a test or benchmark that replaces a
# helper patches it where its user looks it up (plans_plan for Plan's helpers, plans_cache for PlanCache's,
# plans_submission for coalesce's SMALL_COALESCE).
from .pitched import PITCHED_OP_US  # noqa: F401
from .plans_cache import MEMO_SLOTS, PlanCache
from .plans_early import EarlyRead
from .plans_plan import STAGE_BELOW, STAGE_GAIN, STAGE_HOST_US, Plan, defer_device_read  # noqa: F401
from .plans_runs import (  # noqa: F401
    _bases, _host_base, _layer_shape, _layers_share_allocations, _longest_run, _page_runs, _page_sizes,
    _runs_stay_in_page, _storages, _within)
from .plans_submission import (  # noqa: F401
    SMALL_COALESCE, WARN_BLOCKS, WARN_MEAN_BLOCK, Submission, coalesce, warn_small_blocks)

__all__ = ["coalesce", "Submission", "Plan", "PlanCache", "EarlyRead", "MEMO_SLOTS", "WARN_MEAN_BLOCK", "WARN_BLOCKS"]

