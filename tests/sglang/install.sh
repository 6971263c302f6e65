#!/usr/bin/env bash
# Install SGLang 0.5.23 + the extra deps needed to import its HiCache pool
# classes on CPU, without touching the installed torch.
# Usage: tests/sglang/install.sh [path/to/pip]   (default: /work/venv/bin/pip)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PIP="${1:-${PIP:-/work/venv/bin/pip}}"
PY="$(dirname "$PIP")/python"

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"

# sglang's metadata pins torch==2.14.1 (+ CUDA-only deps): never resolve it.
"$PIP" install --no-deps "sglang==0.5.23"
# Constraint keeps pip from replacing torch while resolving transitive deps
# (e.g. compressed-tensors requires torch).
"$PIP" install -c "$CONSTRAINTS" -r "$HERE/requirements.txt"

after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ "$after" != "$TORCH_VERSION" ]]; then
  echo "ERROR: torch changed ($TORCH_VERSION -> $after)" >&2
  exit 1
fi
"$PY" - "$HERE" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import sglang_harness as H
H.prepare()
import sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.pool_host.mha  # noqa
import sglang.srt.mem_cache.pool_host.dsa, sglang.srt.mem_cache.dsa_cache_layer_split  # noqa
import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler, sglang.srt.plugins  # noqa
print("imports OK")
PY
echo "sglang 0.5.23 test deps installed (torch $TORCH_VERSION unchanged)."
