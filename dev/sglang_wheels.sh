#!/usr/bin/env bash
# Fetch (here, with a package index) what the SGLang bridge tests need on the GPU machine, which
# has no index: SGLang 0.5.23 for CPython 3.12 without its Rust server extensions (nothing on the
# host-pool path imports them; they are 45 MB of the wheel) and the pure-Python / small packages
# that image lacks.  Output: .whl/ (git-ignored), carried by the device call; see dev/gpu.sh sglang.
# Also LMCache 0.5.3's compiled CUDA ops (lmcache/c_ops*.so alone, for benchmarks/peers.py via
# dev/gpu_peers.sh): the newest LMCache whose extension links against torch 2.11's symbols
# (0.5.4-0.5.6 need c10::NotImplementedError(SourceLocation, std::string), absent in 2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mkdir -p .whl
exclude=$(git rev-parse --git-path info/exclude)  # also right in a git worktree, where .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
fetch() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"
}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fetch "$tmp" sglang==0.5.23
(cd "$tmp" && mkdir x && cd x && unzip -q ../sglang-*.whl && find . -name '*.so' -delete \
  && tar czf ../sglang-0.5.23-cp312-trimmed.tar.gz .)
mv "$tmp/sglang-0.5.23-cp312-trimmed.tar.gz" .whl/
fetch "$tmp" lmcache==0.5.3
(cd "$tmp" && mkdir l && cd l && unzip -q ../lmcache-0.5.3-*.whl 'lmcache/c_ops*.so' \
  && tar czf ../lmcache-0.5.3-c_ops-cp312.tar.gz lmcache)
mv "$tmp/lmcache-0.5.3-c_ops-cp312.tar.gz" .whl/
fetch .whl orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  pyzmq==27.3.0 dill==0.4.1 gguf==0.19.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru==0.7.3
du -sh .whl
