"""Multi-GPU tests: skipped (with the reason) unless enough CUDA devices are visible.

Run them with ``bash dev/gpu_two.sh`` on a machine with two GPUs, or
``python -m pytest -q tests/gpu``.  On CPU CI they are collected and skipped.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
