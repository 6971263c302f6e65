"""Why hicache does not gate a caller's stream on a host thread: CUDA module loading deadlocks it.

Usage (GPU): ``python benchmarks/gate_probe.py [--out DIR]``.

The idea probed: take copy-engine submission off the calling thread (whose GPU-resident
indices would otherwise have to be read back, waiting for the queued forward work) by holding the
caller's stream with ``cuStreamWaitValue32`` on a flag, letting a helper thread read the indices,
submit the copies on its own stream and then ``cuStreamWriteValue32`` the flag.  Each case runs in
a child process with a time limit.  The helper holds the gate closed for ``--hold`` seconds (asleep,
interpreter lock released), then reads indices from the GPU and opens the gate; meanwhile:

* ``control``: the main thread launches a Triton kernel it already ran, on another stream;
* ``fresh-triton-main``: the main thread launches a Triton kernel never loaded before (JIT
  compiled, then its module loaded), on another stream;
* ``fresh-torch-main``: the main thread runs a torch operation never used before in the process
  (its kernel is loaded lazily);
* ``fresh-triton-helper``: the helper itself launches a never-loaded Triton kernel before opening.

A case that does not finish within ``--limit`` seconds deadlocked: loading a module waits for the
device to go idle, the closed gate keeps it busy, and the helper's next CUDA call waits behind the
load.  Results: ``<out>/gate_probe.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda

CASES = ("control", "fresh-triton-main", "fresh-torch-main", "fresh-triton-helper")


def _child(case: str, hold: float) -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, n, s: tl.constexpr, block: tl.constexpr):
        offs = tl.program_id(0) * block + tl.arange(0, block)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * s, mask=m)

    t0 = time.perf_counter()
    say = lambda msg: print(f"{time.perf_counter() - t0:6.3f}s {msg}", flush=True)  # noqa: E731
    lib = ctypes.CDLL("libcuda.so.1")
    fns = []
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint], ctypes.c_int
        fns.append(fn)
    wait_value, write_value = fns
    x = torch.ones(1 << 16, device="cuda")
    idx = torch.arange(4096, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    helper_stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    scale[(64,)](x, x.numel(), s=1.0, block=1024)  # the control kernel, loaded before the gate closes
    torch.cuda.synchronize()
    assert wait_value(torch.cuda.current_stream().cuda_stream, flag.data_ptr(), 1, 0) == 0  # GEQ 1
    say("gate closed on the default stream")

    def helper() -> None:
        with torch.cuda.stream(helper_stream):
            time.sleep(hold)
            if case == "fresh-triton-helper":
                scale[(64,)](x, x.numel(), s=3.0, block=1024)
            say(f"helper: read {idx.cpu().numel()} indices")
            assert write_value(helper_stream.cuda_stream, flag.data_ptr(), 1, 0) == 0
            say("helper: gate opened")

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    with torch.cuda.stream(other):
        if case == "control":
            scale[(64,)](x, x.numel(), s=1.0, block=1024)
        elif case == "fresh-triton-main":
            scale[(64,)](x, x.numel(), s=2.0, block=1024)
        elif case == "fresh-torch-main":
            torch.special.bessel_j0(x)
        say("main: launch returned")
    thread.join()
    torch.cuda.synchronize()
    say("done")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--hold", type=float, default=2.0)
    ap.add_argument("--limit", type=float, default=30.0)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    require_cuda(__file__)
    if args.child:
        _child(args.child, args.hold)
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for case in CASES:
        cmd = [sys.executable, __file__, "--child", case, "--hold", str(args.hold)]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
            outcome, log = ("completed" if res.returncode == 0 else f"failed rc={res.returncode}"), res.stdout + res.stderr
        except subprocess.TimeoutExpired as exc:
            outcome = f"deadlocked (killed after {args.limit:.0f} s)"
            log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rows.append({"case": case, "outcome": outcome, "seconds": round(time.perf_counter() - t0, 2), "log": log})
        print(f"{case:22s} {outcome}\n  " + "\n  ".join(log.strip().splitlines()[-6:]), flush=True)
    with open(os.path.join(args.out, "gate_probe.json"), "w") as f:
        json.dump({"hold_s": args.hold, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
