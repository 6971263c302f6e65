"""``hicache calibrate``'s measure of the layout kernels' per-layer load bursts on this machine
(:attr:`~hicache_core.calibration.Calibration.kernel_load_ratio`).

SM-driven loads read pinned host memory over the link from the GPU's programs; how fast they do so depends on the
host (an H100 host ran the kernels' fp8 MLA load bursts at 0.58 of memcpy where others ran them at 0.84, while the
copy engine moved the same bursts at 0.88-0.93 on each: docs/performance.md).  ``auto`` assumes the usual speed
unless the calibration says otherwise (:func:`~hicache_core.backends.auto_rules.kernel_room`).

The measure: a load burst (every layer in turn, new device rows of random pages) of MLA 576-element rows in bf16
(1152-byte rows: the TMA path on Hopper-class GPUs) and in fp8 (576-byte rows: whole-page loads), 61 layers, 4096
tokens, pages of 64, through the kernel of the first installed layout (by name) that serves the pool, bit-exact
checked first; its ratio to a pinned memcpy of the same bytes (each the fastest of three medians, alternating).  The
core names no layout: any layout plugin's kernel may serve.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .errors import HicacheError
from .registry import Registry, default_registry
from .spec import PoolSpec

__all__ = ["SHAPES", "measure_kernel_loads", "kernel_layout"]

logger = logging.getLogger(__name__)

#: The shapes measured (:data:`hicache_core.bench.SHAPES` names): 1152- and 576-byte rows.
SHAPES = ("mla61x576-bf16", "mla61x576-fp8")


def kernel_layout(registry: Registry, spec: PoolSpec) -> str | None:
    """The first layout by name whose ``kernel`` io_backend serves ``spec`` (``None``: none installed).  A layout whose
    ``kernel`` key cannot be resolved (two plugins register it:
    :class:`~hicache_core.errors.DuplicateRegistrationError`) is passed over: another layout's kernel measures this
    machine as well."""
    for name in sorted(registry.layouts):
        try:
            res, _ = registry.try_resolve(spec, name, "kernel")
        except HicacheError as exc:
            logger.info("hicache calibrate: layout %r's kernel not used (%s)", name, str(exc).splitlines()[0])
            continue
        if res is not None:
            return name
    return None


def measure_kernel_loads(reps: int = 20, registry: Registry | None = None,
                         shapes: tuple[str, ...] = SHAPES) -> list[dict[str, Any]]:
    """One row per shape a layout's kernel serves here: ``shape``, ``layout``, ``ratio`` (the burst's speed over a
    pinned memcpy's of the same bytes), ``burst_ms``, ``memcpy_ms``.  Needs CUDA.
    After each shape the process's cached device memory and cached pinned host memory are handed back
    (:func:`hicache_core.bench.timing._release_memory`): a pool's host buffers and device rows, hundreds of MB.

    :raises AssertionError: a burst's bytes differ from the source rows (the round trip is checked before timing)."""
    from .bench.timing import _release_memory

    reg = registry or default_registry()
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        try:
            row = _measure_shape(reg, shape, reps)
        finally:
            _release_memory()  # the pool's pinned buffers and the device rows: hundreds of MB, cached until handed back
        if row is not None:
            rows.append(row)
    return rows


def _measure_shape(reg: Registry, shape: str, reps: int) -> dict[str, Any] | None:
    """:func:`measure_kernel_loads`'s row for ``shape``; ``None`` where no installed layout's kernel serves it."""
    from .bench.timing import _median_ms
    from .bench.workload import _check, _workload
    from .pool import HostKVPool

    spec, dev, h, s, d = _workload(shape)
    layout = kernel_layout(reg, spec)
    if layout is None:
        logger.info("hicache calibrate: no installed layout's kernel serves %s: not measured", shape)
        return None
    pool = HostKVPool(spec, layout, "kernel", dev, registry=reg)
    _check(pool, dev, h, s, d)
    layers = spec.layer_map.device_layers

    def burst() -> None:
        for layer in layers:
            pool.load_layer(layer, h, d)

    nbytes = spec.bytes_per_token * h.numel()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=spec.device)
    # each the fastest of three medians, alternating: the host's drift between them weighs on neither alone
    memcpy, bursts = [], []
    for _ in range(3):
        memcpy.append(_median_ms(lambda: target.copy_(pinned, non_blocking=True), reps))
        bursts.append(_median_ms(burst, reps))
    memcpy_ms, burst_ms = min(memcpy), min(bursts)
    return {"shape": shape, "layout": layout, "ratio": memcpy_ms / burst_ms, "burst_ms": burst_ms,
            "memcpy_ms": memcpy_ms}
