"""The GPU benchmarks' shared start: without CUDA a script says so in one line and exits 2, as ``hicache bench`` does.

Each script that needs a CUDA GPU calls :func:`require_cuda` at the start of its ``main()``, after its arguments
are parsed (so that ``--help`` works anywhere) and before anything is measured or written.
"""

from __future__ import annotations

import os
import sys

#: Where to read how the benchmarks are run on a GPU machine.
GPU_HOWTO = 'see docs/contributing.md ("On a GPU machine") for running the benchmarks on one'


def cuda_missing(script: str) -> str:
    """The one line :func:`require_cuda` prints for ``script`` (a path or name) where torch sees no CUDA GPU; ''
    where it sees one."""
    import torch

    if torch.cuda.is_available():
        return ""
    return (f"{os.path.basename(script)}: needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False); "
            f"{GPU_HOWTO}")


def require_cuda(script: str) -> None:
    """Exit 2 with one line on stderr naming ``script`` (pass ``__file__``) where torch sees no CUDA GPU."""
    line = cuda_missing(script)
    if line:
        print(line, file=sys.stderr)
        raise SystemExit(2)
