"""Two context-parallel ranks, one process per GPU, NCCL: each rank moves only its shard of the layers.

An MLA model with 61 layers (odd: rank 0 owns 31, rank 1 owns 30) and one MTP
draft layer that both ranks own, 64-token pages.  Both ranks run at once
(``tests/gpu/cp_rank.py``), each backing up its shard and loading it back layer
by layer through every strategy the registry can pick, bit-exact against the
``reference`` backend; calls for layers a rank does not own return ``False``
and move nothing.  The ranks all-gather what they own: the target layers must
be partitioned exactly.  The child processes run under a hard time limit and
are killed if they exceed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hicache_core import shard_range

from gpu_support import skip_reason

WORLD, LAYERS, DRAFTS = 2, 61, 1
SCRIPT = Path(__file__).with_name("cp_rank.py")
#: Seconds for both ranks together (the ranks' own watchdogs fire 20 s earlier).
TIMEOUT_S = float(os.environ.get("HICACHE_CP_TEST_TIMEOUT", "240"))


def _why_not() -> str | None:
    why = skip_reason(WORLD)
    if why is None and not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        why = "torch.distributed with NCCL is not available in this torch build"
    return why


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run both ranks once for the module; fail (with their log tails) if either did not finish."""
    out = tmp_path_factory.mktemp("cp")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    logs = [out / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    for r in range(WORLD):
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), "--rank", str(r), "--world", str(WORLD),
                 "--rendezvous", str(out / "rendezvous"), "--out", str(out), "--timeout", str(max(10.0, TIMEOUT_S - 20))],
                stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    results = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        if timed_out or not path.exists() or procs[r].returncode != 0:
            pytest.fail(f"rank {r} did not finish (exit {procs[r].returncode}, timed out: {timed_out}); "
                        f"log tails:\n" + "\n---\n".join(_tail(log) for log in logs))
        results.append(json.loads(path.read_text()))
    for res in results:
        assert "error" not in res, f"rank {res['rank']} raised:\n{res['error']}"
    return results


def test_ranks_partition_the_target_layers_and_both_own_the_drafts(ranks):
    drafts = set(range(LAYERS, LAYERS + DRAFTS))
    targets = [set(res["owned"]) - drafts for res in ranks]
    for r, res in enumerate(ranks):
        start, end = shard_range(LAYERS, WORLD, r)
        assert targets[r] == set(range(start, end)), f"rank {r} owns {sorted(targets[r])}"
        assert drafts <= set(res["owned"]), f"rank {r} does not own the draft layers {sorted(drafts)}"
        assert res["num_device_layers"] == LAYERS + DRAFTS
    assert set().union(*targets) == set(range(LAYERS)) and sum(map(len, targets)) == LAYERS
    assert [len(t) for t in targets] == [31, 30]


def test_ranks_agree_on_what_each_owns(ranks):
    """Each rank's all-gathered view equals what every rank reported for itself."""
    own = [{k: res[k] for k in ("rank", "owned", "num_device_layers", "host_layer_num", "targets")} for res in ranks]
    for res in ranks:
        assert res["gathered"] == own, f"rank {res['rank']} gathered {res['gathered']}"
    assert own[0]["targets"] == own[1]["targets"]
    assert own[0]["host_layer_num"] == own[1]["host_layer_num"] == 31 + DRAFTS  # padded to the largest shard


def test_every_strategy_round_trips_its_shard_bit_exact(ranks):
    bad = {f"rank {res['rank']} {key} {case}": v for res in ranks for key, cases in res["round_trip"].items()
           for case, v in cases.items() if v != "ok" and not v.startswith("unserved")}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    served = {key for res in ranks for key, cases in res["round_trip"].items() if "ok" in cases.values()}
    assert any("/kernel/" in k for k in served) and any("/direct/" in k for k in served), sorted(served)


def test_layers_a_rank_does_not_own_move_nothing(ranks):
    bad = {f"rank {res['rank']} {key}": v for res in ranks for key, v in res["unowned"].items()
           if v not in ("ok", "unserved")}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    assert any(v == "ok" for res in ranks for v in res["unowned"].values())
