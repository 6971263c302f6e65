#!/usr/bin/env bash
# Idempotent set-up of a fresh Linux machine: a virtualenv in .venv with the
# core, the three layout plugins and the test plugins installed editable.
# CPU-only by default (torch 2.13.0 CPU build); set HICACHE_TORCH to change it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "${HICACHE_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q --no-build-isolation \
  -e '.[test]' -e plugins/layer_first -e plugins/page_first -e plugins/kv_split \
  -e tests/plugins/page_head -e tests/plugins/fake_vendor
# SGLang 0.5.23 and the light packages its pool modules import: test-only, never a core dependency.
if [ -f tests/sglang/install.sh ] && [ -z "${HICACHE_SKIP_SGLANG:-}" ]; then bash tests/sglang/install.sh "$PWD/.venv/bin/pip"; fi
