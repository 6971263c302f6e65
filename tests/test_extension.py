"""Extension proof: a third-party layout and a vendor io_backend, installed as real distributions, need no core edit.

``tests/plugins/page_head`` (dist ``hicache-test-page-head``) adds the layout
``page_head``; ``tests/plugins/fake_vendor`` (dist ``hicache-test-vendor``)
adds the io_backend ``fakedma``.  Both are installed editable by the test
set-up (dev/bootstrap.sh).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, ResolutionError, create_registry
from hicache_core import cli
from hicache_core.testing.conformance import CASES, INDEX_VARIANTS, Case, check_load_all, check_strategy, make_device_buffers

MHA_CASES = [c for c in CASES if c.build(torch.device("cpu")).kind == "mha"]


def _installed(name: str) -> bool:
    return any(ep.name == name for ep in entry_points(group="hicache"))


pytestmark = pytest.mark.skipif(
    not (_installed("page_head") and _installed("fake_vendor")),
    reason="pip install --no-build-isolation --no-deps -e tests/plugins/page_head -e tests/plugins/fake_vendor",
)


@pytest.fixture
def reg():
    return create_registry(env={"HICACHE_PLUGINS": "core,page_head,fake_vendor"})


@pytest.fixture
def reg_vendor_layouts():
    """The vendor backend on layouts of our own distributions."""
    return create_registry(env={"HICACHE_PLUGINS": "core,layer_first,page_first,fake_vendor"})


# -- page_head ------------------------------------------------------------------------
def test_page_head_comes_from_its_distribution(reg):
    layout, record = reg.layouts["page_head"]
    assert (record.name, record.dist, record.version) == ("page_head", "hicache-test-page-head", "0.1.0")
    assert [c.name for c in reg.candidates("page_head", "direct", True)] == ["core.direct"]
    assert [c.name for c in reg.candidates("page_head", "reference", False)] == ["core.reference"]


@pytest.mark.parametrize("io_backend", ["reference", "direct"])
@pytest.mark.parametrize("case", MHA_CASES, ids=[c.id for c in MHA_CASES])
def test_page_head_conformance(reg, case, io_backend):
    for variant in INDEX_VARIANTS:
        pool = check_strategy(reg, case, "page_head", io_backend, variant=variant)
        assert pool.strategy_name == f"core.{io_backend}"
    check_strategy(reg, case, "page_head", io_backend, per_layer_backup=True)
    check_load_all(reg, case, "page_head", io_backend)


@pytest.mark.parametrize("io_backend", ["reference", "direct"])
def test_page_head_host_bytes_are_where_the_layout_says(reg, io_backend):
    """Backed-up rows land at ``[page, head, token in page, host layer, :]``, bit-exact."""
    heads, hd, vd, ps = 2, 4, 3, 4
    lmap = LayerMap.sharded_cp(5, 2, 0)  # device layers 0..2 -> host slots 0..2
    spec = PoolSpec.mha(layer_map=lmap, head_num=heads, head_dim=hd, v_head_dim=vd, dtype=torch.bfloat16,
                        page_size=ps, capacity=3 * ps)
    dev = make_device_buffers(spec, Case("x", lambda d: spec), torch.Generator().manual_seed(3))
    pool = HostKVPool(spec, "page_head", io_backend, dev, registry=reg, pin_memory=False)
    assert {n: tuple(t.shape) for n, t in pool.host_buffers.items()} == {"k": (3, heads, ps, 3, hd), "v": (3, heads, ps, 3, vd)}
    host = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    device_rows = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])
    pool.backup_all_layers(host, device_rows)
    for name, dim in (("k", hd), ("v", vd)):
        buf = pool.host_buffers[name]
        for slot, row in zip(host.tolist(), device_rows.tolist()):
            for h_slot, layer in zip(lmap.host_slots, lmap.device_layers):
                want = dev[name][layer][row].view(heads, dim)
                got = buf[slot // ps, :, slot % ps, h_slot, :]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (name, slot, layer)


def test_page_head_rejects_mla_with_a_reason(reg):
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=16, capacity=32)
    assert reg.layout("page_head").check(spec) == "page_head stores per-head rows of MHA pools only; this pool is 'mla'"
    with pytest.raises(ResolutionError, match=r"layout page_head: page_head stores per-head rows of MHA pools only"):
        reg.resolve(spec, "page_head", "direct")


def test_page_head_rejects_rows_that_do_not_split_into_heads(reg):
    from hicache_core import Component

    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=8, dtype=torch.float16,
                        page_size=4, capacity=8, extra=(Component("scale", 6, torch.float16),))
    assert reg.layout("page_head").check(spec) == (
        "component 'scale' row of 6 bytes does not split into 2 heads of whole torch.float16 items")


def test_matrix_shows_page_head_served_by_reference_and_direct(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_PLUGINS", "core,page_head")
    assert cli.main(["matrix", "--layout", "page_head", "--kind", "mha"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("page_head")]
    assert rows == [
        ["page_head", backend, sharded, "mha", *[f"core.{backend}"] * 4]
        for backend in ("auto", "direct", "reference") for sharded in ("no", "yes")
    ]


# -- fakedma ---------------------------------------------------------------------------
def _calls(pool: HostKVPool) -> list[tuple[str, int | None, int]]:
    return [(c.op, c.layer, c.tokens) for c in pool.strategy.calls]


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("mha-fp16-ps1", "mla576-fp8-ps16-sharded5of2r1",
                                                                "mla576-bf16-ps4-sharded-drafts")],
                         ids=lambda c: c.id)
def test_fakedma_is_dispatched_for_its_exact_keys(reg_vendor_layouts, layout, case):
    reg = reg_vendor_layouts
    spec = case.build(torch.device("cpu"))
    res = reg.resolve(spec, layout, "fakedma")
    assert (res.info.name, res.provider.dist, res.info.generic) == ("test_vendor.fakedma", "hicache-test-vendor", False)
    pool = check_strategy(reg, case, layout, "fakedma", per_layer_backup=True)
    n = spec.layer_map.num_device_layers
    owned = spec.layer_map.device_layers
    calls = _calls(pool)
    assert calls[0] == ("prepare", None, 0)
    assert [c[:2] for c in calls[1:]] == [("backup", d) for d in owned] + [("load", d) for d in owned]
    assert len(calls) == 1 + 2 * len(owned) and len(owned) <= n


def test_fakedma_backup_all_and_load_all(reg_vendor_layouts):
    case = next(c for c in CASES if c.id == "mha-fp16-ps1")
    check_load_all(reg_vendor_layouts, case, "page_first_direct", "fakedma")
    spec = case.build(torch.device("cpu"))
    dev = make_device_buffers(spec, case, torch.Generator().manual_seed(0))
    pool = HostKVPool(spec, "layer_first", "fakedma", dev, registry=reg_vendor_layouts, pin_memory=False)
    pool.backup_all_layers(torch.arange(4), torch.arange(4, 8))
    pool.load_all_layers(torch.arange(4), torch.arange(8, 12))
    assert _calls(pool) == [("prepare", None, 0), ("backup", None, 4), ("load", None, 4)]
    for name in ("k", "v"):
        for layer in range(3):
            assert torch.equal(dev[name][layer][8:12].view(torch.uint8), dev[name][layer][4:8].view(torch.uint8))


def test_fakedma_serves_only_its_keys(reg_vendor_layouts):
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=8, dtype=torch.float16,
                        page_size=4, capacity=8)
    assert reg_vendor_layouts.candidates("page_first", "fakedma", False) == []
    with pytest.raises(ResolutionError) as exc:
        reg_vendor_layouts.resolve(spec, "page_first", "fakedma")
    text = str(exc.value)
    assert "(none): no strategy is registered for io_backend 'fakedma' and this layout" in text
    assert "layout='page_first_direct', io_backend='fakedma' (test_vendor.fakedma)" in text
    assert "  fakedma (hicache-test-vendor 0.1.0)" in text


def test_fakedma_rejects_fp32_with_a_reason(reg_vendor_layouts):
    case = next(c for c in CASES if c.id == "mha-fp32-ps64-sharded3of2r0")
    spec = case.build(torch.device("cpu"))
    with pytest.raises(ResolutionError) as exc:
        reg_vendor_layouts.resolve(spec, "layer_first", "fakedma")
    lines = str(exc.value).splitlines()
    assert lines[1] == ("  test_vendor.fakedma: fakedma moves 1- and 2-byte element pools only; "
                        "components ['k', 'v'] are float32")
    assert lines[2].startswith("nearest working alternatives: layout='layer_first', io_backend='auto' (core.auto); "
                               "layout='layer_first', io_backend='direct' (core.direct)")


def test_verify_reaches_the_vendor_backend(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_PLUGINS", "core,page_head,fake_vendor")
    assert cli.main(["verify", "--device", "cpu", "--io-backend", "fakedma", "--kind", "mha", "--no-timing"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("page_head")]
    assert rows == [["page_head", "fakedma", s, "mha", "test_vendor.fakedma", "PASS", "-", "-"] for s in ("no", "yes")]


def test_a_segment_one_byte_past_its_buffer_is_refused_and_one_that_ends_on_it_is_not() -> None:
    """The bound is exact: a segment whose last byte is the buffer's last binds, one shifted by a byte is refused."""
    from hicache_core import Addressing, Segment
    from hicache_core.errors import SpecError
    from hicache_core.layout import strided_host_view

    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=4, dtype=torch.float16, page_size=2,
                        capacity=4)
    flat = torch.zeros(32, dtype=torch.uint8)  # one host layer of 4 slots of 8 B
    for offset, ok in ((0, True), (1, False)):
        seg = Segment("k", "k", None, 0, 8, Addressing(offset, 32, 16, 8, 8))
        if ok:
            assert strided_host_view(flat, seg, spec, 1).shape[1:] == (2, 2, 1, 8)
        else:
            with pytest.raises(SpecError, match=r"reaches bytes 1\.\.32 of host buffer 'k', which holds 32 B"):
                strided_host_view(flat, seg, spec, 1)


def test_a_plan_whose_segment_outruns_its_buffer_is_refused():
    """A layout plan whose addressing reaches past its own buffer (here the page stride one row too large) is refused
    with a ``SpecError`` naming the buffer, also where the buffers are views of one larger allocation (which a strided
    view alone would accept, reading the next buffer's bytes)."""
    from hicache_core import Addressing, BufferSpec, HostPlan, Segment, hookimpl
    from hicache_core.errors import SpecError

    class OffByRow:
        name, description = "off_by_row", "a buggy plan"

        def check(self, spec):  # type: ignore[no-untyped-def]
            return None

        def plan(self, spec):  # type: ignore[no-untyped-def]
            bufs, segs = [], []
            for c in spec.components:
                row = c.row_bytes
                bufs.append(BufferSpec(c.name, (spec.capacity, row // c.itemsize), c.dtype))
                segs.append(Segment(c.name, c.name, None, 0, row, Addressing(0, 0, spec.page_size * row + row, row, row)))
            return HostPlan(tuple(bufs), tuple(segs))

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(OffByRow())

    reg = create_registry(plugins=[("buggy", Plugin())])
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=4, dtype=torch.float16, page_size=2,
                        capacity=4)
    dev = {"k": [torch.zeros(8, 1, 4).half()], "v": [torch.zeros(8, 1, 4).half()]}
    block = torch.zeros(2 * 16 + 64, dtype=torch.float16)  # k then v then spare bytes, one allocation
    for host in (None, {"k": block[:16].view(4, 4), "v": block[16:32].view(4, 4)}):
        with pytest.raises(SpecError, match=r"segment of 'k' reaches bytes 0\.\.39 of host buffer 'k', which holds 32 B"):
            HostKVPool(spec, "off_by_row", "direct", dev, registry=reg, host_buffers=host, pin_memory=False)


@pytest.mark.parametrize("backend", ["direct", "reference", "auto"])
def test_segments_that_split_a_row_anywhere_bind_to_device_parts_held_apart(backend: str) -> None:
    """A layout storing an MLA row as two segments cut at byte 288 (not at the latent/rope boundary, ``part`` left
    ``None``) with reserved bytes after the row: a device pool holding latent and rope apart moves the same host bytes
    as one holding whole rows, the reserved bytes untouched, and loads them back into the parts."""
    from hicache_core import Addressing, BufferSpec, HostPlan, Segment, hookimpl

    class CutRows:
        name, description = "cut_rows", "a row in two segments cut mid-latent, reserved bytes after it"

        def check(self, spec):  # type: ignore[no-untyped-def]
            return None

        def plan(self, spec):  # type: ignore[no-untyped-def]
            row = spec.components[0].row_bytes
            span = 2 * row  # the row, then as many reserved bytes
            lay = spec.layer_map.host_layer_num
            buf = BufferSpec("kv", (lay, spec.capacity, span // 2), torch.bfloat16)

            def at(off: int, width: int) -> Addressing:
                return Addressing(offset=off, layer=spec.capacity * span, page=spec.page_size * span, token=span,
                                  chunk_bytes=width)
            return HostPlan((buf,), (Segment("kv", "kv", None, 288, row - 288, at(288, row - 288)),
                                     Segment("kv", "kv", None, 0, 288, at(0, 288))))

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(CutRows())

    reg = create_registry(plugins=[("cut", Plugin())])
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=256, qk_rope_head_dim=32, dtype=torch.bfloat16,
                        page_size=2, capacity=8)
    gen = torch.Generator().manual_seed(5)
    whole = [torch.randn(16, 1, 288, generator=gen).to(torch.bfloat16) for _ in range(2)]
    parts = {"latent": [w[:, 0, :256].clone() for w in whole], "rope": [w[:, 0, 256:].clone() for w in whole]}
    pools = [HostKVPool(spec, "cut_rows", backend, dev, registry=reg, pin_memory=False)
             for dev in ({"kv": whole}, parts)]
    for p in pools:
        p.host_buffers["kv"].view(torch.uint8).fill_(0xA5)
    h, d = torch.arange(2, 6), torch.tensor([9, 10, 3, 4])
    for p in pools:
        p.backup_all_layers(h, d)
    host = [p.host_buffers["kv"].view(torch.uint8).reshape(2, 8, 2, 576) for p in pools]
    assert torch.equal(host[0], host[1])
    assert bool((host[1][:, :, 1] == 0xA5).all())  # the reserved bytes
    want = torch.stack([w[d, 0].view(torch.uint8) for w in whole])
    assert torch.equal(host[1][:, 2:6, 0], want)
    for t in (*parts["latent"], *parts["rope"]):
        t.zero_()
    pools[1].load_all_layers(h, torch.tensor([0, 1, 12, 13]))
    for i, w in enumerate(whole):
        got = torch.cat([parts["latent"][i], parts["rope"][i]], dim=1)[torch.tensor([0, 1, 12, 13])]
        assert torch.equal(got.view(torch.uint8), w[d, 0].view(torch.uint8))
