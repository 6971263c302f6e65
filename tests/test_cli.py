"""Exact output of ``hicache plugins | matrix | explain | verify``.

Every test restricts the registry with ``HICACHE_PLUGINS`` to the core and the
two test distributions (tests/plugins), so the text does not depend on which
other plugins are installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Callable

import pytest
import torch

from hicache_core import StrategyInfo, create_registry, hookimpl
from hicache_core import cli
from hicache_core.backends.direct import DirectStrategy

ALLOW = "core,page_head,fake_vendor"
PAGE_HEAD_DESC = "[P, H, page_size, L, D] per component (MHA only); one head of one page contiguous"
MLA_REASON = "layout page_head: page_head stores per-head rows of MHA pools only; this pool is 'mla'"
INVENTORY = """\
installed layouts:
  page_head (hicache-test-page-head 0.1.0)
installed io_backends:
  direct (hicache-core 0.1.0)
  fakedma (hicache-test-vendor 0.1.0)
  reference (hicache-core 0.1.0)"""


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HICACHE_DISABLE_PLUGINS", "HICACHE_STRATEGY", "HICACHE_TRACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HICACHE_PLUGINS", ALLOW)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- plugins -----------------------------------------------------------------------
def test_plugins(capsys):
    rc, out, err = run(capsys, "plugins")
    assert rc == 0 and err == ""
    assert out == f"""\
core (hicache-core 0.1.0)
  strategy core.direct [io_backend=direct layouts=* sharded=both]: copy-engine copies over coalesced runs derived from layout strides
  strategy core.reference [io_backend=reference layouts=* sharded=both]: torch indexing on any device; the oracle
fake_vendor (hicache-test-vendor 0.1.0)
  strategy test_vendor.fakedma [io_backend=fakedma layouts=layer_first,page_first_direct,page_head sharded=both]: fake vendor DMA engine (records calls, copies through core.direct)
page_head (hicache-test-page-head 0.1.0)
  layout page_head: {PAGE_HEAD_DESC}

3 plugins (0 broken), 1 layout, 3 strategies; io_backends: direct, fakedma, reference
"""


def test_plugins_core_alone_says_no_layout(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_PLUGINS", "core")
    rc, out, _ = run(capsys, "plugins")
    assert rc == 0
    assert out.splitlines()[-2:] == [
        "1 plugin (0 broken), 0 layouts, 2 strategies; io_backends: direct, reference",
        "no layout is installed: hicache-core alone gives generic backends and no layouts; install a layout plugin "
        "(e.g. pip install hicache-layer-first hicache-page-first hicache-kv-split)",
    ]
    rc, out, _ = run(capsys, "matrix")
    assert rc == 0 and out.startswith("no layout is installed: hicache-core alone gives generic backends and no layouts")


class _RaisingPlugin:
    @hookimpl
    def hicache_register_layouts(self, register: Callable[..., None]) -> None:
        raise RuntimeError("boom")


def test_plugins_lists_broken_plugin(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_registry", lambda: create_registry(plugins=[("raiser", _RaisingPlugin())]))
    rc, out, _ = run(capsys, "plugins")
    assert rc == 0
    lines = out.splitlines()
    assert "raiser (<local> -): BROKEN, registration failed: RuntimeError: boom" in lines
    assert lines[-1] == "4 plugins (1 broken), 1 layout, 3 strategies; io_backends: direct, fakedma, reference"


def test_plugins_json(capsys):
    rc, out, _ = run(capsys, "plugins", "--json")
    data = json.loads(out)
    assert rc == 0 and data["layouts"] == ["page_head"]
    vendor = [p for p in data["plugins"] if p["name"] == "fake_vendor"][0]
    assert vendor["dist"] == "hicache-test-vendor" and vendor["error"] is None
    assert vendor["strategies"] == [{"name": "test_vendor.fakedma", "io_backend": "fakedma",
                                     "layouts": ["layer_first", "page_first_direct", "page_head"],
                                     "sharded": [False, True]}]


def test_unknown_allowed_plugin_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_PLUGINS", "core,not_installed")
    rc, out, err = run(capsys, "plugins")
    assert rc == 2 and out == ""
    assert err.startswith("hicache plugins: HICACHE_PLUGINS names plugins that are not installed: ['not_installed']")


# -- matrix ------------------------------------------------------------------------
POOLS = """\
pools (device cpu):
  mha: mha [k:32B+v:32B] x 4 layers, page 16
  mha sharded: mha [k:32B+v:32B] x 2 layers, page 16, sharded 2/4 layers
  mla: mla [kv:1152B] x 4 layers, page 16
  mla sharded: mla [kv:1152B] x 2 layers, page 16, sharded 2/4 layers
"""


def test_matrix(capsys):
    rc, out, err = run(capsys, "matrix")
    assert rc == 0 and err == ""
    d, v, r = "core.direct" + " " * 10, "test_vendor.fakedma  ", "core.reference" + " " * 7
    none = "-" + " " * 20
    assert out == POOLS + f"""
layout     io_backend  sharded  kind  backup_all_layers    backup_layer         load_layer           load_all_layers
page_head  direct      no       mha   {d}{d}{d}core.direct
page_head  direct      no       mla   {none}{none}{none}-                    [1]
page_head  direct      yes      mha   {d}{d}{d}core.direct
page_head  direct      yes      mla   {none}{none}{none}-                    [1]
page_head  fakedma     no       mha   {v}{v}{v}test_vendor.fakedma
page_head  fakedma     no       mla   {none}{none}{none}-                    [1]
page_head  fakedma     yes      mha   {v}{v}{v}test_vendor.fakedma
page_head  fakedma     yes      mla   {none}{none}{none}-                    [1]
page_head  reference   no       mha   {r}{r}{r}core.reference
page_head  reference   no       mla   {none}{none}{none}-                    [1]
page_head  reference   yes      mha   {r}{r}{r}core.reference
page_head  reference   yes      mla   {none}{none}{none}-                    [1]

6 of 12 cells served; '-': nothing serves the cell, because:
[1] {MLA_REASON}
"""


def test_matrix_filters(capsys):
    rc, out, _ = run(capsys, "matrix", "--kind", "mha", "--io-backend", "direct")
    assert rc == 0
    assert out == """\
pools (device cpu):
  mha: mha [k:32B+v:32B] x 4 layers, page 16
  mha sharded: mha [k:32B+v:32B] x 2 layers, page 16, sharded 2/4 layers

layout     io_backend  sharded  kind  backup_all_layers  backup_layer  load_layer   load_all_layers
page_head  direct      no       mha   core.direct        core.direct   core.direct  core.direct
page_head  direct      yes      mha   core.direct        core.direct   core.direct  core.direct

2 of 2 cells served
"""


def test_matrix_json(capsys):
    rc, out, _ = run(capsys, "matrix", "--json", "--io-backend", "fakedma", "--kind", "mla")
    data = json.loads(out)
    assert rc == 0 and data["device"] == "cpu"
    assert data["operations"] == ["backup_all_layers", "backup_layer", "load_layer", "load_all_layers"]
    assert [(c["sharded"], c["strategy"], c["reason"]) for c in data["cells"]] == [
        (False, None, MLA_REASON), (True, None, MLA_REASON)]
    assert data["cells"][0]["operations"] == dict.fromkeys(data["operations"])
    assert data["cells"][0]["candidates"] == ["test_vendor.fakedma"]


def test_matrix_uses_the_environment_strategy_pick(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_registry", lambda: create_registry(plugins=[("second", _SecondDirect())]))
    rc, out, _ = run(capsys, "matrix", "--kind", "mha", "--io-backend", "direct", "--json")
    assert {c["strategy"] for c in json.loads(out)["cells"]} == {"core.direct"}
    monkeypatch.setenv("HICACHE_STRATEGY", "zz.direct")
    rc, out, _ = run(capsys, "matrix", "--kind", "mha", "--io-backend", "direct", "--json")
    assert {c["strategy"] for c in json.loads(out)["cells"]} == {"zz.direct"}


class _SecondDirect:
    @hookimpl
    def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
        register(StrategyInfo("zz.direct", "direct", ("*",), DirectStrategy))


# -- explain -----------------------------------------------------------------------
def test_explain_hit(capsys):
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "fakedma", "--sharded")
    assert rc == 0 and err == ""
    assert out == f"""\
key: layout='page_head' io_backend='fakedma' sharded=True
pool: mha [k:32B+v:32B] x 2 layers, page 16, sharded 2/4 layers (device cpu)
layout: page_head from hicache-test-page-head 0.1.0: {PAGE_HEAD_DESC}
candidates, in order:
  1. test_vendor.fakedma (exact; hicache-test-vendor 0.1.0): chosen
chosen: test_vendor.fakedma from hicache-test-vendor 0.1.0
"""


def test_explain_rejection(capsys):
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "fakedma", "--dtype", "fp32")
    assert rc == 2
    reason = "fakedma moves 1- and 2-byte element pools only; components ['k', 'v'] are float32"
    assert out == f"""\
key: layout='page_head' io_backend='fakedma' sharded=False
pool: mha [k:64B+v:64B] x 4 layers, page 16 (device cpu)
layout: page_head from hicache-test-page-head 0.1.0: {PAGE_HEAD_DESC}
candidates, in order:
  1. test_vendor.fakedma (exact; hicache-test-vendor 0.1.0): rejected: {reason}
"""
    assert err == f"""\
hicache explain: no strategy serves (layout='page_head', io_backend='fakedma', sharded=False) for mha [k:64B+v:64B] x 4 layers, page 16:
  test_vendor.fakedma: {reason}
nearest working alternatives: --layout page_head --io-backend direct (core.direct), --layout page_head --io-backend reference (core.reference)
{INVENTORY}
"""


def test_explain_layout_rejects_kind(capsys):
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct", "--kind", "mla")
    assert rc == 2
    assert out == f"""\
key: layout='page_head' io_backend='direct' sharded=False
pool: mla [kv:1152B] x 4 layers, page 16 (device cpu)
layout: page_head from hicache-test-page-head 0.1.0: {PAGE_HEAD_DESC}
layout check: rejected: page_head stores per-head rows of MHA pools only; this pool is 'mla'
candidates, in order:
  1. core.direct (generic; hicache-core 0.1.0): not tried (the layout rejects this pool)
"""
    assert err.splitlines()[1:3] == [f"  {MLA_REASON}", "nearest working alternatives: (none)"]


def test_explain_unknown_layout(capsys):
    rc, out, err = run(capsys, "explain", "--layout", "no_such_layout", "--io-backend", "kernel")
    assert rc == 2 and out == ""
    assert err == f"hicache explain: unknown layout 'no_such_layout'.\n{INVENTORY}\n"


def test_explain_near_misses(capsys):
    rc, _, err = run(capsys, "explain", "--layout", "page_hed", "--io-backend", "direct")
    assert rc == 2 and err.endswith(f"{INVENTORY}\ndid you mean: page_head?\n")
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "dirct")
    assert rc == 2
    assert out.splitlines()[-1] == "candidates: none; no strategy is registered for io_backend 'dirct' and this layout"
    assert err.endswith("did you mean: direct?\n")
    assert ("nearest working alternatives: --layout page_head --io-backend direct (core.direct), --layout page_head "
            "--io-backend fakedma (test_vendor.fakedma), --layout page_head --io-backend reference (core.reference)"
            ) in err.splitlines()


def test_explain_override_and_environment_pick(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_registry", lambda: create_registry(plugins=[("second", _SecondDirect())]))
    rc, out, _ = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct")
    assert rc == 0 and out.splitlines()[-3:] == [
        "  1. core.direct (generic; hicache-core 0.1.0): chosen",
        "  2. zz.direct (generic; <local> -): not tried (an earlier candidate serves)",
        "chosen: core.direct from hicache-core 0.1.0",
    ]
    rc, out, _ = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct", "--strategy", "zz.direct")
    assert rc == 0 and out.splitlines()[-3:] == [
        "  1. core.direct (generic; hicache-core 0.1.0): skipped (--strategy=zz.direct)",
        "  2. zz.direct (generic; <local> -): chosen",
        "chosen: zz.direct from <local> -",
    ]
    monkeypatch.setenv("HICACHE_STRATEGY", "zz.direct")
    rc, out, _ = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct")
    assert rc == 0 and out.splitlines()[-3] == "  1. core.direct (generic; hicache-core 0.1.0): skipped (HICACHE_STRATEGY=zz.direct)"
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct", "--strategy", "nope")
    assert rc == 2
    assert out.splitlines()[-1] == "--strategy nope: not a candidate for this key; candidates: ['core.direct', 'zz.direct']"


# -- verify ------------------------------------------------------------------------
VERIFY_TABLE = f"""\
layout     io_backend  sharded  kind  strategy             result  backup GB/s  load GB/s
page_head  direct      no       mha   core.direct          PASS    -            -
page_head  direct      no       mla   -                    SKIP    -            -          [1]
page_head  direct      yes      mha   core.direct          PASS    -            -
page_head  direct      yes      mla   -                    SKIP    -            -          [1]
page_head  fakedma     no       mha   test_vendor.fakedma  PASS    -            -
page_head  fakedma     no       mla   -                    SKIP    -            -          [1]
page_head  fakedma     yes      mha   test_vendor.fakedma  PASS    -            -
page_head  fakedma     yes      mla   -                    SKIP    -            -          [1]
page_head  reference   no       mha   core.reference       PASS    -            -
page_head  reference   no       mla   -                    SKIP    -            -          [1]
page_head  reference   yes      mha   core.reference       PASS    -            -
page_head  reference   yes      mla   -                    SKIP    -            -          [1]

notes:
[1] {MLA_REASON}
"""


def test_verify_without_timing(capsys):
    rc, out, err = run(capsys, "verify", "--device", "cpu", "--no-timing")
    assert rc == 0
    assert out == "verify on cpu: 12 cells, 6 passed, 0 failed, 6 skipped\ntiming: off\n\n" + VERIFY_TABLE


def test_verify_timed_structure(capsys):
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--kind", "mha", "--tokens", "64", "--reps", "1")
    assert rc == 0
    lines = out.splitlines()
    assert lines[:3] == [
        "verify on cpu: 6 cells, 6 passed, 0 failed, 0 skipped",
        "timed pool: mha [k:2048B+v:2048B] x 4 layers, page 16, 64 tokens (sharded cells: owned layers)",
        "",
    ]
    assert lines[3].split() == ["layout", "io_backend", "sharded", "kind", "strategy", "result", "backup", "GB/s",
                                "load", "GB/s"]
    cells = [ln.split() for ln in lines[4:]]
    assert [c[:6] for c in cells] == [
        ["page_head", b, s, "mha", name, "PASS"]
        for b, name in (("direct", "core.direct"), ("fakedma", "test_vendor.fakedma"), ("reference", "core.reference"))
        for s in ("no", "yes")
    ]
    for c in cells:
        # Structure only: on a loaded machine a tiny transfer may time at 0.00 GB/s (CI must never flake on speed).
        assert len(c) == 8 and all(re.fullmatch(r"\d+\.\d\d", x) for x in c[6:]), c


def test_verify_json(capsys):
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--no-timing", "--json", "--io-backend", "fakedma",
                     "--kind", "mha")
    data = json.loads(out)
    assert rc == 0 and data["device"] == "cpu"
    assert [(r["sharded"], r["strategy"], r["result"]) for r in data["rows"]] == [
        (False, "test_vendor.fakedma", "PASS"), (True, "test_vendor.fakedma", "PASS")]


class _Lossy:
    """Backs up correctly but loads nothing: verify must call it FAIL."""

    def __init__(self) -> None:
        self._inner = DirectStrategy()

    def supports(self, spec, layout):
        return None

    def prepare(self, binding):
        self._inner.prepare(binding)

    def backup(self, binding, host_indices, device_indices, layer):
        self._inner.backup(binding, host_indices, device_indices, layer)

    def load(self, binding, host_indices, device_indices, layer):
        return None


class _LossyPlugin:
    @hookimpl
    def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
        register(StrategyInfo("lossy.drop", "lossy", ("*",), _Lossy, (False,)))


def test_verify_fails_a_wrong_strategy(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_registry", lambda: create_registry(plugins=[("lossy", _LossyPlugin())]))
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--io-backend", "lossy", "--kind", "mha", "--no-timing")
    assert rc == 1
    assert out == """\
verify on cpu: 1 cell, 0 passed, 1 failed, 0 skipped
timing: off

layout     io_backend  sharded  kind  strategy    result  backup GB/s  load GB/s
page_head  lossy       no       mha   lossy.drop  FAIL    -            -          [1]

notes:
[1] AssertionError: load_layer: k[layer 0] differs from the reference at rows [32, 33, 34, 35, 36]
"""


def test_verify_kernel_cells_on_cpu_need_the_interpreter(capsys, monkeypatch):
    class _FakeKernelPlugin:
        @hookimpl
        def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
            from hicache_core.kernel_support import kernel_unsupported_reason

            class _K(DirectStrategy):
                def supports(self, spec, layout):
                    return kernel_unsupported_reason(spec)

            register(StrategyInfo("fake.kernel", "kernel", ("*",), _K, (False,)))

    monkeypatch.setattr(cli, "_registry", lambda: create_registry(plugins=[("k", _FakeKernelPlugin())]))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--io-backend", "kernel", "--kind", "mha")
    assert rc == 0 and out.splitlines()[-1] == (
        "[1] fake.kernel: Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU); the pool is on cpu")
    assert "SKIP" in out.splitlines()[4]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--io-backend", "kernel", "--kind", "mha")
    assert rc == 0 and out.splitlines()[-1] == "[1] not timed: Triton interpreter (TRITON_INTERPRET=1)"
    assert out.splitlines()[4].split()[:6] == ["page_head", "kernel", "no", "mha", "fake.kernel", "PASS"]


def test_verify_refuses_missing_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    rc, out, err = run(capsys, "verify", "--device", "cuda")
    assert rc == 2 and err == "hicache verify: --device cuda but CUDA is not available\n"


# -- parser ------------------------------------------------------------------------
def test_bench_hook_only_when_the_module_exists(monkeypatch):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert ("bench" in sub.choices) == (importlib.util.find_spec("hicache_core.bench") is not None)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == ["explain", "matrix", "plugins", "verify"]


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--layout", "page_head"])
    assert exc.value.code == 2
    assert "the following arguments are required: --io-backend" in capsys.readouterr().err
