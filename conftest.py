"""Repository-wide pytest set-up: without a GPU, Triton kernels run in the interpreter."""

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
