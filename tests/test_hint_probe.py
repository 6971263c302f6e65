"""benchmarks/backup_hint_probe.py: its kernel moves every row bit-exact, canaries untouched, under each hint and
launch shape (on CPU in Triton's interpreter, where the fence variants, inline PTX, cannot run), and its check
catches a backup that moves nothing.  On the GPU the probe checks each variant again before timing it."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

import pytest

from triton.runtime import interpreter as _interp

from benchmarks import backup_hint_probe as probe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Variants that move rows (the floors move none to check); on CPU those without the fence or PDL (inline PTX).
LABELS = [label for label in probe.VARIANTS
          if probe.variant(label)["kind"] == "rows"
          and (DEVICE == "cuda" or not (probe.variant(label)["fence"] or probe.variant(label)["pdl"]))]
FLOORS = [label for label in probe.VARIANTS if probe.variant(label)["kind"] != "rows"]


@pytest.mark.parametrize("shape", list(probe.SHAPES))
@pytest.mark.parametrize("label", LABELS)
def test_variant_bit_exact(shape: str, label: str) -> None:
    wl = probe.Workload(shape, tokens=64, page_size=16, device=DEVICE, entries=3)
    wl.check(probe.variant(label))


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launches: inline PTX for sm_90 and later, CUDA launches")
@pytest.mark.parametrize("label", [label for label in probe.VARIANTS if probe.variant(label)["pdl"]])
def test_dependent_launches_move_every_row(label: str) -> None:
    """Launches of a few entries that overlap at their ends (each after a backup's first made with PDL): every entry's
    rows land, canaries untouched, over several launches (the check above has too few entries for a second one)."""
    wl = probe.Workload("mha", tokens=128, page_size=16, device=DEVICE, entries=19)
    assert -(-wl.entries // probe.variant(label)["launch_entries"]) >= 3
    for _ in range(3):
        wl.check(probe.variant(label))


def test_check_catches_a_missed_backup(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = probe.Workload("mla", tokens=32, page_size=16, device=DEVICE, entries=2)
    monkeypatch.setattr(wl, "launch", lambda v: None)
    with pytest.raises(AssertionError, match="differ"):
        wl.check(probe.variant("base"))


@pytest.mark.skipif(DEVICE != "cuda", reason="HOLD reads the GPU's global timer (inline PTX)")
@pytest.mark.parametrize("label", FLOORS)
def test_floor_runs_without_touching_the_rows(label: str) -> None:
    """A floor leaves the device rows and the host as they were; ``hold`` keeps each program busy at least as long as
    asked, per launch (the word it writes per program)."""
    wl = probe.Workload("mla", tokens=64, page_size=16, device=DEVICE, entries=3)
    dev, host = wl.dev.clone(), wl.host.clone()
    v = probe.variant(label)
    wl.launch(v, hold_ns=200_000)
    torch.cuda.synchronize()
    assert torch.equal(wl.dev, dev) and torch.equal(wl.host, host)
    if v["kind"] == "hold":  # the last launch's time per program: a chunk, or the whole hold
        held = wl.held[: v["programs"]].cpu()
        assert bool((held >= (v["hold_us"] * 1000 or 200_000)).all()), held
        assert not bool(wl.held[v["programs"]:].any())


def test_variants_differ_from_base_in_named_fields_only() -> None:
    assert probe.variant("base") == probe.BASE
    for label, fields in probe.VARIANTS.items():
        assert set(fields) <= set(probe.BASE), label
    with pytest.raises(KeyError):
        probe.variant("no such variant")


_PTX = r"""
import json, sys
sys.path.insert(0, "dev")
from ptx_diff import compile_kernel
from benchmarks import backup_hint_probe as probe

out = {}
for label in probe.VARIANTS:
    v = probe.variant(label)
    if v["kind"] != "rows":
        continue
    consts = dict(WIDTH=288, BLOCK=512, TOKENS=16, VEC=4, LD_CM=v["ld_cm"], LD_EV=v["ld_ev"], ST_CM=v["st_cm"],
                  ST_EV=v["st_ev"], FENCE=v["fence"], PDL=2 if v["pdl"] else 0)
    types = {"anchor": "*i32", "host_idx": "*i64", "dev_idx": "*i64", "dev_base": "i64", "dev_ent": "i64",
             "host_base": "i64", "host_ent": "i64"}
    for key, pdl in ((label, consts["PDL"]),) + (((label + " | last launch", 1),) if v["pdl"] else ()):
        ptx = compile_kernel(probe.HINT_BACKUP, {**consts, "PDL": pdl}, warps=v["warps"], types=types).asm["ptx"]
        words = [line.split() for line in ptx.splitlines() if line.strip()]
        ops = {w[1] if w[0].startswith("@") and len(w) > 1 else w[0] for w in words}  # past a predicate
        out[key] = sorted(op for op in ops if op.startswith(("ld.global", "st.global", "fence", "griddepcontrol")))
ptx = compile_kernel(probe.HOLD, {}, warps=4, types={"out": "*i32", "ns": "i64"}).asm["ptx"]
words = [line.split() for line in ptx.splitlines() if line.strip()]
ops = {w[1] if w[0].startswith("@") and len(w) > 1 else w[0] for w in words}
out["HOLD"] = sorted({op for op in ops if op.startswith(("ld.global", "st.global", "fence"))}
                     | {"globaltimer" for w in words if "%globaltimer" in " ".join(w)})
print(json.dumps(out))
"""


def test_hints_reach_the_ptx(tmp_path: Path) -> None:
    """Each variant's hints are in its kernel's PTX for sm_90 (a hint Triton dropped would make its A/B time the base
    kernel under another name): the row stores of ``st .cs`` are ``st.global.cs``, the fence variants fence, the PDL
    variants signal their dependents and wait for the launch before (no other variant does); compiled for a backup's
    last launch (``PDL`` 1) they wait only."""
    from fakes import compiled_json

    ops = compiled_json(_PTX, tmp_path)
    assert ops.pop("HOLD") == ["globaltimer", "st.global.b32"], "HOLD reads the timer and stores one word, no more"
    lasts = {k: ops.pop(k) for k in [k for k in ops if k.endswith(" | last launch")]}
    assert len(lasts) == len(PDL_LABELS)
    for key, found in lasts.items():  # a backup's last launch (PDL 1) waits for the one before and signals nothing
        assert [op for op in found if op.startswith("griddepcontrol")] == ["griddepcontrol.wait;"], (key, found)
    for label, found in ops.items():
        v = probe.variant(label)
        want = {f"st.global{v['st_cm']}" + (".L1::evict_first" if v["st_ev"] else ""),
                f"ld.global{v['ld_cm']}" + (".L1::evict_first" if v["ld_ev"] else "")}
        rows = {op for op in found if op.startswith(("st.global", "ld.global")) and not op.startswith("ld.global.b64")}
        assert {op.rsplit(".", 1)[0].replace(".L2::cache_hint", "") for op in rows} == want, (label, found)
        assert [op for op in found if op.startswith("fence")] == ([f"fence.sc.{v['fence']};"] if v["fence"] else []), (
            label, found)
        assert [op for op in found if op.startswith("griddepcontrol")] == (
            ["griddepcontrol.launch_dependents;", "griddepcontrol.wait;"] if v["pdl"] else []), (label, found)


PDL_LABELS = [label for label in probe.VARIANTS if probe.variant(label)["pdl"]]


@pytest.mark.parametrize("entries", [19, 16], ids=["last-launch-short", "even-split"])
@pytest.mark.parametrize("label", PDL_LABELS)
def test_pdl_variants_first_launch_plain_rest_dependent(label, entries, monkeypatch):
    """Each backup's first launch plain (``launch_pdl`` False), every later one dependent; every launch but the last
    compiled to signal its dependents (``PDL`` 2), the last to wait only (1); the launches' entries cover the backup
    once, in order."""
    calls = []

    class _Rec:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))
    monkeypatch.setattr(probe, "HINT_BACKUP", _Rec())
    wl = probe.Workload("mha", tokens=32, page_size=16, device="cpu", entries=entries)
    v = probe.variant(label)
    for _ in range(2):  # two backups back to back: each starts with a plain launch
        calls.clear()
        wl.launch(v)
        step = v["launch_entries"]
        assert len(calls) >= 2 and (entries % step == 0) == (entries == 16)  # 16: every launch full, the last too
        assert [kw["launch_pdl"] for _, _, kw in calls] == [False] + [True] * (len(calls) - 1)
        assert [kw["PDL"] for _, _, kw in calls] == [2] * (len(calls) - 1) + [1]
        assert [a[4] for _, a, _ in calls] == [min(step, entries - e0) for e0 in range(0, entries, step)]
        assert [a[5] for _, a, _ in calls] == [e0 * wl.dev.stride(0) for e0 in range(0, entries, step)]


@pytest.mark.parametrize("label", PDL_LABELS)
@pytest.mark.parametrize("more", [0, -1, -3], ids=["entries-per-launch", "one-fewer", "few"])
def test_pdl_variants_backup_in_one_launch_is_a_plain_call(label, more, monkeypatch):
    """A backup of no more entries than a launch takes (``launch_entries`` >= entries) is one plain launch, as the
    plugins' call in one launch (``PDL_OFF``): ``PDL`` 0 (the kernel's default), no ``launch_pdl``; it neither
    signals a launch that is not its own nor waits."""
    default = inspect.signature(probe.HINT_BACKUP.fn).parameters["PDL"].default
    calls = []

    class _Rec:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))
    monkeypatch.setattr(probe, "HINT_BACKUP", _Rec())
    v = probe.variant(label)
    entries = v["launch_entries"] + more
    wl = probe.Workload("mha", tokens=32, page_size=16, device="cpu", entries=entries)
    wl.launch(v)
    assert len(calls) == 1 and calls[0][1][4] == entries, calls
    kw = calls[0][2]
    assert not kw.get("launch_pdl", False) and kw.get("PDL", 0) == 0 and type(kw.get("PDL", 0)) is int, kw
    assert default == 0 and type(default) is int, default  # a kernel left without PDL compiles as PDL 0


@pytest.mark.skipif(DEVICE != "cpu" or not hasattr(_interp.InterpreterBuilder, "create_inline_asm"),
                    reason="Triton's interpreter, its inline-PTX hook recorded (CPU hosts)")
@pytest.mark.parametrize("tokens, programs", [(16, 8), (48, 8), (128, 8), (64, 3)],
                         ids=["zero-item-programs", "uneven", "even", "few-programs"])
def test_pdl_each_program_signals_at_its_last_item_and_waits_at_its_end(tokens, programs, monkeypatch):
    """Under the interpreter, inline PTX recorded per program with the stores issued so far: a program with items
    signals ``launch_dependents`` exactly once, before its last item's stores and after all others, in every launch but
    the backup's last, which never signals; one without items never signals; every program waits once, after all its
    stores. The rows still land."""
    interp = _interp
    log = []  # (program, asm or "store")

    def asm(self, inline_asm, constraints, values, types, is_pure, pack):  # noqa: ARG001
        log.append((self.grid_idx[0], inline_asm.split(";")[0]))
        out = interp.TensorHandle(values[0].data.copy(), values[0].dtype)
        return type("_Call", (), {"get_result": lambda self_, i: out})()
    real_store = interp.InterpreterBuilder.create_masked_store

    def store(self, ptrs, value, mask, cache_policy):
        log.append((self.grid_idx[0], "store"))
        return real_store(self, ptrs, value, mask, cache_policy)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_inline_asm", asm)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", store)
    # fence on the CPU would be inline PTX too: recorded, harmless; launch_pdl is a compile option, not a kernel arg
    v = {**probe.variant("fence gpu 4 entries per launch pdl"), "programs": programs}
    wl = probe.Workload("mha", tokens=tokens, page_size=16, device="cpu", entries=7)
    block, _, tile_tokens = probe.tile(wl.words, wl.words, probe.WORD, v["tile_bytes"])
    n_tiles = -(-tokens // tile_tokens)
    real_jit = probe.HINT_BACKUP

    launches_seen = []

    class _Split:  # one log segment per launch
        def __getitem__(self, grid):
            def go(*a, **kw):
                kw.pop("launch_pdl", None)
                launches_seen.append((len(log), a[4]))
                return real_jit[grid](*a, **kw)
            return go
    monkeypatch.setattr(probe, "HINT_BACKUP", _Split())
    wl.check(v)
    launches_seen.append((len(log), None))
    assert len(launches_seen) == 3  # 4 + 3 entries
    for k, ((start, n_ents), (end, _)) in enumerate(zip(launches_seen, launches_seen[1:])):
        seg = log[start:end]
        last = k == len(launches_seen) - 2
        items = n_tiles * n_ents
        for p in range(programs):
            mine = [what for q, what in seg if q == p]
            mine_items = len(range(p, items, programs))
            assert mine.count("griddepcontrol.wait") == 1 and mine[-1] == "griddepcontrol.wait", (p, mine)
            if mine_items == 0 or last:
                assert "griddepcontrol.launch_dependents" not in mine, (p, mine)
            if mine_items == 0:
                assert "store" not in mine, (p, mine)
                continue
            if last:
                assert mine.count("fence.sc.gpu") == mine_items and "store" in mine, (p, mine)
                continue
            assert mine.count("griddepcontrol.launch_dependents") == 1, (p, mine)
            # items are separated by the fence (tile_done): the signal starts the last item's segment
            fences = [i for i, w in enumerate(mine) if w == "fence.sc.gpu"]
            assert len(fences) == mine_items, (p, mine)
            sig = mine.index("griddepcontrol.launch_dependents")
            before_last = fences[-2] if mine_items > 1 else -1
            assert before_last < sig and all(w != "store" for w in mine[before_last + 1:sig]), (p, mine)
            assert "store" in mine[sig:fences[-1]], (p, mine)
