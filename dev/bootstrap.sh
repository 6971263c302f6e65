#!/usr/bin/env bash
# Idempotent set-up of this checkout in .venv (editable installs), quiet unless a step fails.
#
#   bash dev/bootstrap.sh          the main job: torch, hicache-core[interpret] (numpy: Triton's CPU interpreter;
#                                  torch also warns at import without it) and the three layout plugins
#   bash dev/bootstrap.sh --test   also what the tests need: pytest, numpy, Triton, the test plugins
#                                  (tests/plugins), the example plugin (examples/hicache_example) and
#                                  SGLang 0.5.23 with the packages its pool modules import
#                                  (HICACHE_SKIP_SGLANG=1 leaves SGLang out)
#
# CPU-only by default (torch 2.13.0 CPU build); set HICACHE_TORCH to another pip requirement to change it.
# pip's output goes to .venv/bootstrap.log and is shown only when a step fails. Running the main job on a
# .venv that an earlier --test run filled leaves the test plugins installed (delete .venv for a clean one).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --test) TEST=1 ;;
  "") TEST=0 ;;
  *) echo "usage: bash dev/bootstrap.sh [--test]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/bootstrap.log
: >"$LOG"

step() {  # step DESCRIPTION COMMAND...: run COMMAND with its output in $LOG; on failure show the log's tail
  echo "bootstrap: $1"
  local what=$1
  shift
  if ! "$@" >>"$LOG" 2>&1; then
    echo "bootstrap: FAILED: $what (last lines of $LOG below)" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
PIP=(.venv/bin/python -m pip install --disable-pip-version-check --no-input)

step "pip and setuptools" "${PIP[@]}" --upgrade pip "setuptools>=77"
step "torch (${HICACHE_TORCH:-torch==2.13.0})" "${PIP[@]}" "${HICACHE_TORCH:-torch==2.13.0}"
step "hicache-core and the layout plugins" "${PIP[@]}" --no-build-isolation \
  -e '.[interpret]' -e plugins/layer_first -e plugins/page_first -e plugins/kv_split
if [ "$TEST" = 1 ]; then
  step "test dependencies, test plugins and the example plugin" "${PIP[@]}" --no-build-isolation \
    -e '.[test]' -e tests/plugins/page_head -e tests/plugins/fake_vendor -e examples/hicache_example
  # SGLang's metadata pins another torch: tests/sglang/install.sh installs it without dependencies, then the
  # packages its pool modules import (pip's resolver complains about the pins it cannot see: that goes to the log).
  if [ -z "${HICACHE_SKIP_SGLANG:-}" ]; then
    step "SGLang 0.5.23 (test-only)" bash tests/sglang/install.sh "$PWD/.venv/bin/pip"
  fi
fi
echo "bootstrap: done ($([ "$TEST" = 1 ] && echo 'main job and tests' || echo 'main job'); log: $LOG)"
