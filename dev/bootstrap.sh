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
# torch: HICACHE_TORCH (default torch==2.13.0), one pip requirement or, split on spaces, pip arguments such as
# "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu". Which build a plain requirement gets is pip's
# choice: on Linux PyPI serves the CUDA build (several GB); the CPU build needs the index URL above or local wheels.
# PYTHON picks the interpreter for .venv (default python3; >= 3.10).
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
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "bootstrap: $PY is $("$PY" -V 2>&1 || echo missing); hicache needs Python >= 3.10 (torch 2.13 does too):" \
    "run it with PYTHON=python3.11 (or another >= 3.10) bash dev/bootstrap.sh" >&2
  exit 1
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then  # none, or half made (venv without ensurepip)
  rm -rf .venv
  if ! "$PY" -m venv .venv; then
    rm -rf .venv
    echo "bootstrap: $PY -m venv failed; on Debian/Ubuntu install python3-venv (e.g. apt install python3.11-venv)," \
      "then run this again" >&2
    exit 1
  fi
fi
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
read -r -a TORCH <<<"${HICACHE_TORCH:-torch==2.13.0}"
step "torch (${TORCH[*]})" "${PIP[@]}" "${TORCH[@]}"
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
