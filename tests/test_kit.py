"""The conformance kit itself: undeclared rejections fail, environment skips are reported, bad
selections are one usage error, and MHA-only layouts get MHA cases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hicache_core import StrategyInfo, create_registry
from hicache_core.backends.direct import DirectStrategy
from hicache_core.testing import strategies_plugin as plugin
from hicache_core.testing.conformance import CASES, classify_rejection

ENV = {"HICACHE_PLUGINS": "core,page_head,fake_vendor,layer_first"}
CASE = {c.id: c for c in CASES}


class RejectsEverything(DirectStrategy):
    def supports(self, spec, layout):  # type: ignore[no-untyped-def]
        return "refuses every pool"


class DeclaresItsRejection(RejectsEverything):
    conformance_rejects = (r"^refuses every pool$",)


def test_an_undeclared_rejection_is_a_failure_and_a_declared_one_a_skip() -> None:
    reg = create_registry(env=ENV, plugins=[("bad", plugin(
        StrategyInfo("bad.all", "nope", ("page_head",), RejectsEverything),
        StrategyInfo("bad.declared", "nope2", ("page_head",), DeclaresItsRejection)))])
    case = CASE["mha-fp16-ps1"]
    r = classify_rejection(reg, case, "page_head", "nope", "bad.all")
    assert r is not None and r.kind == "undeclared"
    assert r.reason == ("bad.all rejected mha-fp16-ps1 with a reason it does not declare: 'refuses every pool' "
                        "(list the reasons it may give in conformance_rejects on its class)")
    r = classify_rejection(reg, case, "page_head", "nope2", "bad.declared")
    assert r is not None and (r.kind, r.reason) == ("declared", "refuses every pool")
    r = classify_rejection(reg, CASE["mla576-bf16-ps1"], "page_head", "direct", "core.direct")
    assert r is not None and r.kind == "declared" and "page_head stores per-head rows of MHA pools only" in r.reason
    assert r.by_layout
    assert not classify_rejection(reg, case, "page_head", "nope2", "bad.declared").by_layout  # type: ignore[union-attr]
    assert classify_rejection(reg, case, "page_head", "direct", "core.direct") is None


def test_a_strategy_that_fails_to_load_is_a_failure_that_says_so() -> None:
    def broken() -> DirectStrategy:
        raise SyntaxError("invalid syntax (engine.py, line 3)")

    reg = create_registry(env=ENV, plugins=[("bad", plugin(StrategyInfo("bad.broken", "nope", ("page_head",), broken)))])
    r = classify_rejection(reg, CASE["mha-fp16-ps1"], "page_head", "nope", "bad.broken")
    assert r is not None and r.kind == "undeclared"
    assert r.reason == ("bad.broken failed to load: SyntaxError: invalid syntax (engine.py, line 3) (for mha-fp16-ps1); "
                        "`hicache -vv explain --layout page_head --io-backend nope` shows the traceback")


def test_a_kernel_strategy_without_gpu_or_interpreter_is_an_environment_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("kernels can run here")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reg = create_registry(env=ENV)
    r = classify_rejection(reg, CASE["mha-fp16-ps1"], "layer_first", "kernel", "layer_first.kernel")
    assert r is not None and r.kind == "environment"
    assert r.reason.startswith("Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU)")


def test_mha_only_layouts_get_as_many_cases_as_mla_ones() -> None:
    reg = create_registry(env=ENV)
    layout = reg.layout("page_head")
    served = [c.id for c in CASES if layout.check(c.build(torch.device("cpu"))) is None]
    assert len(served) >= len(CASES) // 2 and len(served) == 8


def _kit(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           "--pyargs", "hicache_core.testing", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_an_unknown_selection_is_one_usage_error() -> None:
    out = _kit("--hicache-layout", "page_lastt")
    assert out.returncode == 4
    assert "ERROR: --hicache-layout page_lastt: not installed; installed: " in out.stderr
    installed = out.stderr.split("installed: ", 1)[1].split("\n", 1)[0].split(", ")
    assert {"layer_first", "page_first", "page_first_kv_split"} <= set(installed) and installed == sorted(installed)


def test_a_case_selection_that_matches_nothing_is_a_usage_error() -> None:
    out = _kit("--hicache-io-backend", "fakedma", "--hicache-case", "heads4-shuffled")
    assert out.returncode == 4
    assert ("ERROR: --hicache-case heads4-shuffled: no case id contains it; case ids: mla576-bf16-ps1, " in out.stderr)
    assert "(the index variant in heads4-shuffled is not part of a case id: select variants with -k)" in out.stderr


def test_the_kit_sets_the_interpreter_itself_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = _kit("--hicache-layout", "layer_first", "--hicache-io-backend", "kernel", "--hicache-case",
               "mha-fp16-ps1", "-k", "load_all_layers")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout  # mha-fp16-ps1 and mha-fp16-ps128-drafts
    assert ("hicache conformance kit: no CUDA device, so it set TRITON_INTERPRET=1: kernel strategies ran in "
            "Triton's CPU interpreter") in out.stdout


# -- the kit catches what it is for: broken strategies fail it ---------------------------------------
from hicache_core.backends.reference import ReferenceStrategy  # noqa: E402
from hicache_core.testing.conformance import INDEX_VARIANTS, _place, check_strategy  # noqa: E402


class StrayByte(ReferenceStrategy):
    """Backs up right, then writes one byte into the last host page (a page the kit leaves canary)."""

    def backup(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        super().backup(binding, host_indices, device_indices, layer)
        flat = binding.segments[0].host_flat
        flat[flat.numel() - 1] ^= 0xFF


class WritesAnUnnamedSlot(ReferenceStrategy):
    """Backs up right, then flips the first byte of a host slot the call did not name (left canary by the kit)."""

    def backup(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        super().backup(binding, host_indices, device_indices, layer)
        seg, ps = binding.segments[0], binding.spec.page_size
        slot = next(s for s in range(binding.spec.capacity) if s not in set(host_indices.tolist()))
        view = seg.host_view[seg.host_layers[0], slot // ps, slot % ps]
        view.view(-1)[0] ^= 0xFF


class SkipsALayer(ReferenceStrategy):
    """An all-layer backup that leaves the last layer out."""

    def backup(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        if layer is not None:
            return super().backup(binding, host_indices, device_indices, layer)
        for one in binding.spec.layer_map.device_layers[:-1]:
            super().backup(binding, host_indices, device_indices, one)


class MisreadsInt32(ReferenceStrategy):
    """Right with int64 indices; with int32 ones it loads the first page twice instead of each page."""

    def load(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        if host_indices.dtype == torch.int32:
            ps = binding.spec.page_size
            host_indices = host_indices[:ps].repeat(host_indices.numel() // ps)
        super().load(binding, host_indices, device_indices, layer)


class WritesAStrayRow(ReferenceStrategy):
    """Loads right, then writes device row 0 (the kit's canary page) too."""

    def load(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        super().load(binding, host_indices, device_indices, layer)
        for seg, e in ((s, e) for s in binding.segments for e in s.entries(layer)):
            seg.device_rows[e][0] = seg.device_rows[e][0] ^ 0xFF


class WritesPastTheEnd(ReferenceStrategy):
    """Backs up right, then writes the byte just past each host buffer's end (an out-of-bounds write)."""

    def backup(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        super().backup(binding, host_indices, device_indices, layer)
        for seg in binding.segments:
            flat = seg.host_flat
            past = torch.empty(0, dtype=torch.uint8).set_(flat.untyped_storage(), flat.storage_offset() + flat.numel(),
                                                          (1,))
            past.fill_(0)


def _byte_at(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The byte ``offset`` bytes from the start of uint8 tensor ``t`` in its allocation (maybe outside ``t``)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), t.storage_offset() + offset,
                                                                    (1,))


class WritesPastADeviceLayer(ReferenceStrategy):
    """Loads right, then writes the byte just past each loaded device layer's last row (an out-of-bounds write)."""

    def load(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        super().load(binding, host_indices, device_indices, layer)
        for seg, e in ((s, e) for s in binding.segments for e in s.entries(layer)):
            rows = seg.device_rows[e]
            _byte_at(rows, (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]).fill_(0)


class WritesARowsPadding(ReferenceStrategy):
    """Loads right, then writes the byte after device row 0's last byte: padding in a strided pool, no row's byte."""

    def load(self, binding, host_indices, device_indices, layer):  # type: ignore[no-untyped-def]
        super().load(binding, host_indices, device_indices, layer)
        for seg, e in ((s, e) for s in binding.segments for e in s.entries(layer)):
            rows = seg.device_rows[e]
            _byte_at(rows, rows.shape[1]).fill_(0)


_OUTSIDE = r"^backup and load_layer: \d bytes around or between the device rows changed \(the first "


@pytest.mark.parametrize("broken,case,placement,message", [
    (WritesPastADeviceLayer, "mha-fp16-ps1", "separate",
     _OUTSIDE + r"1 byte\(s\) past its last row's end, of (k|v)\[layer 0\]\): the strategy wrote out of bounds$"),
    (WritesARowsPadding, "mla576-bf16-ps16-strided", "separate",
     _OUTSIDE + r"byte 576 from its first row's start, in a row's padding, of kv\[layer 0\]\)"),
    # layers one after another in one allocation: the byte past layer 0's last row lies just before layer 1's first
    (WritesPastADeviceLayer, "mla576-bf16-ps16-strided", "one-allocation",
     _OUTSIDE + r"1 byte\(s\) past its last row's end, of kv\[layer 0\]\)"),
], ids=["past-a-device-layer", "into-a-rows-padding", "past-a-layer-in-one-allocation"])
def test_the_kit_fails_a_strategy_that_writes_outside_the_device_rows(broken, case, placement, message) -> None:
    """Device rows sit between guard bytes and a strided pool's padding holds them too: a write there fails the kit
    (it was caught only where it landed on rows the kit compares), naming the layer whose rows it is nearest."""
    reg = create_registry(env=ENV, plugins=[("broken", plugin(StrategyInfo("broken.x", "broken", ("*",), broken)))])
    with pytest.raises(AssertionError, match=message):
        check_strategy(reg, CASE[case], "layer_first", "broken", strategy="broken.x", placement=placement)
    check_strategy(reg, CASE[case], "layer_first", "reference", strategy="core.reference", placement=placement)


@pytest.mark.parametrize("broken,variant,message", [
    (StrayByte, "shuffled-i64", "backup: host buffer"),
    (WritesAnUnnamedSlot, "shuffled-i64", r"backup: host buffer .*: 0x5a where the reference has 0xa5 \(the reference "
                                          r"left the canary there: likely a host slot the call did not name was "
                                          r"written\)$"),
    (SkipsALayer, "shuffled-i64", r"backup: host buffer 'k' differs from the reference at .*: byte \d+ is 'k' of host "
                                  r"layer 2, page \d+, slot 0, row byte 0: 0xa5 where the reference has 0x[0-9a-f]{2} "
                                  r"\(the canary: likely never written\)$"),
    (MisreadsInt32, "shuffled-i32", "load_layer: "),
    (WritesAStrayRow, "shuffled-i64", r"^load_layer: (k|v)\[layer 0\] differs from the reference at rows \[0\] \(row "
                                      r"\[0\] not among the call's device_indices: the strategy wrote device rows it "
                                      r"was not given\)$"),
    (WritesPastTheEnd, "shuffled-i64", r"^backup: 1 bytes after host buffer '(k|v)' changed \(the nearest 1 byte\(s\) "
                                        r"past its end\): the strategy wrote out of bounds$"),
], ids=["stray-host-byte", "unnamed-host-slot", "skipped-layer", "int32-misread", "stray-device-row", "past-the-end"])
def test_the_kit_fails_a_broken_strategy(broken, variant, message) -> None:
    reg = create_registry(env=ENV, plugins=[("broken", plugin(StrategyInfo("broken.x", "broken", ("*",), broken)))])
    case = CASE["mha-fp16-ps1"]
    with pytest.raises(AssertionError, match=message):
        check_strategy(reg, case, "layer_first", "broken", strategy="broken.x", variant=variant)
    if variant == "shuffled-i32":  # the same strategy with int64 indices passes: the variant is what caught it
        check_strategy(reg, case, "layer_first", "broken", strategy="broken.x", variant="shuffled-i64")


class ClaimsUnownedLayers(ReferenceStrategy):
    """Moves every row right, but its lane answers True for layers this rank does not own (the pool then returns True
    from backup_layer/load_layer for them)."""

    def lane(self, binding, to_host):  # type: ignore[no-untyped-def]
        return lambda layer, h, d: layer is not None and not binding.spec.layer_map.owns(layer)


@pytest.mark.parametrize("per_layer_backup,call", [(True, "backup_layer"), (False, "load_layer")])
def test_the_kit_names_a_wrong_answer_of_a_per_layer_call(per_layer_backup, call) -> None:
    """backup_layer/load_layer must answer False for a layer the rank does not own: the kit says which call, which
    layer and what it returned (it was a bare AssertionError)."""
    reg = create_registry(env=ENV, plugins=[("liar", plugin(StrategyInfo("liar.x", "liar", ("*",), ClaimsUnownedLayers,
                                                                         sharded=(False, True))))])
    case = CASE["mha-fp16-ps4-sharded4of2r0-drafts"]
    spec = case.build(torch.device("cpu"))
    unowned = next(i for i in range(spec.layer_map.num_device_layers) if not spec.layer_map.owns(i))
    with pytest.raises(AssertionError, match=rf"^{call}\(layer {unowned}\) returned True, expected False \(this rank "
                                             r"does not own it.*lane\(\) returned True"):
        check_strategy(reg, case, "layer_first", "liar", strategy="liar.x", per_layer_backup=per_layer_backup)


def test_index_variants_are_placed_as_named() -> None:
    """Each variant's indices have the dtype, device and memory shape its name says (the kit's coverage rests on it)."""
    spec = CASE["mha-fp16-ps1"].build(torch.device("cpu"))
    t = torch.arange(8)
    for variant in INDEX_VARIANTS:
        got = _place(t, variant, spec)
        assert got.dtype == (torch.int32 if "i32" in variant else torch.int64), variant
        assert got.device == (spec.device if variant.endswith("-dev") else torch.device("cpu")), variant
        assert got.is_contiguous() is ("strided-view" not in variant), variant
        assert torch.equal(got.long(), t), variant


def test_the_kit_names_a_layout_plan_that_addresses_a_byte_twice() -> None:
    """A plan whose layer stride forgets the V part (layer l+1's K lands on layer l's V) fails the kit at once, with
    the layout and the buffer named, before any transfer's bytes are compared."""
    from hicache_core import Addressing, BufferSpec, HostPlan, Segment, hookimpl

    class Overlapping:
        name, description = "overlapping", "K and V of a page-major buffer, the layer stride one part short"

        def check(self, spec):  # type: ignore[no-untyped-def]
            return None if spec.kind == "mha" else "MHA only"

        def plan(self, spec):  # type: ignore[no-untyped-def]
            k, v = spec.component("k").row_bytes, spec.component("v").row_bytes
            layers, ps = spec.layer_map.host_layer_num, spec.page_size
            page = layers * ps * (k + v)
            buf = BufferSpec("pages", (spec.num_pages, page), torch.uint8)
            return HostPlan((buf,), (Segment("pages", "k", None, 0, k, Addressing(0, ps * k, page, k, k)),
                                     Segment("pages", "v", None, 0, v, Addressing(ps * k, ps * k, page, v, v))))

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(Overlapping())

    reg = create_registry(env=ENV, plugins=[("overlapping", Plugin())])
    with pytest.raises(AssertionError, match=r"layout 'overlapping' plan: \d+ bytes of host buffer 'pages' are "
                                             r"addressed by two row bytes \(first at byte \d+: 'k' of host layer 1, "
                                             r"page 0, slot 0, row byte 0 and 'v' of host layer 0, page 0, slot 0, row "
                                             r"byte 0\)"):
        check_strategy(reg, CASE["mha-fp16-ps1"], "overlapping", "reference", strategy="core.reference")


class TouchesTheCanaryPage(DirectStrategy):
    """Moves the right rows, and also writes device row 0 (the kit's canary page) on loads."""

    def transfer(self, binding, host_indices, device_indices, layer, *, to_host):  # type: ignore[no-untyped-def]
        super().transfer(binding, host_indices, device_indices, layer, to_host=to_host)
        if not to_host:
            for seg in binding.segments:
                for rows in seg.device_rows:
                    rows[0].add_(1)


class TouchesAHostCanary(DirectStrategy):
    """Moves the right rows, and also flips the last host byte (not one of the rows it was asked to move) on backups."""

    def transfer(self, binding, host_indices, device_indices, layer, *, to_host):  # type: ignore[no-untyped-def]
        super().transfer(binding, host_indices, device_indices, layer, to_host=to_host)
        if to_host:
            buf = next(iter(binding.host_buffers.values())).view(torch.uint8).view(-1)
            buf[-1] = buf[-1] ^ 0xFF


def test_the_kit_fails_a_strategy_that_writes_outside_its_rows() -> None:
    """The kit's own oracle can fail: a strategy that moves every row right but also writes a device canary row or a
    host canary byte is caught (and the control, plain direct, passes the same checks)."""
    from hicache_core.testing.conformance import check_load_all, check_strategy

    reg = create_registry(env=ENV, plugins=[("sloppy", plugin(
        StrategyInfo("sloppy.device", "sloppy_dev", ("page_head",), TouchesTheCanaryPage),
        StrategyInfo("sloppy.host", "sloppy_host", ("page_head",), TouchesAHostCanary)))])
    case = CASE["mha-fp16-ps1"]
    check_load_all(reg, case, "page_head", "direct")
    check_strategy(reg, case, "page_head", "direct")
    with pytest.raises(AssertionError, match="canary page"):
        check_load_all(reg, case, "page_head", "sloppy_dev")
    with pytest.raises(AssertionError, match="backup: host buffer"):
        check_strategy(reg, case, "page_head", "sloppy_host")


@pytest.mark.skipif("layer_first" not in create_registry().layouts, reason="needs the layer_first layout plugin")
def test_the_kit_checks_the_plan_addresses_not_only_agreement_with_the_reference(monkeypatch) -> None:
    """Every backend shares the binding, so a binding that misplaces rows the same way for all of them (here host
    layers swapped) passes a comparison with the reference and a round trip; the kit also checks where the plan's
    addressing puts each row byte."""
    from dataclasses import replace

    from hicache_core import binding as binding_mod
    from hicache_core.testing.conformance import check_strategy

    real = binding_mod._bind_segment

    def swapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        seg = real(*args, **kwargs)
        return replace(seg, host_layers=tuple(reversed(seg.host_layers)))

    reg = create_registry()
    case = CASE["mla576-bf16-ps1"]
    check_strategy(reg, case, "layer_first", "direct")
    monkeypatch.setattr(binding_mod, "_bind_segment", swapped)
    with pytest.raises(AssertionError, match="is not where the plan's addressing puts it"):
        check_strategy(reg, case, "layer_first", "direct")


def test_cases_outside_a_strategys_registration_are_counted_and_reported(monkeypatch) -> None:
    """A strategy registered for unsharded pools only: its sharded cases are skipped (the registration declares it),
    but counted, and the run's summary says they were not tested and how to register them, so a forgotten
    ``sharded=(False, True)`` does not pass silently."""
    from hicache_core.testing import plugin as kit_plugin
    from hicache_core.testing import test_conformance

    monkeypatch.setattr(kit_plugin, "_UNREGISTERED_SKIPS", type(kit_plugin._UNREGISTERED_SKIPS)())
    reg = create_registry(env=ENV, plugins=[("unsharded", plugin(StrategyInfo("t.flat", "flat", ("layer_first",),
                                                                               DirectStrategy, (False,))))])
    cases = [c for c in CASES if c.build(torch.device("cpu")).sharded][:2] + [
        next(c for c in CASES if not c.build(torch.device("cpu")).sharded)]
    served = []
    for case in cases:
        try:
            test_conformance._run(lambda *a, **k: served.append(case.id), reg, case,
                                  ("layer_first", "flat", "t.flat"), "cpu")
        except pytest.skip.Exception as skip:
            assert "not a candidate for this key" in str(skip)
    assert served == [cases[2].id]
    assert dict(kit_plugin._UNREGISTERED_SKIPS) == {("t.flat", "sharded"): 2}
    lines = []

    class Reporter:
        def write_line(self, line: str, **markup: bool) -> None:
            lines.append(line)

    kit_plugin.pytest_terminal_summary(Reporter())
    assert ("hicache conformance kit: t.flat registers no key for sharded pools: its 2 sharded cases were skipped, "
            "not tested (where it serves them, add True to its registration's sharded)") in lines
