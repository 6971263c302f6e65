"""Plugin layouts through SGLang's server arguments, and SGLang's storage tier end to end.

device -> host backup -> pages written to SGLang's real ``HiCacheFile`` backend
(through SGLang's own ``HiCacheController._generic_page_set``) -> host slots
wiped -> pages read back (``_generic_page_get``) -> load to other device slots
-> bit-exact, for MLA (sharded and unsharded) and MHA, every layout x
{direct, kernel}; plus the zero-copy pointers of ``get_page_buffer_meta``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import sglang_harness as H
from hicache_core import Addressing, BufferSpec, HostPlan, PoolSpec, Segment, hookimpl
from hicache_core.registry import PluginRecord, default_registry, reset_default_registry
from sglang_helpers import kernel_available, host_tensors, placed, same_bytes, settle
from test_transfers import device_layer, make_pools, random_pools

KV_STACKED = "kv_stacked"  # LMCache-style: all components in one [n_components, L, S, row] buffer
NEVER = "never_fits"


class KvStackedLayout:
    name = KV_STACKED
    description = "[C, L, S, row]: every component's layer_first block in one buffer (rows of equal bytes)"

    def check(self, spec: PoolSpec) -> str | None:
        rows = {c.row_bytes for c in spec.components}
        return None if len(rows) == 1 else f"components have rows of {sorted(rows)} bytes; kv_stacked needs one width"

    def plan(self, spec: PoolSpec) -> HostPlan:
        comps, S = spec.components, spec.capacity
        L = spec.component_map(comps[0].name).host_layer_num
        row = comps[0].row_bytes
        segments = tuple(
            Segment("kv", c.name, None, 0, row,
                    Addressing(offset=i * L * S * row, layer=S * row, page=spec.page_size * row, token=row,
                               chunk_bytes=row))
            for i, c in enumerate(comps)
        )
        return HostPlan((BufferSpec("kv", (len(comps), L, S, row // comps[0].itemsize), comps[0].dtype),), segments)


class NeverLayout:
    name = NEVER
    description = "holds nothing"

    def check(self, spec: PoolSpec) -> str | None:
        return "this test layout holds no pool"

    def plan(self, spec: PoolSpec) -> HostPlan:
        raise AssertionError("never planned")


class _TestLayouts:
    @hookimpl
    def hicache_register_layouts(self, register: Callable) -> None:
        register(KvStackedLayout())
        register(NeverLayout())


@pytest.fixture
def plugin_layouts():
    """A third-party layout plugin registered in the process-wide registry for the test."""
    reset_default_registry()
    default_registry().add_plugin(_TestLayouts(), PluginRecord("test_layouts", "hicache-sglang-test-layouts", "0"))
    yield
    reset_default_registry()


# --- server arguments -----------------------------------------------------------------


def _parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_plugin_layouts_are_server_argument_choices(hooked, plugin_layouts, caplog, capsys):
    caplog.set_level(logging.INFO, logger="hicache_core.integrations.sglang")
    parser = _parser()
    args = parser.parse_args(["--model-path", "m", "--hicache-mem-layout", KV_STACKED])
    assert args.hicache_mem_layout == KV_STACKED
    choices = parser._option_string_actions["--hicache-mem-layout"].choices
    assert choices[:5] == ["layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"]
    assert KV_STACKED in choices and NEVER not in choices
    assert f"layout '{NEVER}' is not offered to SGLang: it can hold neither pool kind (MLA: this test layout " \
           "holds no pool; MHA: this test layout holds no pool)" in caplog.text
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--hicache-mem-layout", NEVER])
    assert f"invalid choice: '{NEVER}'" in capsys.readouterr().err


def test_off_keeps_sglang_choices(sglang_hooks, plugin_layouts, monkeypatch):
    from hicache_core.integrations.sglang import load_plugin

    monkeypatch.setenv("HICACHE_SGLANG", "off")
    load_plugin()
    assert KV_STACKED not in _parser()._option_string_actions["--hicache-mem-layout"].choices


def test_layout_that_cannot_hold_the_pool_fails_clearly(hooked):
    """The installed test ``page_head`` layout holds MHA pools only; SGLang would say 'Unsupported layout'."""
    with pytest.raises(ValueError, match=r"hicache layout 'page_head' cannot hold this SGLang MLA host pool "
                                         r"\(mla .*\): page_head stores per-head rows of MHA pools only"):
        make_pools("mla", "page_head")
    with pytest.raises(ValueError, match=r"Unsupported layout: 'nowhere' \(neither SGLang nor an installed "
                                         r"hicache layout plugin provides it\)"):
        make_pools("mha", "nowhere")


def test_plugin_layout_allocated_by_its_plan_through_sglangs_allocator(hooked, plugin_layouts, monkeypatch):
    from sglang.srt.mem_cache.pool_host import common

    calls = []
    real = common.ALLOC_MEMORY_FUNCS[H.DEVICE]

    def spy(dims, **kw):
        calls.append((dims, kw))
        return real(dims, **kw)

    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, H.DEVICE, spy)
    dev, host = make_pools("mha", KV_STACKED)
    (dims, kw), = calls
    assert kw["dtype"] == torch.uint8 and kw["pin_memory"] == host.pin_memory and kw["allocator"] is host.allocator
    kv = host._hicache_host_buffers["kv"]
    row = host.head_num * host.head_dim
    assert tuple(kv.shape) == (2, host.layer_num, host.size, row) and kv.dtype == host.dtype
    assert kv.untyped_storage().data_ptr() == host.kv_buffer.untyped_storage().data_ptr()
    assert tuple(host.kv_buffer.shape[:2]) == (2, host.layer_num) and host.kv_buffer.numel() >= kv.numel()
    item = host.dtype.itemsize
    assert (host.token_stride_size, host.layout_dim) == (row * item, row * item * host.layer_num)


# --- storage tier end to end ---------------------------------------------------------------

CASES = [(k, lay) for k in ("mla", "mla_sharded", "mha") for lay in (*H.LAYOUTS, KV_STACKED)] + [("mha", "page_head")]


def _file_backend(tmp_path, is_mla: bool):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="hicache-test")
    return HiCacheFile(config, file_path=str(tmp_path / "l3"))


def _controller(host, backend):
    """What SGLang's ``HiCacheController._generic_page_set/_get`` read of their controller."""
    return SimpleNamespace(storage_host_pool=host, storage_backend=backend, page_size=host.page_size)


def _host_bytes(host) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8).cpu() for t in host_tensors(host)])


def _check_pointers(host, h: torch.Tensor) -> None:
    """Zero-copy view: the blocks ``get_page_buffer_meta`` names hold each page's bytes, in page order."""
    ptrs, sizes = host.get_page_buffer_meta(h)
    ps = host.page_size
    want = torch.cat([host.get_data_page(int(s)).reshape(-1).view(torch.uint8) for s in h[::ps]])
    got = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
    assert got == bytes(want.numpy())


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("kind,layout", CASES)
def test_storage_roundtrip(hooked, plugin_layouts, tmp_path, kind, layout, io_backend):
    from sglang.srt.managers.cache_controller import HiCacheController

    if io_backend == "kernel" and layout in H.LAYOUTS:
        why = kernel_available(layout, kind == "mla_sharded")
        if why:
            pytest.skip(why)
    if io_backend == "kernel" and layout == "page_head" and torch.cuda.is_available():
        pytest.skip("SGLang's own page_head kernel serves this cell on CUDA (sgl_kernel is stubbed here)")
    dev, host, layers, h, d1, d2 = random_pools(kind, layout)
    host.backup_from_device_all_layer(dev, *placed(io_backend, h, d1, H.DEVICE), io_backend)
    settle()

    ps = host.page_size
    keys = [f"{kind}-{layout}-{io_backend}-{i}" for i in range(h.numel() // ps)]
    backend = _file_backend(tmp_path, kind != "mha")
    ctl = _controller(host, backend)
    assert HiCacheController._generic_page_set(ctl, keys, h)
    if layout in (KV_STACKED, "page_first_kv_split"):
        _check_pointers(host, h)

    pages = [host.get_data_page(int(p)).reshape(-1).view(torch.uint8).clone() for p in h[::ps]]
    for t in host_tensors(host):
        t.view(torch.uint8).fill_(0)
    operation = SimpleNamespace(request_id="r", is_terminated=lambda: False)
    assert HiCacheController._generic_page_get(ctl, operation, keys, h) == len(keys)
    for p, want in zip(h[::ps], pages):
        assert torch.equal(host.get_data_page(int(p)).reshape(-1).view(torch.uint8), want)
    # nothing written outside those pages (random pages: their non-zero bytes are all there is)
    assert int(_host_bytes(host).count_nonzero()) == sum(int(w.count_nonzero()) for w in pages) > 0

    before = {d: [t.clone() for t in device_layer(kind, dev, d)] for d, _ in layers}
    for d, _ in layers:
        host.load_to_device_per_layer(dev, *placed(io_backend, h, d2, H.DEVICE), d, io_backend)
    for d, _ in layers:
        for got, old in zip(device_layer(kind, dev, d), before[d]):
            assert same_bytes(got[d2], old[d1]), f"layer {d}: loaded rows differ from the backed-up rows"
            keep = torch.ones(got.shape[0], dtype=torch.bool)
            keep[d2] = False
            assert same_bytes(got[keep.to(got.device)], old[keep.to(old.device)]), f"layer {d}: other rows moved"


@pytest.mark.parametrize("kind", ["mla", "mla_sharded", "mha"])
def test_registered_buffers_cover_every_page_block_of_kv_split(hooked, kind):
    """Zero-copy storage backends register ``kv_buffer`` plus ``get_hybrid_pool_buffer()``: for the
    ``page_first_kv_split`` buffers hicache allocates, those cover every block ``get_page_buffer_meta`` names (MLA
    rope rows live in a buffer of their own)."""
    dev, host = make_pools(kind, "page_first_kv_split")
    bufs = [host.kv_buffer, *getattr(host, "get_hybrid_pool_buffer", lambda: [])()]
    regions = [(b.data_ptr(), b.numel() * b.element_size()) for b in bufs if b is not None]
    for page in range(3):
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * host.page_size, (page + 1) * host.page_size))
        assert ptrs and all(any(a <= p and p + n <= a + m for a, m in regions) for p, n in zip(ptrs, sizes))


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_sglangs_page_size_probe_works_on_the_pools_we_serve(hooked, kind):
    """SGLang's ``get_page_buffer_element_size`` (UMBP calls it when it starts) asks ``get_page_buffer_meta`` about
    ``torch.zeros(page_size)``: the first page, named by its first slot repeated."""
    dev, host = make_pools(kind, "page_first_kv_split")
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(host.page_size))
    assert host.get_page_buffer_element_size(1) == sizes[0]


def test_page_hooks_take_only_the_first_slot_of_a_page(hooked):
    """A slot inside a page, or a non-integer, raises instead of naming the page that holds it (an off-by-one in a
    storage backend would read or overwrite a neighbouring page)."""
    dev, host = make_pools("mha", "page_first_kv_split")
    ps = host.page_size
    page = host.get_data_page(ps)
    assert torch.equal(host.get_data_page(torch.tensor(ps)), page)  # a 0-d integer tensor is an integer
    for bad in (ps + 1, ps + 0.5, "4"):
        with pytest.raises(ValueError, match="get_data_page: "):
            host.get_data_page(bad)
    before = host.get_data_page(ps)
    with pytest.raises(ValueError, match="host slot 5 does not start a page"):
        host.set_from_flat_data_page(ps + 1, torch.zeros_like(page))
    assert torch.equal(host.get_data_page(ps), before)
    slots = torch.arange(ps, 2 * ps)
    assert host.get_page_buffer_meta(slots)[0]
    with pytest.raises(ValueError, match="get_page_buffer_meta: host slot 5 does not start a page"):
        host.get_page_buffer_meta(slots + 1)
    # as SGLang reads them, by each page's first index: slots of the page in any order, or the first one repeated
    # (UMBP sizes its pages with get_page_buffer_meta(torch.zeros(page_size)))
    assert host.get_page_buffer_meta(slots[[0, 1, 3, 2]]) == host.get_page_buffer_meta(slots)
    assert host.get_page_buffer_meta(torch.full((ps,), ps)) == host.get_page_buffer_meta(slots)
    assert host.get_page_buffer_meta(torch.zeros(ps, dtype=torch.int64))[0]
    with pytest.raises(ValueError, match="indices 0..3 name slots of more than one page"):
        host.get_page_buffer_meta(torch.tensor([ps, ps + 1, ps + 2, 3 * ps]))


def test_an_mha_kv_split_pool_with_fewer_pages_than_layers_builds_with_per_layer_views(hooked):
    """SGLang's per-layer transfer views of a layout it does not know index the first dimension: for the page-major
    buffers hicache allocates that is the page (an IndexError where pages < layers, page views otherwise).  Each view
    is now one layer's [pages, page_size, heads, dim], and the pool moves its bytes."""
    from sglang_helpers import same_bytes, settle

    with H.sglang_runtime(hicache_mem_layout="page_first_kv_split"):
        dev = H.make_mha_device_pool(size=8, page_size=4, layer_num=8, head_num=2, head_dim=16)
        host = H.make_host_pool(dev)
    assert host.page_num < host.layer_num == 8
    assert host.kv_buffer.shape == (2, host.page_num, 8, 4, 2, 16)  # page-major again after the views were made
    assert len(host.k_data_refs) == 8
    for layer, view in enumerate(host.k_data_refs):
        assert view.shape == (host.page_num, 4, 2, 16) and view.data_ptr() == host.k_buffer[0, layer].data_ptr()
    for t in (*dev.k_buffer, *dev.v_buffer):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())).to(t.dtype))
    h, d = host.alloc(4), torch.arange(4, 8)
    host.backup_from_device_all_layer(dev, h, d, "direct")
    settle()
    page = int(h[0]) // 4
    assert all(same_bytes(host.k_buffer[page, layer], dev.k_buffer[layer][d]) for layer in range(8))
