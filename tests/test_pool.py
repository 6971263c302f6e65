"""HostKVPool behaviour: wrapped engine buffers, pinning, page views, device-side views,
split MLA parts, sharded pools and the ``validate`` switch.

Host contents are checked against an independent description of each layout
(:func:`host_rows`), not against another strategy.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from hicache_core import ANY_LAYOUT, HostKVPool, LayerMap, PoolSpec, StrategyInfo, create_registry, hookimpl
from hicache_core.errors import IndexLengthMismatchError, IndexRangeError

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKENDS = ("direct", "reference")
TARGETS = [(lay, be) for lay in LAYOUTS for be in BACKENDS]
TARGET_IDS = [f"{lay}-{be}" for lay, be in TARGETS]
CUDA = torch.cuda.is_available()


def host_rows(layout: str, buf: torch.Tensor, host_layer: int) -> torch.Tensor:
    """Host layer ``host_layer`` of ``buf`` as ``[capacity, row bytes]`` uint8 (slot order)."""
    if layout == "layer_first":  # [L, S, ...]
        t = buf[host_layer]
    elif layout == "page_first":  # [S, L, ...]
        t = buf[:, host_layer]
    elif layout == "page_first_direct":  # [P, L, ps, ...]
        t = buf[:, host_layer].reshape(buf.shape[0] * buf.shape[2], *buf.shape[3:])
    else:
        raise AssertionError(layout)
    return t.reshape(t.shape[0], -1).contiguous().view(torch.uint8)


def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Device rows ``idx`` of ``t`` as ``[n, row bytes]`` uint8."""
    r = t[idx]
    return r.reshape(r.shape[0], -1).contiguous().view(torch.uint8)


def random_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill ``t`` (any dtype, any strides) with random bytes in place; return it."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (*t.shape, t.element_size()), dtype=torch.uint8, generator=gen)
    t.copy_(src.view(t.dtype).reshape(t.shape))
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def mha_spec(layers: int = 3, *, ps: int = 4, pages: int = 4, layer_map: LayerMap | None = None) -> PoolSpec:
    return PoolSpec.mha(layer_map=layer_map or LayerMap.unsharded(layers), head_num=2, head_dim=4, v_head_dim=2,
                        dtype=torch.float16, page_size=ps, capacity=ps * pages)


def mha_device(spec: PoolSpec, n_rows: int, seed: int = 0) -> dict[str, list[torch.Tensor | None]]:
    n = spec.layer_map.num_device_layers
    return {
        "k": [random_(torch.empty(n_rows, 2, 4, dtype=torch.float16), seed + i) for i in range(n)],
        "v": [random_(torch.empty(n_rows, 2, 2, dtype=torch.float16), seed + 100 + i) for i in range(n)],
    }


def pages(*ps_and_ids: int, ps: int = 4) -> torch.Tensor:
    return (torch.tensor(ps_and_ids).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)


# --- wrapping engine-allocated host buffers -------------------------------------------


def _wrapped_round_trip(backend: str, as_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
    L, S, H, D = 3, 16, 2, 4
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(L), head_num=H, head_dim=D, dtype=torch.float16,
                        page_size=4, capacity=S)
    engine_kv = random_(torch.empty(2, L, S, H, D, dtype=torch.float16), 1)  # SGLang's single kv_buffer
    dev = {n: [random_(torch.empty(40, H, D, dtype=torch.float16), 10 * j + i) for i in range(L)]
           for j, n in enumerate("kv")}
    pool = HostKVPool(spec, "layer_first", backend, dev, host_buffers={"k": as_host(engine_kv[0]), "v": as_host(engine_kv[1])})
    assert pool.host_buffers["k"].data_ptr() == engine_kv[0].data_ptr()
    assert pool.host_buffers["v"].data_ptr() == engine_kv[1].data_ptr()
    untouched = engine_kv.clone()
    h, d = pages(3, 1), torch.arange(20, 28)
    pool.backup_all_layers(h, d)
    for j, name in enumerate("kv"):
        for layer in range(L):
            assert torch.equal(as_bytes(engine_kv[j, layer, h]), as_bytes(dev[name][layer][d]))
    mask = torch.ones(S, dtype=torch.bool)
    mask[h] = False
    assert torch.equal(as_bytes(engine_kv[:, :, mask]), as_bytes(untouched[:, :, mask]))
    # the engine writes its tensor directly; loads see it
    engine_kv[1, 2, h] = 7.0
    pool.load_layer(2, h, torch.arange(8))
    assert bool((dev["v"][2][:8] == 7.0).all())
    assert torch.equal(as_bytes(dev["k"][2][:8]), as_bytes(engine_kv[0, 2, h]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapped_engine_kv_tensor_halves_as_row_views(backend: str) -> None:
    """The halves of one ``[2, L, S, H, D]`` tensor, viewed as the planned ``[L, S, H*D]``."""
    _wrapped_round_trip(backend, lambda half: half.flatten(2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapped_engine_kv_tensor_halves_as_is(backend: str) -> None:
    _wrapped_round_trip(backend, lambda half: half)


# --- pinning --------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="pinned memory needs a CUDA device")
def test_host_buffers_pinned_by_default_on_cuda() -> None:
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=4, dtype=torch.float16,
                        page_size=4, capacity=16, device="cuda")
    dev = {n: [torch.zeros(32, 2, 4, dtype=torch.float16, device="cuda") for _ in range(2)] for n in "kv"}
    pool = HostKVPool(spec, "layer_first", "direct", dev)
    assert all(t.is_pinned() for t in pool.host_buffers.values()) and pool.binding.host_pinned
    unpinned = HostKVPool(spec, "layer_first", "direct", dev, pin_memory=False)
    assert not any(t.is_pinned() for t in unpinned.host_buffers.values()) and not unpinned.binding.host_pinned


@pytest.mark.skipif(CUDA, reason="checks the CPU-only default")
def test_host_buffers_not_pinned_without_cuda() -> None:
    spec = mha_spec()
    pool = HostKVPool(spec, "page_first", "direct", mha_device(spec, 32))
    assert not pool.binding.host_pinned
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in pool.host_buffers.values())


def test_host_arguments_that_cannot_be_used_are_refused_by_name() -> None:
    """A buffer the layout does not plan was ignored, a list of buffers and a non-bool pin_memory gave raw Python or
    torch errors, pin_memory=True beside unpinned buffers was ignored: each is a HostBufferError naming the argument
    and the fix, before anything is allocated."""
    from hicache_core.errors import HostBufferError

    spec = mha_spec()
    dev = mha_device(spec, 32)
    own = {k: torch.zeros_like(v) for k, v in HostKVPool(spec, "layer_first", "reference", dev,
                                                          pin_memory=False).host_buffers.items()}
    cases = [
        ({"host_buffers": {**own, "kv": torch.zeros(4)}}, r"^host_buffers has \['kv'\], which the layout's plan does "
                                                          r"not hold \(it holds \['k', 'v'\]\); leave them out$"),
        ({"host_buffers": list(own.values())}, r"^host_buffers must map each buffer name of the layout's plan "
                                               r"\(\['k', 'v'\]\) to its tensor, got a list$"),
        ({"pin_memory": "yes"}, r"^pin_memory='yes': use True, False or leave it unset"),
        ({"host_buffers": own, "pin_memory": True}, r"^pin_memory=True, but host buffer\(s\) \['k', 'v'\] are not "
                                                    r"pinned: pin_memory applies to the buffers the pool allocates"),
        # an empty tensor holds no byte to pin: never named (an engine passes one for an empty sharded part)
        ({"host_buffers": {"k": own["k"], "v": own["v"][:0]}, "pin_memory": True},
         r"^pin_memory=True, but host buffer\(s\) \['k'\] are not pinned"),
    ]
    if not CUDA:
        cases.append(({"pin_memory": True}, r"^pin_memory=True, but torch sees no CUDA device"))
    for kwargs, message in cases:
        with pytest.raises(HostBufferError, match=message):
            HostKVPool(spec, "layer_first", "direct", dev, **kwargs)
    pool = HostKVPool(spec, "layer_first", "direct", dev, host_buffers=own)  # the right ones: used in place
    assert pool.host_buffers["k"].data_ptr() == own["k"].data_ptr()


# --- page views -----------------------------------------------------------------------


def expected_blocks(layout: str, pool: HostKVPool, page: int) -> list[tuple[int, int]]:
    """(address, nbytes) of ``page`` per layout, written out from each layout's shape."""
    spec = pool.spec
    ps, S, out = spec.page_size, spec.capacity, []
    for comp in spec.components:
        base = pool.host_buffers[comp.name].data_ptr()
        row, L = comp.row_bytes, spec.component_map(comp.name).host_layer_num
        if layout == "layer_first":  # one block per layer
            out += [(base + h * S * row + page * ps * row, ps * row) for h in range(L)]
        else:  # page_first [S, L, row] and page_first_direct [P, L, ps, row]: one block of all layers
            out.append((base + page * ps * L * row, ps * L * row))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_pointers_per_layout(layout: str) -> None:
    spec = mha_spec(3)
    pool = HostKVPool(spec, layout, "direct", mha_device(spec, 32))
    for page in range(spec.num_pages):
        assert pool.page_pointers(page) == expected_blocks(layout, pool, page)
    assert pool.page_bytes == spec.page_size * spec.bytes_per_token == 4 * 3 * (16 + 8)
    n_blocks = len(pool.page_pointers(0))
    assert n_blocks == (2 * 3 if layout == "layer_first" else 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_page_of_page_major_layouts_is_one_block(layout: str) -> None:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(4), kv_lora_rank=16, qk_rope_head_dim=8,
                        dtype=torch.bfloat16, page_size=8, capacity=32)
    dev = {"kv": [torch.zeros(40, 24, dtype=torch.bfloat16) for _ in range(4)]}
    pool = HostKVPool(spec, layout, "direct", dev)
    base = pool.host_buffers["kv"].data_ptr()
    if layout == "layer_first":
        assert pool.page_pointers(2) == [(base + h * 32 * 48 + 2 * 8 * 48, 8 * 48) for h in range(4)]
    else:
        assert pool.page_pointers(2) == [(base + 2 * 8 * 4 * 48, 8 * 4 * 48)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_get_page_reads_the_bytes_at_page_pointers(layout: str) -> None:
    spec = mha_spec(3)
    pool = HostKVPool(spec, layout, "reference", mha_device(spec, 32))
    for i, t in enumerate(pool.host_buffers.values()):
        random_(t, 50 + i)
    flats = {t.data_ptr(): as_bytes(t) for t in pool.host_buffers.values()}

    def read(addr: int, n: int) -> torch.Tensor:
        base = max(b for b in flats if b <= addr)
        return flats[base][addr - base : addr - base + n]

    for page in range(spec.num_pages):
        got = pool.get_page(page)
        assert got.dtype == torch.uint8 and got.numel() == pool.page_bytes
        assert torch.equal(got, torch.cat([read(a, n) for a, n in pool.page_pointers(page)]))
    copy = pool.get_page(1)
    copy.fill_(0)
    assert not torch.equal(pool.get_page(1), copy)  # get_page returns a copy


@pytest.mark.parametrize("layout,backend", TARGETS, ids=TARGET_IDS)
def test_get_page_set_page_round_trip(layout: str, backend: str) -> None:
    spec = mha_spec(3)
    dev = mha_device(spec, 32)
    pool = HostKVPool(spec, layout, backend, dev)
    for i, t in enumerate(pool.host_buffers.values()):
        random_(t, 70 + i)
    src = torch.arange(8, 12)
    pool.backup_all_layers(pages(1), src)
    before = {k: v.clone() for k, v in pool.host_buffers.items()}
    data = pool.get_page(1)
    pool.set_page(3, data)  # as a storage tier restoring page 1's bytes into page 3
    for name, buf in pool.host_buffers.items():
        for h in range(3):
            now, was = host_rows(layout, buf, h), host_rows(layout, before[name], h)
            assert torch.equal(now[12:16], was[4:8]), f"{name} layer {h}: page 3 != old page 1"
            assert torch.equal(now[:12], was[:12]), f"{name} layer {h}: set_page wrote outside page 3"
    dst = torch.arange(20, 24)
    for layer in range(3):
        assert pool.load_layer(layer, pages(3), dst)
        for name in "kv":
            assert torch.equal(rows(dev[name][layer], dst), rows(dev[name][layer], src))
    assert torch.equal(pool.get_page(3), data)
    pool.set_page(0, data.view(torch.float16))  # any dtype with the right byte count
    assert torch.equal(pool.get_page(0), data)


# --- device buffers as strided views ------------------------------------------------------


@pytest.mark.parametrize("layout,backend", TARGETS, ids=TARGET_IDS)
def test_device_buffers_as_strided_views(layout: str, backend: str) -> None:
    L, N = 3, 24
    spec = mha_spec(L)
    big_k = random_(torch.empty(N, L, 2, 4, dtype=torch.float16), 3)  # token stride L*H*D: layers interleaved
    padded_v = random_(torch.empty(N, 2 * 2 + 3, dtype=torch.float16), 4)  # rows padded by 3 items
    dev = {"k": [big_k[:, i] for i in range(L)], "v": [padded_v[:, :4].unflatten(1, (2, 2))] + [
        random_(torch.empty(N, 2, 2, dtype=torch.float16), 5 + i) for i in range(L - 1)]}
    assert not dev["k"][0].is_contiguous() and not dev["v"][0].is_contiguous()
    pool = HostKVPool(spec, layout, backend, dev)
    h, src, dst = pages(2, 0), torch.tensor([9, 3, 4, 5, 17, 16, 15, 14]), torch.arange(0, 8)
    pool.backup_all_layers(h, src)
    for name in "kv":
        for layer in range(L):
            assert torch.equal(host_rows(layout, pool.host_buffers[name], layer)[h], rows(dev[name][layer], src))
    want = {name: [rows(t, src) for t in dev[name]] for name in "kv"}
    pad_before, big_before = padded_v[:, 4:].clone(), big_k.clone()
    pool.load_all_layers(h, dst)
    for name in "kv":
        for layer in range(L):
            assert torch.equal(rows(dev[name][layer], dst), want[name][layer])
    assert torch.equal(as_bytes(padded_v[:, 4:]), as_bytes(pad_before))  # padding untouched
    rest = torch.arange(8, N)
    assert torch.equal(as_bytes(big_k[rest]), as_bytes(big_before[rest]))


# --- MLA device pool with separate latent / rope tensors --------------------------------------


def mla_spec(layers: int = 2) -> PoolSpec:
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=16, qk_rope_head_dim=8,
                        dtype=torch.bfloat16, page_size=4, capacity=16)


def split_device(layers: int, n: int) -> tuple[dict[str, list[Any]], list[torch.Tensor]]:
    latent = [random_(torch.empty(n, 16, dtype=torch.bfloat16), 30 + i) for i in range(layers)]
    rope = [random_(torch.empty(n, 1, 8, dtype=torch.bfloat16), 40 + i) for i in range(layers)]
    whole = [torch.cat([la, r.reshape(n, 8)], 1) for la, r in zip(latent, rope)]
    return {"latent": latent, "rope": rope}, whole


@pytest.mark.parametrize("layout,backend", TARGETS, ids=TARGET_IDS)
def test_mla_split_device_parts_into_whole_row_layout(layout: str, backend: str) -> None:
    dev, whole = split_device(2, 24)
    pool = HostKVPool(mla_spec(), layout, backend, dev)
    assert list(pool.host_buffers) == ["kv"]  # the layout keeps whole rows
    h, src, dst = pages(3, 1), torch.arange(8, 16), torch.arange(16, 24)
    pool.backup_all_layers(h, src)
    for layer in range(2):  # host row = latent || rope
        assert torch.equal(host_rows(layout, pool.host_buffers["kv"], layer)[h], rows(whole[layer], src))
    for layer in range(2):
        assert pool.load_layer(layer, h, dst)
        assert torch.equal(rows(dev["latent"][layer], dst), rows(whole[layer][:, :16], src))
        assert torch.equal(rows(dev["rope"][layer], dst), rows(whole[layer][:, 16:], src))


@pytest.mark.parametrize("backend", ["reference", "direct"])
def test_split_device_parts_into_rows_in_chunks_that_follow_each_other(backend: str) -> None:
    """A host row described as several chunks that follow each other is one contiguous row: a device that keeps
    MLA's parts apart binds to it as to the plain layout (it was refused as 'splits its rows into chunks')."""
    from fakes import chunked_rows_layout

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[Any], None]) -> None:
            register(chunked_rows_layout(4, False))

    reg = create_registry(plugins=[("chunked", Plugin())])
    dev, whole = split_device(2, 24)
    chunked = HostKVPool(mla_spec(), "layer_first_chunked", backend, dev, registry=reg, pin_memory=False)
    plain = HostKVPool(mla_spec(), "layer_first", backend, {"kv": whole}, registry=reg, pin_memory=False)
    assert [s.segment.part for s in chunked.binding.segments] == ["latent", "rope"]
    h, src = pages(0, 2, 3), torch.arange(12)
    for pool in (chunked, plain):
        pool.host_buffers["kv"].zero_()
        pool.backup_all_layers(h, src)
    assert torch.equal(as_bytes(chunked.host_buffers["kv"]), as_bytes(plain.host_buffers["kv"]))


def test_whole_row_device_tensor_wins_over_parts() -> None:
    dev, whole = split_device(2, 24)
    dev["kv"] = whole
    pool = HostKVPool(mla_spec(), "page_first", "direct", dev)
    assert [s.segment.part for s in pool.binding.segments] == [None]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_views_do_not_depend_on_device_part_split(layout: str) -> None:
    dev, whole = split_device(2, 24)
    split_pool = HostKVPool(mla_spec(), layout, "direct", dev)
    whole_pool = HostKVPool(mla_spec(), layout, "direct", {"kv": whole})
    h, src = pages(0, 1, 2, 3), torch.arange(16)
    split_pool.backup_all_layers(h, src)
    whole_pool.backup_all_layers(h, src)
    assert torch.equal(as_bytes(split_pool.host_buffers["kv"]), as_bytes(whole_pool.host_buffers["kv"]))
    base_s, base_w = split_pool.host_buffers["kv"].data_ptr(), whole_pool.host_buffers["kv"].data_ptr()
    assert [(a - base_s, n) for a, n in split_pool.page_pointers(2)] == [(a - base_w, n) for a, n in whole_pool.page_pointers(2)]
    assert torch.equal(split_pool.get_page(2), whole_pool.get_page(2))


# --- sharded pools ------------------------------------------------------------------------


@pytest.mark.parametrize("layout,backend", TARGETS, ids=TARGET_IDS)
def test_sharded_unowned_layer_returns_false_and_writes_nothing(layout: str, backend: str) -> None:
    lmap = LayerMap.sharded_cp(5, 2, 1, pad_to_largest=True)  # owns 3, 4; host slots 0, 1 (+ unused 2)
    spec = mha_spec(layer_map=lmap)
    dev = mha_device(spec, 32)
    for name in "kv":
        dev[name][0] = None  # unowned layers may be absent
    pool = HostKVPool(spec, layout, backend, dev)
    for i, t in enumerate(pool.host_buffers.values()):
        random_(t, 90 + i)
    host0 = {k: v.clone() for k, v in pool.host_buffers.items()}
    dev0 = {k: [None if t is None else t.clone() for t in v] for k, v in dev.items()}
    h, d = pages(1, 2), torch.arange(8, 16)
    for layer in (0, 1, 2):
        assert pool.backup_layer(layer, h, d) is False
        assert pool.load_layer(layer, h, torch.arange(16, 24)) is False
    for k in host0:
        assert torch.equal(as_bytes(pool.host_buffers[k]), as_bytes(host0[k]))
    for k in dev0:
        for a, b in zip(dev[k], dev0[k]):
            assert (a is None and b is None) or torch.equal(as_bytes(a), as_bytes(b))
    assert pool.backup_layer(4, h, d) is True
    for name in "kv":
        got = host_rows(layout, pool.host_buffers[name], 1)
        assert torch.equal(got[h], rows(dev[name][4], d))
        for slot in (0, 2):
            assert torch.equal(host_rows(layout, pool.host_buffers[name], slot), host_rows(layout, host0[name], slot))
    pool.backup_all_layers(h, d)
    for name in "kv":
        assert torch.equal(host_rows(layout, pool.host_buffers[name], 0)[h], rows(dev[name][3], d))
        assert torch.equal(host_rows(layout, pool.host_buffers[name], 2), host_rows(layout, host0[name], 2))


# --- validate='shapes' ---------------------------------------------------------------------


class _Recorder:
    """A test strategy (io_backend ``probe``) that records calls and moves nothing."""

    calls: list[tuple[str, torch.Tensor, torch.Tensor, int | None]] = []

    def supports(self, spec: PoolSpec, layout: Any) -> str | None:
        return None

    def prepare(self, binding: Any) -> None:
        return None

    def backup(self, binding: Any, h: torch.Tensor, d: torch.Tensor, layer: int | None) -> None:
        self.calls.append(("backup", h, d, layer))

    def load(self, binding: Any, h: torch.Tensor, d: torch.Tensor, layer: int | None) -> None:
        self.calls.append(("load", h, d, layer))


class _ProbePlugin:
    @hookimpl
    def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
        register(StrategyInfo("probe.record", "probe", (ANY_LAYOUT,), _Recorder))


def probe_pool(validate: str, device: str) -> tuple[HostKVPool, list]:
    """A pool on ``device`` (``meta`` stands in for an accelerator on CPU) served by the recorder."""
    reg = create_registry(plugins=[("probe", _ProbePlugin())])
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=4, dtype=torch.float16,
                        page_size=4, capacity=16, device=device)
    dev = {n: [torch.empty(32, 2, 4, dtype=torch.float16, device=device) for _ in range(2)] for n in "kv"}
    pool = HostKVPool(spec, "layer_first", "probe", dev, registry=reg, validate=validate)
    pool.strategy.calls = []
    return pool, pool.strategy.calls


ACCEL = "cuda" if CUDA else "meta"


@pytest.mark.parametrize("op", ["backup_all_layers", "load_all_layers", "backup_layer", "load_layer"])
def test_shapes_skips_value_checks_of_device_resident_indices(op: str) -> None:
    pool, calls = probe_pool("shapes", ACCEL)
    h = torch.arange(100, 104, device=ACCEL)  # out of range, but never read on the host
    d = torch.arange(-4, 0, device=ACCEL)
    args = (1, h, d) if op.endswith("_layer") else (h, d)
    getattr(pool, op)(*args)
    assert len(calls) == 1 and calls[0][1] is h and calls[0][2] is d


def test_shapes_still_checks_shapes_of_device_resident_indices() -> None:
    pool, calls = probe_pool("shapes", ACCEL)
    with pytest.raises(IndexLengthMismatchError, match="host_indices has 4 entries but device_indices has 8"):
        pool.backup_all_layers(torch.arange(4, device=ACCEL), torch.arange(8, device=ACCEL))
    assert calls == []


@pytest.mark.parametrize("validate", ["shapes", "full"])
def test_cpu_indices_are_always_value_checked(validate: str) -> None:
    pool, calls = probe_pool(validate, ACCEL)
    with pytest.raises(IndexRangeError, match=r"host_indices must lie in 0\.\.15 \(capacity\), got 16\.\.19"):
        pool.backup_all_layers(torch.arange(16, 20), torch.arange(4))
    with pytest.raises(IndexRangeError, match=r"device_indices must lie in 0\.\.31"):
        pool.load_layer(0, torch.arange(4), torch.arange(32, 36))
    assert calls == []


def test_shapes_checks_cpu_host_indices_next_to_device_indices() -> None:
    pool, calls = probe_pool("shapes", ACCEL)
    with pytest.raises(IndexRangeError, match=r"host_indices must lie in 0\.\.15"):
        pool.backup_all_layers(torch.arange(16, 20), torch.arange(4, device=ACCEL))
    assert calls == []


@pytest.mark.skipif(not CUDA, reason="value checks of device-resident indices need a real device")
def test_full_checks_device_resident_index_values() -> None:
    pool, calls = probe_pool("full", "cuda")
    with pytest.raises(IndexRangeError, match=r"host_indices must lie in 0\.\.15"):
        pool.backup_all_layers(torch.arange(16, 20, device="cuda"), torch.arange(4, device="cuda"))
    assert calls == []


def test_validate_mode_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_VALIDATE", "shapes")
    spec = mha_spec()
    assert HostKVPool(spec, "layer_first", "direct", mha_device(spec, 32)).validate == "shapes"
    assert HostKVPool(spec, "layer_first", "direct", mha_device(spec, 32), validate="full").validate == "full"


def test_rank_without_layers_moves_nothing() -> None:
    lmap = LayerMap.sharded_cp(2, 4, 3, pad_to_largest=True)
    assert lmap.device_layers == () and lmap.host_layer_num == 1
    spec = mha_spec(layer_map=lmap)
    pool = HostKVPool(spec, "layer_first", "direct", mha_device(spec, 32))
    pool.backup_all_layers(pages(0), torch.arange(4))
    assert pool.backup_layer(0, pages(0), torch.arange(4)) is False
    assert pool.load_layer(1, pages(0), torch.arange(4)) is False


@pytest.mark.parametrize("backend", ["direct", "reference"])
@pytest.mark.parametrize("bad", ["host", "device"])
def test_generic_backends_range_check_unvalidated_indices(backend: str, bad: str) -> None:
    """Indices that skipped the pool's value checks (validate='shapes') are still range-checked by the
    generic backends before anything moves (here CPU-resident, read at once; ``direct``'s staged route
    does not read GPU-resident device indices: tests/test_direct.py covers its masking)."""
    spec = mha_spec()
    dev = mha_device(spec, 32)
    pool = HostKVPool(spec, "layer_first", backend, dev)
    before_host = {k: v.clone() for k, v in pool.host_buffers.items()}
    before_dev = {k: [t.clone() for t in lst] for k, lst in dev.items()}
    ps = spec.page_size
    for shift in (ps, 1):  # a whole page past the end, and one slot or row past it (the last index at the bound)
        host = torch.arange(ps) + (spec.capacity - ps + shift if bad == "host" else 0)
        rows = torch.arange(ps) + (32 - ps + shift if bad == "device" else 0)
        for op in (pool.strategy.backup, pool.strategy.load):
            with pytest.raises(IndexRangeError, match="nothing was"):
                op(pool.binding, host, rows, None)
    assert all(torch.equal(pool.host_buffers[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before_host.items())
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for k in dev for a, b in zip(dev[k], before_dev[k]))


def test_same_unchanged_indices_are_validated_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-layer calls with the very same CPU index tensors check their values once."""
    import hicache_core.pool as pool_mod

    checks = []
    real = pool_mod.check_indices
    monkeypatch.setattr(pool_mod, "check_indices", lambda *a, **k: checks.append(1) or real(*a, **k))
    pool, calls = probe_pool("shapes", ACCEL)
    h, d = torch.arange(4, 8), torch.arange(8, 12)
    for layer in (0, 1, 0):
        pool.load_layer(layer, h, d)
    assert len(checks) == 1 and len(calls) == 3
    pool.load_layer(0, h.clone(), d)  # another tensor object: checked again
    assert len(checks) == 2


@pytest.mark.parametrize("which", ["host", "device"])
def test_indices_changed_in_place_are_validated_again(which: str) -> None:
    """The memo keys on the tensors' version counters: an in-place edit to a bad value is caught, nothing moves."""
    pool, calls = probe_pool("shapes", ACCEL)
    h, d = torch.arange(4, 8), torch.arange(8, 12)
    pool.load_layer(0, h, d)
    (h if which == "host" else d)[0] = 99
    with pytest.raises(IndexRangeError, match=f"{which}_indices must lie in"):
        pool.load_layer(1, h, d)
    assert len(calls) == 1


def test_inference_mode_indices_are_always_validated() -> None:
    pool, calls = probe_pool("shapes", ACCEL)
    with torch.inference_mode():
        h, d = torch.arange(4, 8), torch.arange(8, 12)
    pool.load_layer(0, h, d)
    assert pool._checked == [None, None]  # no version counter: never memoised
    with torch.inference_mode():
        h[0] = 99
    with pytest.raises(IndexRangeError):
        pool.load_layer(1, h, d)


@pytest.mark.parametrize("backend", ["direct", "reference", "kernel"])
def test_device_components_of_different_row_counts_are_bounded_by_the_shortest(backend: str) -> None:
    """``k`` layers of 32 rows and ``v`` layers of 24 (views of 32-row tensors): device rows 24.. exist for ``k`` only,
    so the pool refuses them, and a strategy handed them anyway (no pool check) writes none of ``v``'s parent rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU pool's kernel needs the interpreter)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=4, dtype=torch.float16, page_size=4,
                        capacity=16, device=device)  # k and v rows of one width: kernels move them in one launch group
    dev = {c: [random_(torch.empty(32, 2, 4, dtype=torch.float16), i + (100 if c == "v" else 0)).to(device)
               for i in range(3)] for c in ("k", "v")}
    parents = dev["v"]
    dev["v"] = [t[:24] for t in parents]
    pool = HostKVPool(spec, "layer_first", backend, dev, pin_memory=device == "cuda")
    assert pool.binding.device_rows == 24
    with pytest.raises(IndexRangeError, match=r"device_indices must lie in 0\.\.23"):
        pool.load_layer(0, pages(0), torch.arange(24, 28))
    before_v = [t.clone() for t in parents]
    try:
        pool.strategy.load(pool.binding, pages(0), torch.arange(24, 28), None)
    except IndexRangeError:
        pass  # a backend that range-checks refuses it whole; a kernel masks each buffer's rows past its own end
    if device == "cuda":
        torch.cuda.synchronize()
    for t, b in zip(parents, before_v):  # memory past v's 24 rows (its parent's) is never written
        assert torch.equal(t[24:].view(torch.uint8), b[24:].view(torch.uint8))


@pytest.mark.skipif("layer_first" not in create_registry().layouts, reason="needs the layer_first layout plugin")
def test_the_reference_backup_reads_the_device_indices_once_even_where_they_live_in_what_it_writes() -> None:
    """device_indices that alias the host slots a backup writes (contrived, but the oracle must not care): the
    reference backend copies them before its first segment, so every layer gets the rows named at the call."""
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=4, v_head_dim=2, dtype=torch.float16,
                        page_size=4, capacity=16)
    g = torch.Generator().manual_seed(0)
    dev = {"k": [torch.randn(32, 2, 4, generator=g).half() for _ in range(3)],
           "v": [torch.randn(32, 2, 2, generator=g).half() for _ in range(3)]}
    dev["k"][0][8:10].reshape(-1).view(torch.int64).copy_(torch.tensor([-1, -2, -3, -4]))  # what layer 0 copies
    pool = HostKVPool(spec, "layer_first", "reference", dev, registry=create_registry(), pin_memory=False)
    host_k = pool.host_buffers["k"]  # (3, 16, 8) fp16: 16 bytes per slot
    d = host_k[0, 4:6].reshape(-1).view(torch.int64)  # the device indices live in host k layer 0, slots 4..5
    d.copy_(torch.arange(8, 12))
    pool.backup_all_layers(torch.arange(4, 8), d)
    assert torch.equal(host_k[1, 4:8].view(4, 2, 4), dev["k"][1][8:12])  # layer 1: rows 8..11, not 31..28
    assert torch.equal(host_k[2, 4:8].view(4, 2, 4), dev["k"][2][8:12])


def test_a_key_of_the_wrong_type_is_refused_by_name() -> None:
    """A spec that is not a PoolSpec, a layout or io_backend that is not a str, a strategy that is neither None nor a
    str: each a hicache error naming the argument, what it takes and what was passed (they were raw AttributeError and
    TypeError from inside the registry)."""
    from hicache_core.errors import ResolutionError, SpecError, UnknownLayoutError

    spec = mha_spec()
    dev = mha_device(spec, 32)
    cases: list[tuple[tuple, dict, type, str]] = [
        ((None, "layer_first", "direct"), {}, SpecError, r"^spec must be a PoolSpec \(PoolSpec.mha\(...\), "
                                                         r"PoolSpec.mla\(...\) or PoolSpec\(...\)\), got NoneType None$"),
        ((spec, 3, "direct"), {}, UnknownLayoutError, r"^layout must be a str naming an installed layout \(.*"
                                                      r"layer_first.*\), got int 3$"),
        ((spec, "layer_first", None), {}, ResolutionError, r"^io_backend must be a str naming an installed io_backend "
                                                           r"\(.*direct.*\), got NoneType None$"),
        ((spec, "layer_first", "direct"), {"strategy": 5}, ResolutionError,
         r"^strategy \(the override\) must be None or a str naming a registered strategy, got int 5$"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            HostKVPool(*args, dev, **kwargs)
    reg = create_registry()
    with pytest.raises(SpecError, match=r"^spec must be a PoolSpec"):  # the registry's other public paths too
        reg.alternatives(None, "layer_first", "direct")  # type: ignore[arg-type]
    with pytest.raises(UnknownLayoutError, match=r"^layout must be a str naming an installed layout .*got list \['a'\]$"):
        reg.layout(["a"])  # type: ignore[arg-type]
    with pytest.raises(UnknownLayoutError, match=r"got int 3$"):
        reg.alternatives(spec, 3, "direct")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["reference", "direct"])
def test_device_buffers_without_rows_say_so(backend: str) -> None:
    """A pool built on device tensors of no rows refuses a transfer saying they have none (it said 'must lie in
    0..-1')."""
    spec = mha_spec()
    pool = HostKVPool(spec, "layer_first", backend, mha_device(spec, 0), pin_memory=False)
    with pytest.raises(IndexRangeError, match=r"^device_indices 0\.\.3, but the shortest device layer has no rows; "
                                              r"give the pool device tensors with rows to move$"):
        pool.load_layer(0, torch.arange(4), torch.arange(4))


def test_an_empty_call_never_reaches_the_strategy_and_is_still_checked() -> None:
    """Empty index tensors: the pool answers (True for an owned layer, False for one this rank does not own) without
    calling the strategy, after the usual checks, which still refuse a wrong dtype, shape, length or layer."""
    from hicache_core.errors import IndexDtypeError, IndexLengthMismatchError, IndexShapeError, LayerIdError

    lmap = LayerMap.sharded_cp(4, 2, 1)
    spec = mha_spec(layer_map=lmap)
    pool = HostKVPool(spec, "layer_first", "reference", mha_device(spec, 32), pin_memory=False)

    def called(*args: Any) -> None:
        raise AssertionError("the strategy was called for an empty call")
    pool.strategy.backup = pool.strategy.load = called  # type: ignore[method-assign]
    e = torch.empty(0, dtype=torch.int64)
    owned, other = lmap.device_layers[0], next(i for i in range(4) if i not in lmap.device_layers)
    assert pool.load_layer(owned, e, e) is True and pool.backup_layer(owned, e, e) is True
    assert pool.load_layer(other, e, e) is False and pool.backup_layer(other, e, e) is False
    assert pool.backup_all_layers(e, e) is None and pool.load_all_layers(e, e) is None
    for args, error in (((e.float(), e), IndexDtypeError), ((e.view(0, 4), e.view(0, 4)), IndexShapeError),
                        ((e, torch.arange(4)), IndexLengthMismatchError)):
        with pytest.raises(error):
            pool.load_all_layers(*args)
    with pytest.raises(LayerIdError):
        pool.load_layer(99, e, e)
