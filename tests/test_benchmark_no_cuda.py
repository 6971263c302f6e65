"""The GPU benchmark scripts without CUDA (CPU; CUDA hidden from each run): one line on stderr naming the script
and where to read how to run it on a GPU machine, exit status 2, no traceback, nothing written; ``--help`` works.

Each script runs as the docs run it (``python benchmarks/SCRIPT.py``: ``runpy`` as ``__main__``, its folder first on
``sys.path``), all of them one after another in one process with ``CUDA_VISIBLE_DEVICES`` empty, so that this holds on
a GPU machine too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: Scripts that need a CUDA GPU, with the arguments they require (``{out}``: a folder that must stay empty).
GPU_SCRIPTS = {
    "ce2d_probe": [], "ce_host_probe": [], "ce_probe": [], "chunk_streams_probe": [], "first_call": [],
    "backup_hint_probe": [], "backup_place_probe": [], "flat_rows_probe": [], "fresh_indices": [], "gate_probe": [], "host_time": [],
    "knob_ab": ["--out", "{out}/knob", "--knob", "hicache_core.backends.memcpy:TIGHT_GAP_US", "--values", "1"],
    "launch_cost": [], "launch_floor": [], "lone_load_probe": [], "lone_probe": ["--out", "{out}/lone.json"],
    "pace_probe": ["--out", "{out}/pace"], "head_cost": ["--out", "{out}/head"], "pace_trace": ["--out", "{out}/trace"], "parallel_submit_probe": [],
    "peers": [], "profile_kernel": [], "row_pieces_probe": [], "sched_stall": [], "stage_probe": [],
    "staged_timeline": [], "tma_flat_probe": [], "tma_load_probe": [], "tma_span_probe": [], "tune_tiles": [],
    "two_gpu": [], "watch_cost": [],
}
#: Scripts that run on a CPU (or read files), and modules other scripts import.
CPU_OR_LIBRARY = {"lane_cost", "decision_cost", "pace_bins", "stress", "tables", "needs_cuda", "peer_check", "peer_lmcache",
                  "peer_sglang", "peer_table", "auto_gaps"}


#: Runs each script as ``python benchmarks/SCRIPT.py ARGS`` would (``__main__``, its folder first on ``sys.path``), one
#: after another in this one process (one torch import for all: a process per run took minutes on a busy machine),
#: and prints {"name mode": [exit status, stdout, stderr]} as JSON.
DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
jobs, folder = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for key, argv in jobs.items():
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = argv, [folder]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = -1
    sys.argv, sys.path[:] = saved_argv, saved_path
    results[key] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each script run plainly and with ``--help``, in one process that sees no CUDA device."""
    cwd = tmp_path_factory.mktemp("cwd")
    out = tmp_path_factory.mktemp("out")
    jobs = {f"{name} {mode}": [str(BENCHMARKS / f"{name}.py"),
                               *(["--help"] if mode == "help" else [a.format(out=out) for a in args])]
            for name, args in GPU_SCRIPTS.items() for mode in ("plain", "help")}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(jobs), str(BENCHMARKS)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    done = {tuple(key.split(" ")): subprocess.CompletedProcess(jobs[key], code, stdout, stderr)
            for key, (code, stdout, stderr) in json.loads(res.stdout.splitlines()[-1]).items()}
    return done, out, cwd


def test_every_script_is_classified():
    """A new script in benchmarks/ is either a GPU one (and tested here) or listed as running without one."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert scripts == set(GPU_SCRIPTS) | CPU_OR_LIBRARY


@pytest.mark.parametrize("name", sorted(GPU_SCRIPTS))
def test_without_cuda_the_script_says_so_in_one_line_and_exits_2(runs, name):
    done, _, _ = runs
    res = done[(name, "plain")]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert res.stderr == (f"{name}.py: needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False); "
                          'see docs/contributing.md ("On a GPU machine") for running the benchmarks on one\n')
    assert res.stdout == ""


@pytest.mark.parametrize("name", sorted(GPU_SCRIPTS))
def test_help_works_without_cuda(runs, name):
    done, _, _ = runs
    res = done[(name, "help")]
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("usage: ") and "Traceback" not in res.stderr


def test_nothing_was_written(runs):
    """The check comes before any output folder or file is made."""
    _, out, cwd = runs
    assert list(out.iterdir()) == [] and list(cwd.iterdir()) == []
