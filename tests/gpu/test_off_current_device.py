"""Pools on a device that is not the current one: every strategy runs on the pool's device and stream.

``cuda:0`` is the current device and the pool lives on ``cuda:1``.  Without a
device guard a Triton launch goes to device 0 (where it faults or moves bytes
out of order) and a copy may be enqueued on the wrong stream.  Parametrised over
every strategy the registry can pick (``reference`` aside), so a newly
registered backend is covered without editing this file.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hicache_core import create_registry
from hicache_core.testing.conformance import CASES, check_load_all, check_strategy

from gpu_support import gated_round_trip, resolve_or_skip, skip_reason, strategy_targets

two_gpus = pytest.mark.skipif(skip_reason(2) is not None, reason=skip_reason(2) or "")

POOL, CURRENT = 1, 0
TARGETS = strategy_targets(create_registry())
#: An MLA pool (sharded rank 1 of 2, odd layer count, padded host, a draft layer) and a strided MHA pool.
CASE_IDS = ("mla576-bf16-ps4-sharded5of2r1-padded-drafts", "mha-bf16-ps16-vdim-strided")
SELECTED = [c for c in CASES if c.id in CASE_IDS]
target = pytest.mark.parametrize("target", TARGETS, ids=["-".join(t) for t in TARGETS])
case = pytest.mark.parametrize("case", SELECTED, ids=[c.id for c in SELECTED])


@pytest.fixture
def reg():
    torch.cuda.set_device(CURRENT)
    yield create_registry()
    torch.cuda.set_device(CURRENT)


def _skip_unserved(reg, case, target):
    layout, backend, name = target
    resolve_or_skip(reg, case.build(torch.device("cuda", POOL)), layout, backend, name)


def test_cases_are_in_the_kit():
    assert [c.id for c in SELECTED] == list(CASE_IDS)


@two_gpus
@target
@case
@pytest.mark.parametrize("variant", ["shuffled-i64", "reversed-i64-dev"])
def test_round_trip_bit_exact(reg, case, target, variant):
    """Backup all layers, load layer by layer into other slots: identical to ``reference``, canaries intact."""
    _skip_unserved(reg, case, target)
    layout, backend, name = target
    check_strategy(reg, case, layout, backend, variant=variant, device=f"cuda:{POOL}", strategy=name)
    assert torch.cuda.current_device() == CURRENT


@two_gpus
@target
@case
def test_per_layer_backup_and_load_all(reg, case, target):
    _skip_unserved(reg, case, target)
    layout, backend, name = target
    check_strategy(reg, case, layout, backend, device=f"cuda:{POOL}", strategy=name, per_layer_backup=True)
    check_load_all(reg, case, layout, backend, device=f"cuda:{POOL}", strategy=name)
    assert torch.cuda.current_device() == CURRENT


@two_gpus
@target
@case
def test_work_waits_on_pool_device_current_stream(reg, case, target):
    """A non-default stream is current on the pool's device and held by a gate: nothing moves until it opens."""
    _skip_unserved(reg, case, target)
    gated_round_trip(reg, case, *target, pool_device=POOL, current=CURRENT)


_UNGUARDED = """
import sys
sys.path.insert(0, {here!r})
import torch
from hicache_core import create_registry
from hicache_core.testing.conformance import CASES
import gpu_support as g
reg = create_registry()
case = next(c for c in CASES if c.id == {case!r})
reg.try_resolve(case.build(torch.device("cuda", 1)), {layout!r}, "kernel", override={name!r})  # imports the module
print("patched", g.remove_guards(), flush=True)
try:
    g.gated_round_trip(reg, case, {layout!r}, "kernel", {name!r})
except BaseException as exc:
    print("DETECTED", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", flush=True)
else:
    print("MISSED", flush=True)
"""


@two_gpus
def test_a_missing_guard_is_detected():
    """The gated check fails for a kernel strategy whose device guard is removed (in a child process:
    a launch on the wrong device may fault and poison that device for the rest of the process)."""
    reg = create_registry()
    spec = SELECTED[0].build(torch.device("cuda", POOL))
    kernels = [t for t in TARGETS if t[1] == "kernel" and reg.try_resolve(spec, t[0], "kernel", override=t[2])[0]]
    if not kernels:
        pytest.skip("no kernel strategy serves the MLA case")
    layout, _, name = kernels[0]
    code = _UNGUARDED.format(here=os.path.dirname(__file__), case=SELECTED[0].id, layout=layout, name=name)
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the unguarded run did not finish in 180 s; output: {exc.stdout!r} {exc.stderr!r}")
    lines = run.stdout.splitlines()
    assert lines and lines[0].startswith("patched ") and int(lines[0].split()[1]) > 0, run.stdout + run.stderr[-2000:]
    detected = [line for line in lines if line.startswith("DETECTED")]
    assert detected, run.stdout + run.stderr[-2000:]
    # caught by the byte checks, or by the device: a fault, or Triton refusing a foreign pointer
    assert (detected[0].startswith("DETECTED AssertionError")
            or any(w in detected[0] for w in ("illegal", "CUDA", "Pointer argument"))), detected[0]
