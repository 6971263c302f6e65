"""A calibration that measured this machine's kernel load bursts slower than usual (``kernel_load_ratio``) gives
``auto``'s copy engine the room that slowdown says on loads, and drops the lone-load rule where the kernel is well
below the copy engine's lone loads; ``explain`` says so."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from fakes import pool_device
from hicache_core import HostKVPool, LayerMap, PoolSpec
from hicache_core.backends.auto_rules import KERNEL_LOAD_USUAL, SLOW_KERNEL_ROOM, allowed_us, kernel_room
from hicache_core.backends.forward import MAX_ROOM
from hicache_core.calibration import DEFAULT, Calibration
from hicache_core.logonce import forget_logged


def _cal(ratio: float | None) -> Calibration:
    return Calibration("x", 32768, 32768, "test", kernel_load_ratio=ratio)


@pytest.mark.parametrize("ratio,room", [(None, 1.0), (KERNEL_LOAD_USUAL, 1.0), (0.95, 1.0), (1.3, 1.0),
                                        (0.42, 2.0), (0.21, 4.0), (0.05, MAX_ROOM)])
def test_kernel_room_is_the_usual_speed_over_the_measured_one(ratio, room):
    assert kernel_room(_cal(ratio)) == pytest.approx(room)
    # the room scales what a load's submission may take; backups keep theirs
    assert allowed_us(55_000, _cal(ratio), False, kernel_room(_cal(ratio))) == pytest.approx(room)
    assert allowed_us(55_000, _cal(ratio), True, kernel_room(_cal(ratio)), backup_room=1.0) == pytest.approx(1.0)
    assert kernel_room(DEFAULT) == 1.0


def _pool(tmp_path, monkeypatch, ratio, **options):
    device = pool_device("kernel")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    path = tmp_path / "cal.json"
    entry = {"d2h_min_block": 32768, "h2d_min_block": 32768}
    if ratio is not None:
        entry["kernel_load_ratio"] = ratio
    path.write_text(json.dumps({gpu: entry}))
    monkeypatch.setenv("HICACHE_CALIBRATION", str(path))
    forget_logged()
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=64, device=device)
    dev = {"kv": [torch.zeros(64, 1, 576, dtype=torch.bfloat16, device=device) for _ in range(2)]}
    return HostKVPool(spec, "layer_first", "auto", dev, strategy_options=options or None)


def test_auto_takes_the_kernel_room_from_the_calibration(tmp_path, monkeypatch, caplog):
    """0.42 of memcpy: loads get twice the usual room and no lone-load rule (said once, at INFO); ``forward="memory"``
    keeps the larger of its room and this one; ``watch`` keeps its lone loads (it times them itself); a calibration
    without the measure, or one at the usual speed, changes nothing."""
    with caplog.at_level(logging.INFO, logger="hicache_core.backends.auto"):
        st = _pool(tmp_path, monkeypatch, 0.42).strategy
    if st.kernel is None:
        pytest.skip("no kernel candidate here (Triton cannot run the layout kernel on this machine)")
    assert st.kernel_room == pytest.approx(2.0) and st.room == pytest.approx(2.0) and not st.lone
    assert not st._clocked  # no lone-load clock either (on a GPU it would be on: its lane inlines the lone rule)
    assert "kernel loads at 0.42 of memcpy" in caplog.text
    memory = _pool(tmp_path, monkeypatch, 0.42, forward="memory").strategy
    assert memory.room == pytest.approx(max(2.0, 1 / 0.45)) and not memory.lone
    slower = _pool(tmp_path, monkeypatch, 0.21, forward="memory").strategy
    assert slower.room == pytest.approx(4.0)
    watch = _pool(tmp_path, monkeypatch, 0.42, forward="watch").strategy
    assert watch.lone and watch.room >= 2.0
    mild = _pool(tmp_path, monkeypatch, 0.8).strategy  # a little slower: room, but the lone rule stays
    assert 1.0 < mild.room < SLOW_KERNEL_ROOM and mild.lone
    for ratio in (None, 0.9):
        plain = _pool(tmp_path, monkeypatch, ratio).strategy
        assert plain.kernel_room == 1.0 and plain.room == 1.0 and plain.lone


def test_an_explicit_lone_option_is_kept_and_a_pool_without_copy_engine_gets_no_room(tmp_path, monkeypatch):
    """The calibration drops the lone-load rule where it is on by default only: ``lone=True`` passed keeps it (the
    room for the rest of the loads stays), and explain says so.  Without a copy engine (no batch copy API) there is
    no decision the room could move: no room, no lone rule dropped, nothing said of it."""
    kept = _pool(tmp_path, monkeypatch, 0.42, lone=True)
    if kept.strategy.kernel is None:
        pytest.skip("no kernel candidate here (Triton cannot run the layout kernel on this machine)")
    assert kept.strategy.lone and kept.strategy.room == pytest.approx(2.0)
    text = "\n".join(kept.strategy.describe(kept.spec, kept.resolution.layout))
    assert "kernel load bursts at 0.42 of memcpy" in text and "no lone-load exception" not in text
    from hicache_core.backends.direct import DirectStrategy

    monkeypatch.setattr(DirectStrategy, "supports", lambda self, spec, layout: "no batch copy API here")
    alone = _pool(tmp_path, monkeypatch, 0.42).strategy
    assert alone.direct is None and alone.kernel is not None
    assert alone.kernel_room == 1.0 and alone.room == 1.0 and alone.lone
    pool = _pool(tmp_path, monkeypatch, 0.42)
    assert "kernel load bursts at" not in "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))


def test_explain_says_what_the_kernel_room_does(tmp_path, monkeypatch):
    st = _pool(tmp_path, monkeypatch, 0.42).strategy
    if st.kernel is None:
        pytest.skip("no kernel candidate here (Triton cannot run the layout kernel on this machine)")
    pool = _pool(tmp_path, monkeypatch, 0.42)
    text = "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))
    assert "kernel load bursts at 0.42 of memcpy" in text and "2.00x" in text and "lone loads included" in text
    assert "except a lone one-layer load" not in text and "the larger of this room" not in text
    pool = _pool(tmp_path, monkeypatch, 0.42, forward="memory")
    text = "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))
    assert "2.00x the time the rule above allows (with forward='memory', the larger of this room and forward's" in text
    pool = _pool(tmp_path, monkeypatch, None)
    text = "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))
    assert "kernel load bursts at" not in text


def test_the_kernel_measure_passes_over_a_layout_whose_kernel_key_is_in_conflict():
    """``hicache calibrate`` measures through the first layout by name whose kernel serves the pool: a layout sorted
    first whose ``kernel`` key two plugins register (unusable, DuplicateRegistrationError) is passed over, not the end
    of the measure (``kernel_load_ratio`` left out although another layout's kernel could measure the machine)."""
    from hicache_test_page_head.layout import PageHeadLayout

    from hicache_core import StrategyInfo, create_registry
    from hicache_core.backends.direct import DirectStrategy
    from hicache_core.kernel_rate import kernel_layout
    from hicache_core.testing import layouts_plugin, strategies_plugin

    class APage(PageHeadLayout):
        name = "apage"  # sorted before page_head

    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(4), head_num=2, head_dim=8, dtype=torch.float16, page_size=4,
                        capacity=16)
    env = {"HICACHE_PLUGINS": "core,page_head"}
    plugins = [(name, strategies_plugin(StrategyInfo(f"{name}.kernel", "kernel", (layout,), DirectStrategy, (False,))))
               for name, layout in (("clash_a", "apage"), ("clash_b", "apage"), ("fine", "page_head"))]
    reg = create_registry(env=env, plugins=[("apage", layouts_plugin(APage())), *plugins])
    assert [c.kind for c in reg.conflicts] == ["key"] and sorted(reg.layouts)[0] == "apage"
    assert kernel_layout(reg, spec) == "page_head"


def test_explain_says_how_the_kernel_room_meets_forward_and_when_a_load_is_lone(tmp_path, monkeypatch):
    """Beside ``forward="memory"`` the larger room applies (``AutoStrategy.room``: a max, not a product), and the
    lone-load line gives both conditions of a lone load (the 50 us gap too), as docs/io-backends.md does."""
    st = _pool(tmp_path, monkeypatch, 0.6).strategy
    if st.kernel is None:
        pytest.skip("no kernel candidate here (Triton cannot run the layout kernel on this machine)")
    pool = _pool(tmp_path, monkeypatch, 0.6, forward="memory")
    assert pool.strategy.room == pytest.approx(max(KERNEL_LOAD_USUAL / 0.6, 1 / 0.45))
    text = "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))
    assert "with forward='memory', the larger of this room and forward's applies, not their product" in text
    pool = _pool(tmp_path, monkeypatch, 0.6)
    text = "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))
    assert "kernel load bursts at 0.60" in text and "the larger of this room" not in text
    pool = _pool(tmp_path, monkeypatch, None)
    if getattr(pool.strategy.kernel, "fast_load", None) is None:
        pytest.skip("the kernel here has no fast load paths: explain names no lone-load rule")
    text = "\n".join(pool.strategy.describe(pool.spec, pool.resolution.layout))
    assert "not within 50 us of its previous call's end" in text
