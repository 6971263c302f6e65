"""Review of the SGLang bridge: the decision, the description and the fallbacks, cell by cell, where the other
files leave a rule untested.  SGLang 0.5.23's real classes; bytes compared exactly; canaries where bytes must stay.
"""

from __future__ import annotations

import pytest
import torch

import sglang_harness as H
from sglang_helpers import fill_canary, host_tensors, refuse_hicache_kernel, same_bytes, settle, sglangs_own_op
from test_dsa_indexer import make_indexer
from test_transfers import make_pools, slots


@pytest.fixture
def measured(hooked, monkeypatch, stock_kernels):
    """The default mode with the shipped table, SGLang's stock kernels pretended present (their CPU NameError then
    shows where SGLang's own code ran)."""
    from hicache_core.integrations.sglang import hooks

    monkeypatch.setenv("HICACHE_SGLANG", "measured")
    monkeypatch.delenv("HICACHE_SGLANG_TABLE", raising=False)
    monkeypatch.delenv("HICACHE_SGLANG_KERNEL", raising=False)
    hooks._decided.clear()
    hooks._resolved.clear()


def _random(ts):
    for t in ts:
        t.view(torch.uint8).random_(0, 256)


# --- sharded pools: the decision must see the sharding -------------------------------------------------------


def test_sharded_mla_backup_that_sglang_cannot_serve_is_served_under_measured(measured):
    """LayerSplit MLA, page_first_direct + direct: SGLang's sharded backup raises (layer_first only), its load is stock.
    hicache serves the backup (the decision must count the pool as sharded) and leaves the load to SGLang."""
    dev, host = make_pools("mla_sharded", "page_first_direct")
    owned = [(d, host._host_layer_by_controller[d]) for d in host._target_layer_indices]
    _random(dev.kv_buffer[d] for d, _ in owned)
    h, d1, _ = slots(host, dev)
    (expected,) = [t.view(torch.uint8) for t in fill_canary(host)]
    ps = host.page_size
    for d, hl in owned:
        rows = dev.kv_buffer[d].view(torch.uint8)[d1]
        expected[h // ps, hl, h % ps] = rows.reshape(expected[h // ps, hl, h % ps].shape)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.kv_buffer, expected)
    (expected,) = [t.view(torch.uint8) for t in fill_canary(host)]
    d, hl = owned[0]
    expected[h // ps, hl, h % ps] = dev.kv_buffer[d].view(torch.uint8)[d1].reshape(expected[h // ps, hl, h % ps].shape)
    host._backup_from_device_per_layer(h, d1, d, "direct")  # the per-layer backup SGLang's own loop calls
    settle()
    assert same_bytes(host.kv_buffer, expected)
    with pytest.raises(NameError, match="transfer_kv_per_layer_direct_pf_lf"):  # load: SGLang's stock cell
        host.load_to_device_per_layer(dev, h, d1, d, "direct")


def test_sharded_indexer_backup_that_sglang_cannot_serve_is_served_under_measured(measured):
    """The DSA indexer of a LayerSplit pool, page_first_direct + direct: a gap for backups (SGLang raises), stock for
    loads; hicache must see the sidecar's sharding through its device pool."""
    dev, kv_host, host = make_indexer("page_first_direct")
    ps = host.page_size
    live = [(d, host._host_layer_index(d)) for d in host._live_target_layers]
    buf = dev.index_k_with_scale_buffer
    _random(buf[d] for d, _ in live)
    h = kv_host.alloc(2 * ps)[ps:]
    d1 = torch.arange(2 * ps, 3 * ps)
    (expected,) = fill_canary(host)
    for d, hl in live:
        expected[h[0] // ps, hl, 0] = buf[d][d1[0] // ps]
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.index_k_with_scale_buffer, expected)
    with pytest.raises(NameError, match="transfer_kv_per_layer_direct_pf_lf"):
        host.load_to_device_per_layer(dev, h, d1, live[0][0], "direct")


# --- packed MTP drafts: the draft's own device pool and layer id ---------------------------------------------------


def _indexer_with_draft(layout: str):
    """The indexer sidecar of a LayerSplit DSA pool (rank 1 of 2, 5 layers: owns 3, 4) with one packed draft pool
    (controller id 5, host layer ``target_layer_num``)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    with H.sglang_runtime(hicache_mem_layout=layout):
        dev = H.make_layer_split_dsa_device_pool(size=192, page_size=64, layer_num=5, kv_lora_rank=64,
                                                 qk_rope_head_dim=32)
        draft = DSATokenToKVPool(size=192, page_size=64, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=32,
                                 layer_num=1, device=H.DEVICE, index_head_dim=128, enable_memory_saver=False,
                                 kv_cache_dim=96)
        kv_host = H.make_host_pool(dev)
        (decl,) = [d for d in dev.host_pool_decls() if not d.is_primary]
        host = H._keep(DSAIndexerPoolHost(decl, kv_host, packed_draft_device_pools=(draft,), pin_memory=H.PIN,
                                          allocator_type=get_allocator_type()), H.PIN)
    return dev, draft, kv_host, host


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_indexer_packed_draft_backup_and_load(hooked, layout):
    """The draft's rows go to host layer ``target_layer_num`` on the all-layer backup and on the per-layer backup
    SGLang's sharded loop makes with ``is_draft`` (the draft's own device pool passed); the draft load, called with
    that pool and ``is_draft``, writes the draft pool's rows and nothing else."""
    dev, draft, kv_host, host = _indexer_with_draft(layout)
    ps, hl = host.page_size, host.target_layer_num
    assert host.layer_num == hl + 1 and dev.layer_num == 5
    src = draft.index_k_with_scale_buffer[0]
    _random([src, *(dev.index_k_with_scale_buffer[d] for d in host._live_target_layers)])
    h = kv_host.alloc(2 * ps)[ps:]
    d1, d2 = torch.arange(2 * ps, 3 * ps), torch.arange(ps, 2 * ps)
    hp, p1, p2 = int(h[0]) // ps, int(d1[0]) // ps, int(d2[0]) // ps

    def draft_slot(t):
        return t[hl, hp] if layout == "layer_first" else t[hp, hl, 0]

    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(draft_slot(host.index_k_with_scale_buffer), src[p1])
    (expected,) = fill_canary(host)
    draft_slot(expected).copy_(src[p1])
    host._backup_from_device_per_layer(draft, h, d1, dev.layer_num, "direct", is_draft=True)
    settle()
    assert same_bytes(host.index_k_with_scale_buffer, expected)
    want = src.clone()
    want[p2] = src[p1]
    host.load_to_device_per_layer(draft, h, d2, dev.layer_num, "direct", is_draft=True)
    settle()
    assert same_bytes(src, want)


def test_mha_packed_draft_backup_and_load(hooked):
    """MHA with a packed draft pool: K and V of the draft land in host layer ``target_layer_num`` (K in K, V in V),
    and the draft load (``is_draft``, id ``target_layer_num``) brings both back to the draft pool."""
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        dev = H.make_mha_device_pool(size=64, page_size=4, layer_num=3, head_num=2, head_dim=16)
        draft = H.make_mha_device_pool(size=64, page_size=4, layer_num=1, head_num=2, head_dim=16)
        host = H.make_host_pool(dev, mtp_draft_device_pools=(draft,))
    assert host.layer_num == 4 and host.target_layer_num == 3
    _random([*dev.k_buffer, *dev.v_buffer, *draft.k_buffer, *draft.v_buffer])
    h, d1, d2 = slots(host, dev)
    fill_canary(host)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.k_buffer[h, 3], draft.k_buffer[0][d1])
    assert same_bytes(host.v_buffer[h, 3], draft.v_buffer[0][d1])
    assert same_bytes(host.k_buffer[h, 2], dev.k_buffer[2][d1])
    want = [t.clone() for t in (draft.k_buffer[0], draft.v_buffer[0])]
    for t in want:
        t[d2] = t[d1]
    host.load_to_device_per_layer(draft, h, d2, 3, "direct", is_draft=True)
    settle()
    assert same_bytes(draft.k_buffer[0], want[0]) and same_bytes(draft.v_buffer[0], want[1])

def test_a_draft_call_naming_no_draft_layer_is_sglangs(hooked, caplog):
    """``is_draft`` with a target layer's id (no packed draft layer): SGLang's pools read the id as a host layer; the
    bridge left it unmoved, silently.  It is SGLang's call now (its missing op shows that SGLang's own code ran), with
    a warning; a draft id the bridge maps stays the bridge's."""
    with H.sglang_runtime(hicache_mem_layout="layer_first"):
        dev = H.make_mha_device_pool(size=64, page_size=4, layer_num=3, head_num=2, head_dim=16)
        draft = H.make_mha_device_pool(size=64, page_size=4, layer_num=1, head_num=2, head_dim=16)
        host = H.make_host_pool(dev, mtp_draft_device_pools=(draft,))
    _random([*dev.k_buffer, *dev.v_buffer, *draft.k_buffer, *draft.v_buffer])
    h, d1, d2 = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    with sglangs_own_op("transfer_kv_direct"):
        host.load_to_device_per_layer(draft, h, d2, 1, "direct", is_draft=True)
    assert "no packed draft layer" in caplog.text
    host.load_to_device_per_layer(draft, h, d2, 3, "direct", is_draft=True)
    settle()
    assert same_bytes(draft.k_buffer[0][d2], host.k_buffer[3][h])



# --- packed (FP8 DSA) MLA rows -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["page_first", "page_first_kv_split"])
def test_packed_fp8_mla_rows_are_moved_whole(hooked, layout):
    """A DSA FP8 pool stores 656-byte rows (uint8), wider than kv_lora_rank + rope: the bridge plans those rows, and
    kv_split keeps them whole in ``k_buffer`` (no rope buffer)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    with H.sglang_runtime(hicache_mem_layout=layout):
        dev = DSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                               qk_rope_head_dim=64, layer_num=2, device=H.DEVICE, index_head_dim=128,
                               enable_memory_saver=False, kv_cache_dim=656)
        host = H.make_host_pool(dev)
    assert host.kv_cache_dim == 656 and host.dtype == torch.uint8
    if layout == "page_first_kv_split":
        assert host.v_buffer is None and tuple(host.k_buffer.shape[-2:]) == (1, 656)
    _random(dev.kv_buffer)
    ps = host.page_size
    h = host.alloc(2 * ps)[ps:]
    d1, d2 = torch.arange(64, 128), torch.arange(128, 192)
    (expected,) = [t.view(torch.uint8) for t in fill_canary(host)]
    for layer in range(2):
        if layout == "page_first":
            expected[h, layer, 0] = dev.kv_buffer[layer][d1, 0].cpu()
        else:
            expected[h // ps, layer, h % ps, 0] = dev.kv_buffer[layer][d1, 0].cpu()
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    (got,) = host_tensors(host)
    assert same_bytes(got, expected)
    want = [t.clone() for t in dev.kv_buffer]
    for t in want:
        t[d2] = t[d1]
    for layer in range(2):
        host.load_to_device_per_layer(dev, h, d2, layer, "direct")
    settle()
    assert all(same_bytes(t, w) for t, w in zip(dev.kv_buffer, want))


# --- which side serves: fallbacks never hand SGLang's own cells to an unmeasured hicache route ---------------------


class _Registry:
    """A registry double: strategies for the listed io_backends only."""

    def __init__(self, *backends: str):
        self.backends = backends

    @property
    def io_backends(self) -> list[str]:  # as Registry.io_backends
        return sorted(self.backends)

    def candidates(self, layout, io_backend, sharded):  # type: ignore[no-untyped-def]
        return [io_backend] if io_backend in self.backends else []


def test_registered_falls_back_to_direct_only_for_cells_sglang_cannot_serve():
    from hicache_core.integrations.sglang.hooks import _registered

    only_direct = _Registry("direct")
    # SGLang serves the cell: a missing kernel strategy leaves it to SGLang (the build fails), never to direct
    assert _registered(only_direct, "layer_first", "kernel", "kernel", False, False) == "kernel"
    assert _registered(only_direct, "layer_first", "auto", "kernel", False, False) is None
    # SGLang cannot serve it: the exact mapping, then the generic direct
    assert _registered(only_direct, "layer_first", "kernel", "kernel", True, False) == "direct"
    assert _registered(only_direct, "layer_first", "auto", "kernel", True, False) == "direct"
    assert _registered(_Registry("kernel", "direct"), "layer_first", "auto", "kernel", True, False) == "kernel"


def test_a_stock_cell_whose_strategy_cannot_be_built_stays_sglangs(hooked, monkeypatch, stock_kernels):
    """Under ``all``, SGLang ``kernel`` calls on a cell SGLang serves (MLA layer_first): where hicache's kernel strategy
    refuses the pool, SGLang's own kernel runs (its CPU NameError shows it), not hicache's unmeasured ``direct``."""
    refuse_hicache_kernel(monkeypatch)
    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    before = host.kv_buffer.clone()
    with pytest.raises(NameError, match="transfer_kv_all_layer_mla"):
        host.backup_from_device_all_layer(dev, h, d1, "kernel")
    with pytest.raises(NameError, match="transfer_kv_per_layer_mla"):
        host.load_to_device_per_layer(dev, h, d1, 0, "kernel")
    assert torch.equal(host.kv_buffer.view(torch.uint8), before.view(torch.uint8))
    assert [k[1] for k in host._hicache_bridges] == ["kernel"]


def test_an_error_inside_a_served_transfer_is_not_retried_by_sglang(hooked, monkeypatch):
    """Only hicache's argument checks (raised before any byte moves) hand a call back to SGLang; any other failure of
    a transfer hicache took is the caller's to see, not a second transfer over bytes half moved."""
    dev, host = make_pools("mla", "page_first")
    h, d1, _ = slots(host, dev)
    from hicache_core.integrations.sglang.adapter import bridge_for

    pool = bridge_for(host, dev, "direct").pool
    assert pool is not None

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    monkeypatch.setattr(pool, "backup_all_layers", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")


# --- pools the bridge must leave to SGLang ------------------------------------------------------------------------


def test_subclasses_of_the_hooked_classes_are_not_ours():
    """Subclasses (HiSparse MHA, MXFP8, asymmetric heads...) override the transfers with semantics of their own."""
    from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, HiSparseMHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    from hicache_core.integrations.sglang.adapter import pool_kind

    class Sub(MLATokenToKVPoolHost):
        pass

    for cls in (Sub, AsymmetricMHATokenToKVPoolHost, HiSparseMHATokenToKVPoolHost):
        assert pool_kind(object.__new__(cls)) is None, cls
    assert pool_kind(object.__new__(MLATokenToKVPoolHost)) == "mla"


@pytest.mark.parametrize("attr,value,why", [("_is_dummy", True, "dummy"), ("dcp_size", 2, "dcp_size=2"),
                                            ("_native_buffers", object(), "NPU-native")])
def test_dummy_dcp_and_npu_pools_are_left_to_sglang(hooked, attr, value, why):
    dev, host = make_pools("mla", "page_first")
    setattr(host, attr, value)
    from hicache_core.integrations.sglang.adapter import bridge_for

    bridge = bridge_for(host, dev, "direct")
    assert bridge.pool is None and why in (bridge.reason or "")


def test_dummy_pool_backup_runs_sglangs_original(hooked):
    dev, host = make_pools("mla", "page_first")
    h, d1, _ = slots(host, dev)
    host._is_dummy = True
    with pytest.raises(AssertionError, match="dummy"):  # SGLang's own guard
        host.backup_from_device_all_layer(dev, h, d1, "direct")


def test_device_pools_that_do_not_match_the_host_are_left_to_sglang(hooked):
    """A device pool other than the one the host pool was built for: fewer/more layers (MLA, MHA), or an unsharded
    pool where the host is layer-sharded: not described (SGLang's code decides)."""
    from hicache_core.integrations.sglang.adapter import bridge_for

    dev, host = make_pools("mla", "page_first")
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        other = H.make_mla_device_pool(size=64, page_size=4, layer_num=4, kv_lora_rank=32, qk_rope_head_dim=16)
    assert "layers" in (bridge_for(host, other, "direct").reason or "")
    assert bridge_for(host, other, "direct").pool is None

    dev, host = make_pools("mla_sharded", "page_first")
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        flat = H.make_mla_device_pool(size=192, page_size=64, layer_num=5, kv_lora_rank=64, qk_rope_head_dim=32)
    bridge = bridge_for(host, flat, "direct")
    assert bridge.pool is None and "ownership" in (bridge.reason or "")

    dev, host = make_pools("mha", "page_first")
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        other = H.make_mha_device_pool(size=64, page_size=4, layer_num=4, head_num=2, head_dim=16)
    bridge = bridge_for(host, other, "direct")
    assert bridge.pool is None and "does not match" in (bridge.reason or "")


def test_an_indexer_load_into_a_foreign_device_pool_is_left_to_sglang(hooked):
    """The indexer sidecar moves rows of its own device pool (and its drafts'); a call naming another pool is SGLang's
    (its missing op shows it), never a load into the host pool's own device pool."""
    dev, kv_host, host = make_indexer("layer_first")
    with H.sglang_runtime(hicache_mem_layout="layer_first"):
        foreign = H.make_layer_split_dsa_device_pool(size=192, page_size=64, layer_num=5, kv_lora_rank=64,
                                                     qk_rope_head_dim=32)
    ps = host.page_size
    h = kv_host.alloc(2 * ps)[ps:]
    before = [t.clone() for t in dev.index_k_with_scale_buffer]
    with sglangs_own_op("transfer_kv_direct"):
        host.load_to_device_per_layer(foreign, h, torch.arange(ps, 2 * ps), host._live_target_layers[0], "direct")
    assert all(same_bytes(a, b) for a, b in zip(dev.index_k_with_scale_buffer, before))


def test_sglang_attribute_drift_leaves_the_call_to_sglang(hooked, caplog):
    """An attribute the bridge reads and SGLang's own load does not: missing, the bridge logs a WARNING and SGLang's
    original runs (its missing op shows it), rather than the hook raising."""
    import logging

    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    del host._draft_layer_num
    with caplog.at_level(logging.WARNING, logger="hicache_core"), sglangs_own_op("transfer_kv_direct"):
        host.load_to_device_per_layer(dev, h, d1, 0, "direct")
    assert "unexpected error" in caplog.text


def test_a_cached_bridge_of_a_dead_device_pool_is_not_reused(hooked):
    """Bridges are cached by the device pool's id; an entry whose pool is another object (an id reused after the
    first pool died) is rebuilt for the pool of the call."""
    from hicache_core.integrations.sglang.adapter import Bridge, bridge_for

    dev, host = make_pools("mla", "page_first")
    stale = Bridge(object())
    host.__dict__.setdefault("_hicache_bridges", {})[(id(dev), "direct")] = stale
    bridge = bridge_for(host, dev, "direct")
    assert bridge is not stale and bridge.device_pool is dev and bridge.pool is not None


def test_the_decision_follows_the_availability_of_sglangs_stock_kernels(hooked, monkeypatch):
    """``gaps`` serves SGLang's matrix cells only where its stock kernels are missing (CPU): once they are there the
    same cell is SGLang's again, although the decision was memoised for the first call."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only: SGLang's NameError proves which side served the call")
    from hicache_core.integrations.sglang import mode

    monkeypatch.setenv("HICACHE_SGLANG", "gaps")
    dev, host = make_pools("mla", "layer_first")
    _random(dev.kv_buffer)
    h, d1, _ = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.kv_buffer[1, h], dev.kv_buffer[1][d1])
    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: True)
    with pytest.raises(NameError, match="transfer_kv_direct"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")


# --- plugin layouts of several buffers --------------------------------------------------------------------------------

KV_APART = "kv_apart"


class KvApartLayout:
    """One ``[L, S, row]`` buffer per component (an LMCache-style layout with K and V apart), for MHA pools only."""

    name = KV_APART
    description = "one layer_first buffer per component"

    def check(self, spec):  # type: ignore[no-untyped-def]
        return None if spec.kind == "mha" else "kv_apart holds MHA pools only"

    def plan(self, spec):  # type: ignore[no-untyped-def]
        from hicache_core import Addressing, BufferSpec, HostPlan, Segment

        buffers, segments = [], []
        for c in spec.components:
            L, S, row = spec.component_map(c.name).host_layer_num, spec.capacity, c.row_bytes
            buffers.append(BufferSpec(f"{c.name}_rows", (L, S, row // c.itemsize), c.dtype))
            segments.append(Segment(f"{c.name}_rows", c.name, None, 0, row,
                                    Addressing(offset=0, layer=S * row, page=spec.page_size * row, token=row,
                                               chunk_bytes=row)))
        return HostPlan(tuple(buffers), tuple(segments))


class PlanRefusesLayout:
    """Its check passes; its plan finds the pool too large (a layout may only know when it plans)."""

    name = "plan_refuses"
    description = "refuses in plan"

    def check(self, spec):  # type: ignore[no-untyped-def]
        return None

    def plan(self, spec):  # type: ignore[no-untyped-def]
        from hicache_core.errors import SpecError

        raise SpecError(f"{spec.capacity} slots exceed what plan_refuses addresses")


@pytest.fixture
def kv_apart():
    from hicache_core import hookimpl
    from hicache_core.registry import PluginRecord, default_registry, reset_default_registry

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(KvApartLayout())
            register(PlanRefusesLayout())

    reset_default_registry()
    default_registry().add_plugin(Plugin(), PluginRecord("kv_apart", "hicache-review-kv-apart", "0"))
    yield
    reset_default_registry()


def test_a_plugin_layout_of_two_buffers_gets_each_buffer_aligned_in_one_block(hooked, kv_apart):
    """Every planned buffer starts 4 KiB into SGLang's block (its registration and DMA granularity), the buffers do
    not overlap, and the pool moves K and V each into its own buffer."""
    dev, host = make_pools("mha", KV_APART)
    bufs = host._hicache_host_buffers
    base = host.kv_buffer.data_ptr()
    end = base + host.kv_buffer.numel() * host.kv_buffer.element_size()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in bufs.values())
    assert len(spans) == 2 and all((a - base) % 4096 == 0 and base <= a and b <= end for a, b in spans)
    assert spans[0][1] <= spans[1][0]
    assert (spans[0][1] - spans[0][0]) % 4096, "the test needs a buffer whose size is not a multiple of 4 KiB"
    _random([*dev.k_buffer, *dev.v_buffer])
    h, d1, _ = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    for layer in range(dev.layer_num):
        assert same_bytes(bufs["k_rows"][layer, h], dev.k_buffer[layer][d1].reshape(len(h), -1))
        assert same_bytes(bufs["v_rows"][layer, h], dev.v_buffer[layer][d1].reshape(len(h), -1))


def test_npu_native_dummy_and_dcp_pools_keep_sglangs_allocation(monkeypatch):
    """MLA ``page_first_kv_split`` with NPU-native buffers is SGLang's own allocation (the bridge leaves those pools'
    transfers to SGLang too); without them hicache allocates.  The same for plugin layouts, and for allocator-only
    (dummy) and decode-context-parallel pools."""
    from hicache_core.integrations.sglang import buffers, plugin_layouts

    class Host:
        layout, dcp_size, _is_dummy, _native_buffers = "page_first_kv_split", 1, False, object()

    monkeypatch.setattr(buffers, "pool_kind", lambda host: "mla")
    monkeypatch.setattr(plugin_layouts, "pool_kind", lambda host: "mla")
    host = Host()
    assert not buffers.wants_kv_split_takeover(host) and not plugin_layouts.wants_plugin_layout(host)
    host._native_buffers = None
    assert buffers.wants_kv_split_takeover(host)
    # a plugin layout: hicache allocates it only for pools whose transfers the bridge serves
    host.layout = "a_plugin_layout"
    assert plugin_layouts.wants_plugin_layout(host)
    for attr, value in (("_native_buffers", object()), ("_is_dummy", True), ("dcp_size", 2)):
        setattr(host, attr, value)
        assert not plugin_layouts.wants_plugin_layout(host), attr
        setattr(host, attr, getattr(Host, attr) if attr != "_native_buffers" else None)


def test_a_plugin_layout_that_holds_one_pool_kind_is_offered(hooked, kv_apart):
    """A layout that holds MHA pools but not MLA ones is a ``--hicache-mem-layout`` choice (only layouts that hold
    neither kind are left out)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert KV_APART in parser._option_string_actions["--hicache-mem-layout"].choices
    assert parser.parse_args(["--model-path", "m", "--hicache-mem-layout", KV_APART]).hicache_mem_layout == KV_APART


# --- the storage-tier page API -----------------------------------------------------------------------------------------


def test_pages_are_flat_tensors_of_the_pool_dtype_and_off_gives_sglangs_page_api_back(hooked, monkeypatch):
    """``get_data_page`` and ``get_dummy_flat_data_page`` return flat pages of the pool's dtype and equal size (the
    dummy one zeroed), which ``set_from_flat_data_page`` takes back; ``off`` hands the page API back to SGLang (its own
    error for this layout)."""
    dev, host = make_pools("mha", "page_first_kv_split")
    ps = host.page_size
    _random(host_tensors(host))
    page, dummy = host.get_data_page(ps), host.get_dummy_flat_data_page()
    assert page.dtype == dummy.dtype == host.dtype and page.dim() == dummy.dim() == 1
    assert page.numel() == dummy.numel() == 2 * host.layer_num * ps * host.head_num * host.head_dim
    assert not dummy.view(torch.uint8).any()
    host.set_from_flat_data_page(2 * ps, page)
    assert same_bytes(host.get_data_page(2 * ps), page)
    assert same_bytes(host.k_buffer[2], host.k_buffer[1]) and same_bytes(host.v_buffer[2], host.v_buffer[1])
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    with pytest.raises(ValueError, match="Unsupported layout"):
        host.get_data_page(ps)


def test_a_layout_whose_plan_refuses_the_pool_fails_with_its_reason(hooked, kv_apart):
    with pytest.raises(ValueError, match=r"hicache layout 'plan_refuses' cannot hold this SGLang MHA host pool "
                                         r"\(mha .*\): \d+ slots exceed what plan_refuses addresses"):
        make_pools("mha", "plan_refuses")


def test_page_pointers_need_whole_pages(hooked):
    dev, host = make_pools("mla", "page_first_kv_split")
    ps = host.page_size
    with pytest.raises(ValueError, match=f"get_page_buffer_meta: {ps + 1} indices are not whole pages of {ps}"):
        host.get_page_buffer_meta(torch.arange(ps, 2 * ps + 1))
