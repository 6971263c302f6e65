"""CPU test harness for SGLang's real HiCache host pools (sglang==0.5.23).

Builds device pools and their host pools through SGLang's own code path
(``build_kv_host_pool`` under a published runtime context), on a CPU-only torch.
No pytest tests live here; this is a helper for tests (and a survey script:
``python tests/sglang/sglang_harness.py``).

Usage::

    from tests.sglang import sglang_harness as H   # or import by path
    H.prepare()                                     # stub torchvision, quiet warnings
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        dev = H.make_mla_device_pool(page_size=64)
        host = H.make_host_pool(dev, page_size=64)  # pin_memory=False

CPU-only notes (0.5.23):
* ``torchvision`` is imported at module scope via ``sglang.srt.configs`` ->
  ``nano_nemotron_vl`` -> ``multimodal/internvl_utils.py``; CPU torch has no
  matching torchvision wheel, so ``prepare()`` installs an import stub.
* ``sglang.test.test_utils.published_topology`` cannot be imported without
  ``datasets`` (test_utils imports sglang.benchmark); ``sglang_runtime`` below is
  a copy of it (test_utils.py:2081).
* ``build_kv_host_pool`` never passes ``pin_memory`` and host pools default to
  ``pin_memory=True`` -> ``cudaHostRegister`` -> ``AssertionError: Torch not
  compiled with CUDA enabled``. ``make_host_pool`` injects ``pin_memory=False``
  by wrapping the host-pool class names the assembler module looks up.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
import types
import warnings
from typing import Any, Callable, Optional

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")


def _test_device() -> str:
    import os

    import torch

    return os.environ.get("HICACHE_SGLANG_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


#: Where device pools live: ``HICACHE_SGLANG_TEST_DEVICE``, else ``cuda`` when present, else ``cpu``.
DEVICE = _test_device()
#: Host pools are pinned (SGLang's default) on CUDA; CPU torch cannot pin.
PIN = DEVICE == "cuda"


# ---------------------------------------------------------------------------
# Import stubs (torchvision on CPU torch; sgl_kernel and IPython where absent)
# ---------------------------------------------------------------------------
class _Any:
    """Placeholder for any attribute of a stubbed package; subclassable.

    Calling it returns another placeholder, unless the stub is *strict*: then a
    call raises, so a stubbed kernel that is actually used fails loudly.
    """

    def __init__(self, name: str, strict: bool = False):
        self._name, self._strict = name, strict

    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Any(f"{self._name}.{key}", self._strict)

    def __call__(self, *args, **kwargs):
        if self._strict:
            raise RuntimeError(f"{self._name} is an import stub (the package is not installed here)")
        return _Any(f"{self._name}()")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<import stub {self._name}>"


class _StubModule(types.ModuleType):
    _strict = False

    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Any(f"{self.__name__}.{key}", self._strict)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str, strict: bool = False):
        self.root, self.strict = root, strict

    def find_spec(self, fullname, path, target=None):
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod._strict = self.strict
        mod.__path__ = []
        mod.__version__ = "0.0.0+hicache.stub"
        return mod

    def exec_module(self, module):
        if module.__name__ == "torchvision.transforms.functional":

            class InterpolationMode(enum.Enum):
                NEAREST = "nearest"
                BILINEAR = "bilinear"
                BICUBIC = "bicubic"
                BOX = "box"
                HAMMING = "hamming"
                LANCZOS = "lanczos"

            module.InterpolationMode = InterpolationMode


def install_stub(root: str, *, strict: bool = False, force: bool = False) -> bool:
    """Stub package ``root`` unless a working one imports. Returns True if the stub is installed."""
    if any(isinstance(f, _StubFinder) and f.root == root for f in sys.meta_path):
        return True
    if not force and root not in sys.modules:
        try:
            if importlib.util.find_spec(root) is not None:
                importlib.import_module(root)
                return False
        except Exception:
            for name in [n for n in sys.modules if n.split(".")[0] == root]:
                del sys.modules[name]
    sys.meta_path.insert(0, _StubFinder(root, strict))
    return True


def install_torchvision_stub(force: bool = False) -> bool:
    """Install the torchvision stub unless a working torchvision exists. Returns True if installed."""
    return install_stub("torchvision", force=force)


def prepare(quiet: bool = True) -> None:
    """Make ``import sglang.srt.mem_cache...`` work on CPU torch, and on a GPU without ``sgl_kernel``.

    On CUDA, SGLang's pool modules import ``sgl_kernel.kvcacheio`` at module
    scope; the ``sglang-kernel`` wheel is too large to carry to the test GPU,
    so a *strict* stub stands in (any call of a stubbed kernel raises: every
    transfer under test must be served by hicache).  SGLang's JIT-built HiCache
    kernel is not compiled either (``can_use_jit`` is False): hicache replaces
    the transfers it would serve.
    """
    install_torchvision_stub()
    if quiet:
        # AWQ/GGUF "Only CUDA ... support" UserWarnings fire at import time.
        warnings.filterwarnings("ignore", message=r"Only CUDA.*")
    if DEVICE != "cuda":
        return
    install_stub("sgl_kernel", strict=True)
    install_stub("IPython")  # imported by sglang.utils for notebooks only
    from sglang.srt.mem_cache.pool_host import mha, mla

    for mod in (mha, mla):
        if hasattr(mod, "can_use_hicache_jit_kernel"):
            mod.can_use_hicache_jit_kernel = lambda **_: False


# ---------------------------------------------------------------------------
# Runtime context
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def sglang_runtime(role: str = "test", *, ranks: Optional[dict] = None, **server_args_fields):
    """Publish ServerArgs + rank bundle (copy of sglang.test.test_utils.published_topology).

    Useful fields: device="cpu", hicache_ratio, hicache_size, hicache_mem_layout,
    hicache_io_backend, page_size.  The context is reset on exit.
    """
    prepare()
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args_fields.setdefault("device", DEVICE)
    server_args_fields.setdefault("hicache_ratio", 2.0)
    bundle = dict(world_rank=0, dp_rank=None)
    bundle.update(ranks or {})
    server_args = ServerArgs(model_path="dummy", **server_args_fields)
    reset_context()
    publish(server_args, role=role, ranks=SpawnRanks(**bundle))
    try:
        yield server_args
    finally:
        reset_context()


class FakeCPGroup(types.SimpleNamespace):
    """Minimal stand-in for GroupCoordinator read by LayerSplitDSATokenToKVPool.

    Construction only reads ``world_size`` and ``pynccl_comm``
    (dsa_cache_layer_split.py:_init_layer_broadcast_comm). Reads of non-owned
    layers (get_key_buffer & co.) would call torch.distributed.broadcast on
    ``cpu_group`` -- not supported by this fake (None).
    """

    def __init__(self, rank_in_group: int = 0, world_size: int = 1):
        super().__init__(
            world_size=world_size,
            rank_in_group=rank_in_group,
            pynccl_comm=None,
            cpu_group=None,
            device_group=None,
            device=DEVICE,
        )


def set_fake_attn_cp_group(rank_in_group: int = 0, world_size: int = 1) -> FakeCPGroup:
    """Stamp a fake attn_cp_group into the published ParallelContext (until reset)."""
    from sglang.srt.runtime_context import get_parallel

    group = FakeCPGroup(rank_in_group, world_size)
    get_parallel().override_permanently(attn_cp_group=group)
    return group


# ---------------------------------------------------------------------------
# Device pools (must be called inside sglang_runtime(...))
# ---------------------------------------------------------------------------
def make_mla_device_pool(
    *,
    size: int = 256,
    page_size: int = 64,
    layer_num: int = 8,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    dtype=None,
    start_layer: Optional[int] = None,
    end_layer: Optional[int] = None,
):
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=dtype or torch.bfloat16,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=layer_num,
        device=DEVICE,
        enable_memory_saver=False,
        start_layer=start_layer,
        end_layer=end_layer,
    )


def make_mha_device_pool(
    *,
    size: int = 256,
    page_size: int = 4,
    layer_num: int = 4,
    head_num: int = 2,
    head_dim: int = 16,
    dtype=None,
    start_layer: Optional[int] = None,
    end_layer: Optional[int] = None,
):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=dtype or torch.bfloat16,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layer_num,
        device=DEVICE,
        enable_memory_saver=False,
        start_layer=start_layer,
        end_layer=end_layer,
        enable_alt_stream=False,
    )


def make_layer_split_dsa_device_pool(
    *,
    layer_shard_rank: int = 1,
    layer_shard_size: int = 2,
    size: int = 256,
    page_size: int = 64,  # DSA asserts 64-token physical pages on non-HIP/XPU
    layer_num: int = 8,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    index_head_dim: int = 128,  # asserted == 128
    dtype=None,
):
    """LayerSplitDSATokenToKVPool for one rank; stamps a fake attn_cp_group first."""
    import torch
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool

    set_fake_attn_cp_group(rank_in_group=layer_shard_rank, world_size=1)
    return LayerSplitDSATokenToKVPool(
        size=size,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        dtype=dtype or torch.bfloat16,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=layer_num,
        device=DEVICE,
        index_head_dim=index_head_dim,
        enable_memory_saver=False,
        kv_cache_dim=kv_lora_rank + qk_rope_head_dim,
        layer_shard_rank=layer_shard_rank,
        layer_shard_size=layer_shard_size,
    )


# ---------------------------------------------------------------------------
# Host pools via build_kv_host_pool
# ---------------------------------------------------------------------------
def _with_pin_memory(cls, pin_memory: bool):
    def ctor(*args, **kwargs):
        kwargs.setdefault("pin_memory", pin_memory)
        return cls(*args, **kwargs)

    ctor.__wrapped__ = cls
    return ctor


@contextlib.contextmanager
def host_pool_pin_memory(pin_memory: bool = False):
    """Make build_kv_host_pool construct host pools with the given pin_memory.

    build_kv_host_pool (hybrid_pool_assembler.py:164) calls
    ``MLATokenToKVPoolHost(...)`` / ``get_mha_host_pool_cls(info)(...)`` without
    ``pin_memory``; the real classes are still what gets instantiated.
    """
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm

    orig_mla = asm.MLATokenToKVPoolHost
    orig_get_mha = asm.get_mha_host_pool_cls
    asm.MLATokenToKVPoolHost = _with_pin_memory(orig_mla, pin_memory)
    asm.get_mha_host_pool_cls = lambda info: _with_pin_memory(
        orig_get_mha(info), pin_memory
    )
    try:
        yield
    finally:
        asm.MLATokenToKVPoolHost = orig_mla
        asm.get_mha_host_pool_cls = orig_get_mha


def make_host_pool(kv_pool, *, page_size: Optional[int] = None, pin_memory: bool = PIN, **kwargs):
    """``build_kv_host_pool(kv_pool=..., page_size=...)`` with pin_memory forced.

    Layout / ratio / size come from the published ServerArgs
    (hicache_mem_layout, hicache_ratio, hicache_size).
    """
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_kv_host_pool,
    )

    with host_pool_pin_memory(pin_memory):
        return _keep(build_kv_host_pool(
            kv_pool=kv_pool, page_size=page_size or kv_pool.page_size, **kwargs
        ), pin_memory)


#: Pinned host pools built so far.  SGLang registers host buffers with ``cudaHostRegister``
#: and never unregisters them (a server builds its pools once); a test process builds dozens,
#: and when a freed buffer's addresses come back from ``malloc`` the next registration fails
#: with ``cudaErrorHostMemoryAlreadyRegistered``.  Keeping the pools alive keeps addresses unique.
_PINNED_POOLS: list = []


def _keep(pool, pinned: bool):
    if pinned:
        _PINNED_POOLS.append(pool)
    return pool


def make_dsa_indexer_host_pool(dsa_pool, kv_host_pool, *, pin_memory: bool = PIN):
    """The DSA indexer sidecar host pool (pool_host/dsa.py::DSAIndexerPoolHost).

    Built from the device pool's own declaration (``host_pool_decls()[1]``,
    PoolName.INDEXER) anchored on the KV host pool, as the assembler does via
    DSAIndexerHostPoolBuilder.build (which passes no pin_memory -> True).
    Supported layouts: layer_first, page_first, page_first_direct.
    """
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type

    decls = [d for d in dsa_pool.host_pool_decls() if not d.is_primary]
    assert len(decls) == 1, decls
    return _keep(DSAIndexerPoolHost(
        decls[0],
        kv_host_pool,
        pin_memory=pin_memory,
        allocator_type=get_allocator_type(),
    ), pin_memory)


# ---------------------------------------------------------------------------
# Survey
# ---------------------------------------------------------------------------
def _shape(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        shapes = [tuple(t.shape) for t in x]
        if shapes and all(s == shapes[0] for s in shapes):
            return f"{len(shapes)} x {shapes[0]}"
        return shapes
    return tuple(x.shape)


def describe_host(host) -> dict:
    d = {
        "cls": type(host).__name__,
        "layout": host.layout,
        "page_size": host.page_size,
        "size": host.size,
        "page_num": host.page_num,
        "layer_num": host.layer_num,
        "start_layer": host.start_layer,
        "end_layer": host.end_layer,
        "pin_memory": host.pin_memory,
        "dtype": host.dtype,
        "kv_buffer": _shape(getattr(host, "kv_buffer", None)),
    }
    for name in ("k_buffer", "v_buffer", "index_k_buffer"):
        if getattr(host, name, None) is not None:
            d[name] = _shape(getattr(host, name))
    refs = getattr(host, "data_refs", None)
    if refs is not None:
        d["data_refs"] = f"{len(refs)} x {tuple(refs[0].shape)} stride={refs[0].stride()}"
    return d


def describe_device(dev) -> dict:
    d = {
        "cls": type(dev).__name__,
        "size": dev.size,
        "page_size": dev.page_size,
        "layer_num": dev.layer_num,
        "start_layer": dev.start_layer,
        "end_layer": dev.end_layer,
        "store_dtype": dev.store_dtype,
        "layer_shard_enabled": dev.layer_shard_enabled,
    }
    if hasattr(dev, "kv_buffer"):
        d["kv_buffer"] = _shape(dev.kv_buffer)
    if getattr(dev, "k_buffer", None) is not None:
        d["k_buffer"] = _shape(dev.k_buffer)
        d["v_buffer"] = _shape(dev.v_buffer)
    if dev.layer_shard_enabled:
        d["_owned_local_layer_range"] = dev._owned_local_layer_range()
    return d


def _attempt(fn: Callable[[], Any]) -> dict:
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # record the exact exception
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "where": f"{tb.filename.split('site-packages/')[-1]}:{tb.lineno}",
        }


def try_stock_transfers(dev, host, io_backends=("kernel", "direct")) -> dict:
    """Call the stock transfer methods once per io_backend; record OK / exception.

    Uses one page of host slots (host.alloc) and device slots page_size..2*page_size
    (slot 0 / page 0 is the device padding page). ``layer_id`` for
    load_to_device_per_layer is a device-LOCAL layer index (first owned layer).
    """
    import torch

    out = {}
    ps = host.page_size
    host_idx = host.alloc(ps)
    dev_idx = torch.arange(ps, 2 * ps, dtype=torch.int64)
    first_layer = host._owned_device_layer_ids(dev)[0]
    try:
        for be in io_backends:
            out[f"backup_from_device_all_layer[{be}]"] = _attempt(
                lambda: host.backup_from_device_all_layer(dev, host_idx, dev_idx, be)
            )
            out[f"load_to_device_per_layer[{be}]"] = _attempt(
                lambda: host.load_to_device_per_layer(
                    dev, host_idx, dev_idx, first_layer, be
                )
            )
    finally:
        host.free(host_idx)
    return out


def survey(kind: str, layouts=LAYOUTS, transfers: bool = True, **pool_kwargs) -> dict:
    """kind in {'mla', 'mha', 'layer_split_dsa'}: layout -> {'ok', 'value'|'error'}."""
    makers = {
        "mla": make_mla_device_pool,
        "mha": make_mha_device_pool,
        "layer_split_dsa": make_layer_split_dsa_device_pool,
    }
    results = {}
    for layout in layouts:
        with sglang_runtime(hicache_mem_layout=layout):

            def build():
                dev = makers[kind](**pool_kwargs)
                host = make_host_pool(dev)
                r = {"device": describe_device(dev), "host": describe_host(host)}
                if transfers:
                    r["transfers"] = {
                        k: ("OK" if v["ok"] else f"{v['error']} @ {v['where']}")
                        for k, v in try_stock_transfers(dev, host).items()
                    }
                return r

            results[layout] = _attempt(build)
    return results


if __name__ == "__main__":
    import pprint

    prepare()
    for kind, kw in (
        ("mla", dict(page_size=64)),
        ("mla", dict(page_size=4)),
        ("mha", dict(page_size=4)),
        ("layer_split_dsa", {}),
    ):
        print(f"==== {kind} {kw}")
        for layout, r in survey(kind, **kw).items():
            if r["ok"]:
                print(f"  {layout}: OK")
                pprint.pprint(r["value"], indent=4, width=110)
            else:
                print(f"  {layout}: FAIL {r['error']}  @ {r['where']}")
