"""What ``auto``'s decision for a new index pair costs the host (CPU): :meth:`AutoStrategy.pick
<hicache_core.backends.auto.AutoStrategy.pick>` on pairs it has not seen.

Usage: ``python benchmarks/decision_cost.py [--out FILE.json] [--calls 3000] [--rounds 7]``.

A serving loop hands ``auto`` a new index pair every batch, and the batch's first call that is not a lone load
decides it before its own launch (GPU hosts, fp8 MLA bursts: 28-41 us of a first call's host time,
``benchmarks/head_cost.py``; docs/performance.md).  One ``layer_first`` pool of fp8 MLA rows (656 bytes, 4096 tokens
in 64-token pages, 61 layers) is served by ``direct``; ``auto`` chooses between it and a stand-in kernel with the
calibration an H100 host's ``hicache calibrate`` wrote (0.84 us per descriptor: these loads go to the kernel).  Two
paths are timed, each with a new pair per call and the same verdict every time (checked):

- ``gpu_indices``: host indices that live on the GPU (meta tensors stand for them: never read), the last plan of as
  many positions refused: the kernel without a plan, the path of the GPU hosts' fp8 bursts;
- ``cpu_indices``: host indices on the CPU, their runs counted for the bound: the kernel without a plan.

Each figure is the least over ``--rounds`` rounds of the mean over ``--calls`` calls, in microseconds per call, the
making of the new index tensor included (``tensor_us``: that alone).  Timings only: nothing here is a pass/fail check.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.lane_cost import _time, timing_main  # noqa: E402
from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_core.backends.auto import AutoStrategy  # noqa: E402
from hicache_core.backends.memcpy import QueueClock  # noqa: E402
from hicache_core.backends.pace import HostPace  # noqa: E402
from hicache_core.calibration import DEFAULT  # noqa: E402

LAYERS, PAGE, PAGES, ROW = 61, 64, 64, 656
#: An H100 host's per-descriptor cost (``hicache calibrate``): too slow to feed these loads, too slow to measure for.
SLOW_SUBMIT_US = 0.84


def _auto() -> tuple[AutoStrategy, HostKVPool, torch.Tensor, torch.Tensor]:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(LAYERS), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.uint8, page_size=PAGE, capacity=PAGE * PAGES, row_bytes=ROW)
    dev = {"kv": [torch.zeros(PAGE * PAGES, 1, ROW, dtype=torch.uint8) for _ in range(LAYERS)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=create_registry(), strategy="core.direct",
                      pin_memory=False)
    auto = AutoStrategy()
    auto.direct, auto.kernel = pool.strategy, object()  # type: ignore[assignment]
    auto.calibration = replace(DEFAULT, submit_us=SLOW_SUBMIT_US)
    auto.paces = (HostPace(), HostPace())  # no measure yet, as on a new CUDA pool
    auto.clock = QueueClock()
    auto._layers = LAYERS
    h = torch.arange(PAGES).flip(0).repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(PAGES)
    return auto, pool, h, torch.arange(PAGE * PAGES)


def measure(calls: int, rounds: int) -> dict[str, Any]:
    """Per path, the host time of one new pair's decision (microseconds), and of making its tensor alone."""
    auto, pool, h, d = _auto()
    n = h.numel()
    auto._load_blocks[n] = (PAGES, n * ROW, auto.clock.now() + 1e9)  # the last plan of n positions: refused, never old
    made = {"gpu_indices": lambda: torch.empty(n, dtype=torch.int64, device="meta"), "cpu_indices": h.clone}
    out: dict[str, Any] = {"calls": calls, "rounds": rounds}
    for name, make in made.items():
        def decide(make: Callable[[], torch.Tensor] = make) -> object:
            return auto.pick(pool.binding, make(), d, 1, to_host=False)
        before = auto.decisions
        if decide() is not auto.kernel or auto.decisions != before + 1:
            raise RuntimeError(f"{name}: the new pair was not decided for the kernel: nothing like a GPU host's to time")
        out[name + "_us"] = _time(decide, calls, rounds)
        out[name + "_tensor_us"] = _time(make, calls, rounds)
    if auto.pace_probes or pool.binding.scratch.get("direct.plans") is not None and \
            len(pool.binding.scratch["direct.plans"]._slots):
        raise RuntimeError("a decision probed or planned: the timed path is not the one described")
    return out


def main(argv: list[str] | None = None) -> int:
    return timing_main(__doc__.splitlines()[0], measure, argv, 3000)


if __name__ == "__main__":
    sys.exit(main())
