"""SGLang 0.5.23's HiCache transfer kernels as benchmark peers, on hicache's own buffers.

SGLang's host pools call JIT-built CUDA kernels (``sglang.kernels.ops.kvcache.hicache``,
compiled on first use through ``apache-tvm-ffi`` and nvcc) with raw per-layer pointer
tables.  Our ``layer_first`` and ``page_first`` host buffers have SGLang's byte layout
(``[L, S, row]`` and ``[S, L, row]``), and our device pools hold one ``[rows, row]``
tensor per layer as SGLang's do, so each peer here moves the very bytes our pools move:
the same device tensors, the same pinned host tensors, the same indices.

Variants (as SGLang's ``MLATokenToKVPoolHost`` / ``MHATokenToKVPoolHost`` call them):

* ``sglang-jit``: the generic register kernel ``HiCacheKernel`` (1024 threads per CTA,
  ``block_quota`` CTAs, SGLang's default 2); rows must be multiples of 128 bytes on CUDA.
* ``sglang-tma``: the sm_90+ TMA kernel ``HiCacheTmaKernel`` (SGLang's default 4 CTAs);
  picked by SGLang whenever ``SGLANG_HICACHE_TMA_TRANSFER`` (default on) and the device fit.
* ``sglang-staged``: SGLang's default ``page_first`` all-layer backup: a device relayout
  into a page-major staging buffer, then one DMA per page run (backup only).
* ``sglang-direct``: ``sgl_kernel.kvcacheio.transfer_kv_direct``, SGLang's copy-engine
  path, which lives in the compiled ``sglang-kernel`` wheel, not in the JIT sources.

The kernel entry points are called directly (``_jit_hicache_module(...).launch_*``) so
that the generic and TMA kernels can each be measured; SGLang's public wrappers pick one.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hicache_core.spec import PoolSpec

logger = logging.getLogger(__name__)

#: SGLang serves these host layouts with its JIT kernels (``page_first_direct`` only
#: through ``sgl_kernel``'s copy-engine path).
JIT_LAYOUTS = ("layer_first", "page_first")
#: ``_WRITE_BACK_STAGING_PAGE_CHUNK`` in ``sglang/srt/mem_cache/pool_host/base.py``.
STAGING_PAGES = 64


def _harness() -> Any:
    """``tests/sglang/sglang_harness.py``: its import stubs (``sgl_kernel``, ``IPython``)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "sglang" / "sglang_harness.py"
    if "hicache_sglang_harness" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hicache_sglang_harness", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hicache_sglang_harness"] = module
        spec.loader.exec_module(module)
    return sys.modules["hicache_sglang_harness"]


@dataclass
class SglangKit:
    """What importing and compiling SGLang's kernels gave: modules by key, errors by key."""

    ops: Any = None
    import_error: str | None = None
    direct_error: str | None = None
    modules: dict[tuple, Any] = field(default_factory=dict)
    errors: dict[tuple, str] = field(default_factory=dict)

    def module(self, key: tuple) -> Any:
        if key in self.errors:
            raise RuntimeError(self.errors[key])
        if key not in self.modules:
            raise RuntimeError(f"SGLang module {key} was not built (not in the compile list)")
        return self.modules[key]


def _import_ops() -> tuple[Any, str | None]:
    """``sglang.kernels.ops.kvcache.hicache``, and why SGLang's direct path cannot run, if it cannot."""
    direct_error = None
    try:
        import sgl_kernel.kvcacheio  # type: ignore[import-not-found]  # noqa: F401  (the real package, before any stub)
    except Exception as e:  # noqa: BLE001
        direct_error = (f"sgl_kernel.kvcacheio.transfer_kv_direct (SGLang's direct io_backend) is in the compiled "
                        f"sglang-kernel wheel, which is not installed: {type(e).__name__}: {e}")
    h = _harness()
    h.install_stub("sgl_kernel", strict=True)
    h.install_stub("IPython")
    from sglang.kernels.ops.kvcache import hicache as ops

    return ops, direct_error


def module_keys(specs: list[PoolSpec], quotas: list[int], tma_quotas: list[int]) -> list[tuple]:
    """Every JIT module the grid needs: ``("jit", row, unroll, q)``, ``("tma", q)``, ``("staged", row, unroll, q)``."""
    keys: list[tuple] = []
    for spec in specs:
        row = spec.components[0].row_bytes
        keys += [("jit", row, q) for q in quotas] + [("staged", row)]
    keys += [("tma", q) for q in tma_quotas]
    return list(dict.fromkeys(keys))


def _builder(ops: Any, key: tuple) -> Callable[[], Any]:
    kind = key[0]
    if kind == "jit":
        row, q = key[1], key[2]
        unroll = ops._default_unroll(row)
        if not ops._tiles_across_lanes(row, unroll):
            raise ValueError(f"SGLang's generic JIT kernel does not take {row}-byte rows on CUDA: its copy groups "
                             f"are {ops.GROUP_BYTES} bytes (can_use_hicache_jit_kernel returns False and SGLang "
                             "falls back to sgl_kernel)")
        return lambda: ops._jit_hicache_module(element_size=row, unroll=unroll, block_quota=q)
    if kind == "tma":
        return lambda: ops._jit_hicache_tma_module(block_quota=key[1])
    row = key[1]
    if row % 16:
        raise ValueError(f"SGLang's staged write-back needs rows that are multiples of 16 bytes, got {row}")
    unroll = ops._default_unroll(row)
    return lambda: ops._jit_hicache_staged_module(element_size=row, unroll=unroll, block_quota=ops.DEFAULT_BLOCK_QUOTA)


def prepare(keys: list[tuple], progress: Callable[[str], None]) -> SglangKit:
    """Import SGLang's kernel launchers and compile ``keys`` in parallel; never raises."""
    kit = SglangKit()
    try:
        kit.ops, kit.direct_error = _import_ops()
        from sglang.kernels.jit.utils import parallel_compile
    except Exception as e:  # noqa: BLE001
        kit.import_error = f"importing SGLang's JIT kernel launchers failed: {type(e).__name__}: {e}"
        progress(kit.import_error)
        return kit

    todo: list[tuple[tuple, Callable[[], Any]]] = []
    for key in keys:
        try:
            todo.append((key, _builder(kit.ops, key)))
        except Exception as e:  # noqa: BLE001
            kit.errors[key] = str(e)

    def guarded(key: tuple, build: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            t0 = time.monotonic()
            try:
                kit.modules[key] = build()
                progress(f"sglang JIT {key}: ready in {time.monotonic() - t0:.0f} s")
            except Exception as e:  # noqa: BLE001
                kit.errors[key] = f"SGLang JIT build {key} failed: {type(e).__name__}: {e}"
                progress(kit.errors[key][:400])
        return run

    progress(f"sglang: compiling {len(todo)} JIT module(s) in parallel (nvcc; about a minute the first time)")
    parallel_compile([guarded(k, b) for k, b in todo])
    return kit


def _ptrs(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A pointer table as SGLang's ``make_kernel_ptr_table`` builds it (pinned memory: UVA address)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


class _Sides:
    """Per-component device layers, host layer views, pointer tables and strides for one layout."""

    def __init__(self, spec: PoolSpec, layout: str, dev: dict[str, list[torch.Tensor | None]],
                 host: dict[str, torch.Tensor]) -> None:
        if layout not in JIT_LAYOUTS:
            raise ValueError(f"SGLang's JIT kernels serve {JIT_LAYOUTS}, not {layout!r}")
        self.names = [c.name for c in spec.components]  # MLA: kv; MHA: k, v
        self.row = spec.components[0].row_bytes
        self.layers = len(spec.layer_map.device_layers)
        self.dev = {n: [t for t in dev[n] if t is not None] for n in self.names}
        self.host_layers = {n: [host[n][i] if layout == "layer_first" else host[n][:, i] for i in range(self.layers)]
                            for n in self.names}
        self.host_stride = self.row if layout == "layer_first" else self.row * self.layers
        self.dev_ptrs = [_ptrs(self.dev[n], spec.device) for n in self.names]
        self.host_ptrs = [_ptrs(self.host_layers[n], spec.device) for n in self.names]
        self.host = host
        self.mla = len(self.names) == 1


class SglangJit:
    """``HiCacheKernel`` (generic) or ``HiCacheTmaKernel`` (TMA) with ``quota`` CTAs, on shared buffers."""

    ops_supported = ("backup_all_layers", "load_layer", "load_burst", "load_burst_new", "backup_new")
    contiguous_host = False

    def __init__(self, kit: SglangKit, tma: bool, quota: int, spec: PoolSpec, layout: str,
                 dev: dict[str, list[torch.Tensor | None]], host: dict[str, torch.Tensor]) -> None:
        self.tma, self.quota = tma, quota
        self.sides = _Sides(spec, layout, dev, host)
        self.module = kit.module(("tma", quota) if tma else ("jit", self.sides.row, quota))
        if tma:
            chunk = kit.ops.hicache_tma_rows_per_chunk(self.sides.row)
            if spec.page_size % chunk:  # SGLang's use_hicache_tma_kernel takes the register kernel then
                raise ValueError(f"SGLang uses its TMA kernel only when pages tile its {chunk}-row chunks; "
                                 f"page_size {spec.page_size} does not")
            if not self.module.fits_device(torch.cuda.current_device()):
                raise RuntimeError(f"SGLang's TMA kernel (quota {quota}) does not fit this device (fits_device False)")
        self.host_buffers = host

    def ctas(self, op: str) -> int:
        return self.quota

    def backup_all_layers(self, h: torch.Tensor, s: torch.Tensor) -> None:
        x = self.sides
        tail = (x.row,) if self.tma else ()
        if x.mla:
            self.module.launch_all_mla(x.host_ptrs[0], h, x.dev_ptrs[0], s, x.row, x.host_stride, *tail)
        else:
            self.module.launch_all(x.host_ptrs[0], x.host_ptrs[1], h, x.dev_ptrs[0], x.dev_ptrs[1], s,
                                   x.row, x.host_stride, *tail)

    def load_layer(self, layer: int, h: torch.Tensor, d: torch.Tensor) -> None:
        x = self.sides
        dst = [x.dev[n][layer] for n in x.names]
        src = [x.host_layers[n][layer] for n in x.names]
        if x.mla:
            self.module.launch_one_mla(dst[0], d, src[0], h)
        else:
            self.module.launch_one(dst[0], dst[1], d, src[0], src[1], h)


class SglangStaged:
    """SGLang's default ``page_first`` all-layer backup (staged write-back); backup only."""

    ops_supported = ("backup_all_layers",)
    contiguous_host = False
    note = "relayout kernel (CTAs shown) into a device staging buffer, then copy-engine DMA"

    def __init__(self, kit: SglangKit, spec: PoolSpec, layout: str, dev: dict[str, list[torch.Tensor | None]],
                 host: dict[str, torch.Tensor]) -> None:
        if layout != "page_first":
            raise ValueError("SGLang's staged write-back serves page_first only")
        self.ops = kit.ops
        kit.module(("staged", spec.components[0].row_bytes))  # raise the build error, if any
        self.sides = _Sides(spec, layout, dev, host)
        tokens = min(spec.num_pages, STAGING_PAGES) * spec.page_size
        self.staging = {n: torch.empty((tokens, *host[n].shape[1:]), dtype=host[n].dtype, device=spec.device)
                        for n in self.sides.names}
        self.page_size = spec.page_size
        self.host_buffers = host
        self._h_cpu: tuple[torch.Tensor, torch.Tensor] | None = None

    def ctas(self, op: str) -> int:
        return int(self.ops.DEFAULT_BLOCK_QUOTA)

    def _cpu(self, h: torch.Tensor) -> torch.Tensor:
        """SGLang passes the host indices on the CPU to this kernel (it reads page ids on the host)."""
        if self._h_cpu is None or self._h_cpu[0] is not h:
            self._h_cpu = (h, h.cpu())
        return self._h_cpu[1]

    def backup_all_layers(self, h: torch.Tensor, s: torch.Tensor) -> None:
        x, hc = self.sides, self._cpu(h)
        if x.mla:
            n = x.names[0]
            self.ops.transfer_hicache_all_layer_mla_staged_lf_pf(
                x.dev_ptrs[0], s, hc, self.staging[n].unsqueeze(2), x.host[n].unsqueeze(2), page_size=self.page_size)
        else:
            self.ops.transfer_hicache_all_layer_staged_lf_pf(
                x.dev_ptrs[0], x.dev_ptrs[1], s, hc, self.staging["k"], self.staging["v"], x.host["k"], x.host["v"],
                page_size=self.page_size)

    def load_layer(self, layer: int, h: torch.Tensor, d: torch.Tensor) -> None:
        raise NotImplementedError("SGLang's staged kernel is a write-back (backup) only")
