"""Exact output of ``hicache plugins | matrix | explain | verify``.

Every test restricts the registry with ``HICACHE_PLUGINS`` to the core and the
two test distributions (tests/plugins), so the text does not depend on which
other plugins are installed.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import json
import re
from typing import Callable

import pytest
import torch

from hicache_core import StrategyInfo, create_registry, hookimpl
from hicache_core import cli, kernel_support
from hicache_core.registry import PLUGINS_COME_FROM
from hicache_core.backends.direct import DirectStrategy

ALLOW = "core,page_head,fake_vendor"
PAGE_HEAD_DESC = "[P, H, page_size, L, D] per component (MHA only); one head of one page contiguous"
MLA_REASON = "layout page_head: page_head stores per-head rows of MHA pools only; this pool is 'mla'"
INVENTORY = """\
installed layouts:
  page_head (hicache-test-page-head 0.1.0)
installed io_backends:
  auto (hicache-core 0.1.0)
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


def test_python_dash_m_runs_the_command():
    """``python -m hicache_core`` is ``hicache`` where the console script is not on PATH; importing the module (as a
    tool walking the package does) runs nothing."""
    out = subprocess.run([sys.executable, "-m", "hicache_core", "--version"], capture_output=True, text=True,
                         timeout=300)
    assert (out.returncode, out.stdout.split()[0]) == (0, "hicache"), out.stderr
    out = subprocess.run([sys.executable, "-c", "import hicache_core.__main__; print('imported')", "verify"],
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout) == (0, "imported\n"), out.stderr


# -- plugins -----------------------------------------------------------------------
def test_plugins(capsys):
    rc, out, err = run(capsys, "plugins")
    assert rc == 0 and err == ""
    assert out == f"""\
core (hicache-core 0.1.0)
  strategy core.auto [io_backend=auto layouts=* sharded=both]: copy engine where its blocks reach the GPU's calibrated size, else the layout's kernel
  strategy core.direct [io_backend=direct layouts=* sharded=both]: copy-engine copies over coalesced runs derived from layout strides
  strategy core.reference [io_backend=reference layouts=* sharded=both]: torch indexing on any device; the oracle
fake_vendor (hicache-test-vendor 0.1.0)
  strategy test_vendor.fakedma [io_backend=fakedma layouts=layer_first,page_first_direct,page_head sharded=both]: fake vendor DMA engine (records calls, copies through core.direct)
page_head (hicache-test-page-head 0.1.0)
  layout page_head: {PAGE_HEAD_DESC}

3 plugins (0 broken), 1 layout, 4 strategies; io_backends: auto, direct, fakedma, reference
"""


def test_plugins_core_alone_says_no_layout(capsys, monkeypatch):
    """Layouts installed but left out by HICACHE_PLUGINS: the message names the filter and the plugins it left out
    (not "install a layout plugin"); with none installed, how to install them."""
    from hicache_core.cli import NO_LAYOUT, no_layout
    from hicache_core.registry import Registry

    monkeypatch.setenv("HICACHE_PLUGINS", "core")
    rc, out, _ = run(capsys, "plugins")
    assert rc == 0
    summary, why = out.splitlines()[-2:]
    assert summary == "1 plugin (0 broken), 0 layouts, 3 strategies; io_backends: auto, direct, reference"
    filtered = "no layout is loaded: HICACHE_PLUGINS/HICACHE_DISABLE_PLUGINS left out the installed plugins ["
    assert why.startswith(filtered) and "'layer_first'" in why and why.endswith(
        "; unset them, or allow the plugins of the layouts you want")
    rc, out, _ = run(capsys, "matrix")
    assert rc == 0 and out.startswith(filtered)
    rc, out, err = run(capsys, "verify")  # nothing verified proves nothing: not a success
    assert rc == 2 and out == "" and err.startswith("hicache verify: " + filtered)
    rc, out, err = run(capsys, "verify", "--json")
    assert rc == 2 and json.loads(out)["rows"] == [] and filtered in err
    assert no_layout(Registry(env={})) == NO_LAYOUT == (
        "no layout is installed: hicache-core alone gives generic backends and no layouts; install a layout plugin "
        "from the hicache source tree (e.g. pip install ./plugins/layer_first ./plugins/page_first ./plugins/kv_split)")


def test_explain_describes_a_kernel_for_a_device_this_machine_lacks(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("describes CUDA kernels on a machine without CUDA")
    monkeypatch.setenv("HICACHE_PLUGINS", "core,layer_first")
    rc, out, _ = run(capsys, "explain", "--layout", "layer_first", "--io-backend", "kernel", "--device", "cuda")
    assert rc == 0 and "layer_first.kernel: backups " in out and "CUDA is not available" in out



def test_explain_survives_a_strategy_whose_describe_fails(capsys, monkeypatch):
    from hicache_core.rowcopy import RowKernelStrategy

    def failing(self, spec, layout):
        raise RuntimeError("needs the vendor's driver")

    monkeypatch.setattr(RowKernelStrategy, "describe", failing)
    monkeypatch.setenv("HICACHE_PLUGINS", "core,layer_first")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU pool's kernel needs the interpreter)
    rc, out, _ = run(capsys, "explain", "--layout", "layer_first", "--io-backend", "kernel", "--device", device)
    assert rc == 0 and "chosen: layer_first.kernel" in out
    assert f"layer_first.kernel: cannot describe itself for {device}" in out
    assert "(RuntimeError: needs the vendor's driver)" in out


class _RaisingPlugin:
    @hookimpl
    def hicache_register_layouts(self, register: Callable[..., None]) -> None:
        raise RuntimeError("boom")


def test_plugins_lists_broken_plugin(capsys, monkeypatch):
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("raiser", _RaisingPlugin())]))
    rc, out, _ = run(capsys, "plugins")
    assert rc == 1  # a script checking the installation fails as verify would
    lines = out.splitlines()
    assert "raiser (<local> -): BROKEN, registration failed: RuntimeError: boom" in lines
    assert lines[-1] == "4 plugins (1 broken), 1 layout, 4 strategies; io_backends: auto, direct, fakedma, reference"
    rc, out, _ = run(capsys, "plugins", "--json")
    assert rc == 1 and [p["error"] for p in json.loads(out)["plugins"] if p["name"] == "raiser"] == [
        "registration failed: RuntimeError: boom"]


def test_verify_and_doctor_fail_on_a_plugin_that_registered_nothing(capsys, monkeypatch):
    """A layout plugin whose hook raised leaves no cell behind to FAIL: verify names it and exits 1 (it exited 0
    with every remaining cell passing), JSON included; doctor says verify will fail."""
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("raiser", _RaisingPlugin())]))
    broken = "plugin raiser (<local> -) is BROKEN and registered nothing: registration failed: RuntimeError: boom"
    rc, out, _ = run(capsys, "verify", "--no-timing", "--io-backend", "reference", "--kind", "mha", "--device", "cpu")
    lines = out.splitlines()
    assert rc == 1 and f"  {broken}" in lines
    assert lines[-1] == "verify on cpu: 2 cells, 2 passed, 0 failed, 0 skipped; 1 installation problem"
    rc, out, _ = run(capsys, "verify", "--no-timing", "--io-backend", "reference", "--kind", "mha", "--device", "cpu",
                     "--json")
    data = json.loads(out)
    assert rc == 1 and data["installation_problems"] == [broken] and {r["result"] for r in data["rows"]} == {"PASS"}
    rc, out, _ = run(capsys, "doctor")
    assert rc == 0 and "  BROKEN raiser (<local> -): registration failed: RuntimeError: boom" in out
    assert "  (verify and plugins exit 1 until these are mended)" in out.splitlines()


@pytest.mark.parametrize("left_out", [False, True], ids=["nothing-else-installed", "layouts-left-out"])
def test_verify_fails_when_no_layout_is_loaded_and_a_plugin_is_broken(capsys, monkeypatch, left_out):
    """With no layout loaded, the reason (none installed, or HICACHE_PLUGINS left them out) and the broken plugin (maybe
    the layout plugin, that registered nothing) are both named; a broken plugin makes it a failure (1, not 2)."""
    import hicache_core.builtin as core

    broken = "plugin raiser (<local> -) is BROKEN and registered nothing: registration failed: RuntimeError: boom"
    if left_out:
        monkeypatch.setenv("HICACHE_PLUGINS", "core")
        make = lambda: create_registry(plugins=[("raiser", _RaisingPlugin())])  # noqa: E731
        why = ("no layout is loaded: HICACHE_PLUGINS/HICACHE_DISABLE_PLUGINS left out the installed plugins [",
               f"; also: {broken}")
    else:
        make = lambda: create_registry(entry_points=False, plugins=[("core", core), ("raiser", _RaisingPlugin())])  # noqa: E731
        why = (f"no layout is loaded: {broken}; mend that, or where no layout plugin is installed, ",
               cli.INSTALL_LAYOUTS)
    monkeypatch.setattr(cli.shared, "_registry", make)
    rc, out, err = run(capsys, "verify", "--no-timing")
    assert rc == 1 and out == "" and err.startswith(f"hicache verify: {why[0]}") and err.endswith(f"{why[1]}\n")
    rc, out, _ = run(capsys, "verify", "--no-timing", "--json")
    assert rc == 1 and json.loads(out)["installation_problems"] == [broken]
    rc, out, _ = run(capsys, "plugins")
    assert rc == 1 and out.splitlines()[-1].startswith(why[0]) and out.endswith(f"{why[1]}\n")


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
    a, d, v, r = "core.auto" + " " * 12, "core.direct" + " " * 10, "test_vendor.fakedma  ", "core.reference" + " " * 7
    none = "-" + " " * 20
    assert out == POOLS + f"""
layout     io_backend  sharded  kind  backup_all_layers    backup_layer         load_layer           load_all_layers
page_head  auto        no       mha   {a}{a}{a}core.auto
page_head  auto        no       mla   {none}{none}{none}-                    [1]
page_head  auto        yes      mha   {a}{a}{a}core.auto
page_head  auto        yes      mla   {none}{none}{none}-                    [1]
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

8 of 16 cells served; '-': nothing serves the cell, because:
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
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("second", _SecondDirect())]))
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
nearest working alternatives: layout='page_head', io_backend='auto' (core.auto); layout='page_head', io_backend='direct' (core.direct); layout='page_head', io_backend='reference' (core.reference)
{INVENTORY}
"""


def test_explain_rejection_through_one_pipe_gives_the_report_whole_then_the_error():
    """With stdout and stderr in one pipe (``2>&1``), the report comes whole before the error (stdout, block-buffered
    in a pipe, was flushed at exit, or mid-line where the report filled its buffer)."""
    args = [sys.executable, "-m", "hicache_core", "explain", "--layout", "page_head", "--io-backend", "fakedma", "--dtype",
            "fp32"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's stdout is block-buffered
    alone = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    both = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=env)
    assert alone.returncode == both.returncode == 2 and alone.stdout and alone.stderr
    assert both.stdout == alone.stdout + alone.stderr


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
    assert err == f"hicache explain: unknown layout 'no_such_layout'.\n{PLUGINS_COME_FROM}\n{INVENTORY}\n"


def test_explain_near_misses(capsys):
    rc, _, err = run(capsys, "explain", "--layout", "page_hed", "--io-backend", "direct")
    assert rc == 2 and err.endswith(f"{INVENTORY}\ndid you mean: page_head?\n")
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "dirct")
    assert rc == 2
    assert out.splitlines()[-1] == f"candidates: none; no installed plugin provides io_backend 'dirct' {PLUGINS_COME_FROM}"
    assert err.endswith("did you mean: direct?\n")
    assert ("nearest working alternatives: layout='page_head', io_backend='auto' (core.auto); layout='page_head', "
            "io_backend='direct' (core.direct); layout='page_head', "
            "io_backend='fakedma' (test_vendor.fakedma); layout='page_head', io_backend='reference' (core.reference)"
            ) in err.splitlines()


def test_explain_override_and_environment_pick(capsys, monkeypatch):
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("second", _SecondDirect())]))
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
page_head  auto        no       mha   core.auto            PASS    -            -
page_head  auto        no       mla   -                    SKIP    -            -          [1]
page_head  auto        yes      mha   core.auto            PASS    -            -
page_head  auto        yes      mla   -                    SKIP    -            -          [1]
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

{cli.PASS_MEANS}
"""


def test_verify_without_timing(capsys):
    rc, out, err = run(capsys, "verify", "--device", "cpu", "--no-timing")
    assert rc == 0 and err == ""  # no progress when stderr is not a terminal
    assert out == "timing: off\n\n" + VERIFY_TABLE + "verify on cpu: 16 cells, 8 passed, 0 failed, 8 skipped\n"


def test_verify_without_the_core_plugin_names_the_fix(capsys, monkeypatch):
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(env={"HICACHE_PLUGINS": "page_head"}))
    rc, out, err = run(capsys, "verify", "--device", "cpu", "--no-timing")
    assert rc == 2 and out == ""
    assert err == ("hicache verify: no reference io_backend to compare with: hicache's own plugin is not loaded; add "
                   "core to HICACHE_PLUGINS='page_head'\n")


def test_a_layout_installed_twice_is_named_disabled_not_unknown(capsys, monkeypatch):
    from hicache_core import hookimpl

    page_head = create_registry().layouts["page_head"][0]

    class _Twice:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(page_head)  # the same name again, from another plugin

    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("twice", _Twice())]))
    for cmd in ("verify", "matrix"):
        rc, out, err = run(capsys, cmd, "--device", "cpu", "--layout", "page_head", *(("--no-timing",) if
                                                                                          cmd == "verify" else ()))
        assert rc == 2 and out == "", (cmd, out, err)
        assert err.startswith(f"hicache {cmd}: layout 'page_head' is registered by ") and "unknown" not in err
        assert "cannot be used until all but one are removed" in err


def test_verify_timed_structure(capsys):
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--kind", "mha", "--tokens", "64", "--reps", "1")
    assert rc == 0
    lines = out.splitlines()
    assert lines[:2] == [
        "timed pool: mha [k:2048B+v:2048B] x 4 layers, page 16, 64 tokens (sharded cells: owned layers)",
        "",
    ]
    assert lines[2].split() == ["layout", "io_backend", "sharded", "kind", "strategy", "result", "backup", "GB/s",
                                "load", "GB/s"]
    assert lines[-4:] == ["", cli.PASS_MEANS, cli.CPU_GBPS, "verify on cpu: 8 cells, 8 passed, 0 failed, 0 skipped"]
    cells = [ln.split() for ln in lines[3:-4]]
    assert [c[:6] for c in cells] == [
        ["page_head", b, s, "mha", name, "PASS"]
        for b, name in (("auto", "core.auto"), ("direct", "core.direct"), ("fakedma", "test_vendor.fakedma"),
                        ("reference", "core.reference"))
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
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("lossy", _LossyPlugin())]))
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--io-backend", "lossy", "--kind", "mha", "--no-timing")
    assert rc == 1
    assert out == f"""\
timing: off

layout     io_backend  sharded  kind  strategy    result  backup GB/s  load GB/s
page_head  lossy       no       mha   lossy.drop  FAIL    -            -          [1]
page_head  lossy       yes      mha   -           SKIP    -            -          [2]

notes:
[1] AssertionError: load_layer: k[layer 0] differs from the reference at rows [32, 33, 34, 35, 36]
[2] (none): lossy.drop serves unsharded pools only (registered with sharded=(False,)); add True to its registration's sharded to serve these
(-vv shows each failure's traceback)

{cli.PASS_MEANS}
verify on cpu: 2 cells, 0 passed, 1 failed, 1 skipped
"""


def test_verify_fails_a_strategy_that_fails_to_load(capsys, monkeypatch):
    """A strategy whose factory raises (a vendor module with a syntax error, say) is a FAIL (exit 1), not a skip."""
    class _Broken:
        @hookimpl
        def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
            def factory() -> DirectStrategy:
                raise SyntaxError("invalid syntax (engine.py, line 3)")

            register(StrategyInfo("acme.dma", "acmedma", ("page_head",), factory, (False, True)))

    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("acme", _Broken())]))
    rc, out, _ = run(capsys, "verify", "--io-backend", "acmedma", "--kind", "mha", "--no-timing", "--device", "cpu")
    lines = out.splitlines()
    assert rc == 1
    assert lines[3].split() == ["page_head", "acmedma", "no", "mha", "-", "FAIL", "-", "-", "[1]"]
    assert lines[4].split() == ["page_head", "acmedma", "yes", "mha", "-", "FAIL", "-", "-", "[1]"]
    assert lines[7:9] == ["[1] acme.dma: failed to load: SyntaxError: invalid syntax (engine.py, line 3)",
                          "(-vv shows each failure's traceback)"]
    assert lines[-1] == "verify on cpu: 2 cells, 0 passed, 2 failed, 0 skipped"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # doctor says so before verify runs
    monkeypatch.setenv("HICACHE_PLUGINS", "core,page_head")
    doctor = [ln for ln in cli.doctor_lines(cli.shared._registry()) if ln.startswith("verify on")]
    assert doctor == ["verify on cpu: 6 of 16 cells will run, 8 will be skipped, 2 will fail:"]


def test_verify_kernel_cells_on_cpu_need_the_interpreter(capsys, monkeypatch):
    class _FakeKernelPlugin:
        @hookimpl
        def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
            from hicache_core.kernel_support import kernel_unsupported_reason

            class _K(DirectStrategy):
                def supports(self, spec, layout):
                    return kernel_unsupported_reason(spec)

            register(StrategyInfo("fake.kernel", "kernel", ("*",), _K, (False, True)))

    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("k", _FakeKernelPlugin())]))
    # its "kernel" is the copy engine: no Triton interpreter runs it, whatever Triton is installed (3.6's cannot)
    monkeypatch.setattr(kernel_support, "interpreter_problem", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, out, err = run(capsys, "verify", "--device", "cpu", "--io-backend", "kernel", "--kind", "mha")
    assert rc == 2 and out.splitlines()[-5] == (  # nothing verified: not a success
        "[1] fake.kernel: Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU); the pool is on cpu")
    assert "SKIP" in out.splitlines()[3]
    assert "hicache verify: no cell was verified (2 cells, all skipped: see the notes)" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--io-backend", "kernel", "--kind", "mha")
    assert rc == 0 and out.splitlines()[-5] == "[1] not timed: Triton interpreter (TRITON_INTERPRET=1)"
    assert out.splitlines()[3].split()[:6] == ["page_head", "kernel", "no", "mha", "fake.kernel", "PASS"]


def test_verify_refuses_missing_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    rc, out, err = run(capsys, "verify", "--device", "cuda")
    assert rc == 2 and err == "hicache verify: --device cuda but CUDA is not available\n"


# -- parser ------------------------------------------------------------------------
def test_bench_hook_only_when_the_module_exists(monkeypatch):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert ("bench" in sub.choices) == (importlib.util.find_spec("hicache_core.bench") is not None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == ["calibrate", "doctor", "explain", "matrix", "plugins", "verify"]


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--layout", "page_head"])
    assert exc.value.code == 2
    assert "the following arguments are required: --io-backend" in capsys.readouterr().err


def test_a_misspelt_option_shows_the_commands_own_usage(capsys):
    """Not the top-level ``usage: hicache [-h] ... COMMAND``, which lists none of the command's options."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["verify", "--no-timeing"])
    err = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and err[0].startswith("usage: hicache verify [-h]") and any("--no-timing" in x for x in err)
    assert err[-1] == "hicache verify: error: unrecognized arguments: --no-timeing"
    with pytest.raises(SystemExit) as exc:  # before the command: the top-level usage, not the command's
        cli.main(["--bogus", "matrix"])
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "hicache: error: unrecognized arguments: --bogus")


# -- first contact -----------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == "hicache 0.1.0\n"


def test_verbose_after_the_subcommand(capsys):
    assert cli.build_parser().parse_args(["matrix", "-vv"]).verbose == 2
    assert cli.build_parser().parse_args(["-v", "matrix"]).verbose == 1
    assert cli.build_parser().parse_args(["matrix"]).verbose == 0


@pytest.mark.parametrize("argv,message", [
    (["verify", "--tokens", "0"], "argument --tokens: '0' is not a positive integer"),
    (["verify", "--tokens", "-5"], "argument --tokens: '-5' is not a positive integer"),
    (["verify", "--reps", "0"], "argument --reps: '0' is not a positive integer"),
    (["verify", "--reps", "x"], "argument --reps: 'x' is not a positive integer"),
    (["verify", "--device", "tpu"], "argument --device: 'tpu': use cpu, cuda or cuda:N"),
    (["matrix", "--device", "mps"], "argument --device: 'mps': use cpu, cuda or cuda:N"),
])
def test_bad_values_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"hicache {argv[0]}: error: {message}"


@pytest.mark.parametrize("command", ["matrix", "verify"])
def test_unknown_names_are_usage_errors(capsys, command):
    rc, out, err = run(capsys, command, "--layout", "page_hed")
    assert rc == 2 and out == ""
    assert err == f"hicache {command}: unknown layout 'page_hed'.\n{PLUGINS_COME_FROM}\n{INVENTORY}\ndid you mean: page_head?\n"
    rc, out, err = run(capsys, command, "--io-backend", "nope")
    assert rc == 2 and out == ""
    assert err == f"hicache {command}: unknown io_backend 'nope'.\n{PLUGINS_COME_FROM}\n{INVENTORY}\n"


def test_bench_needs_cuda(capsys, tmp_path):
    if torch.cuda.is_available() or importlib.util.find_spec("hicache_core.bench") is None:
        pytest.skip("CUDA is available or bench is not installed")
    rc, out, err = run(capsys, "bench", "--out", str(tmp_path / "results"))
    assert rc == 2 and out == ""
    assert err == "hicache bench: needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)\n"
    assert not (tmp_path / "results").exists()


def test_explain_strategy_that_is_no_candidate(capsys):
    rc, out, _ = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct", "--strategy", "nope")
    assert rc == 2 and out.splitlines()[-2:] == [
        "  1. core.direct (generic; hicache-core 0.1.0): not tried (--strategy names 'nope', not a candidate)",
        "--strategy nope: not a candidate for this key; candidates: ['core.direct']",
    ]


def test_explain_environment_pick_that_is_no_candidate(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_STRATEGY", "core.reference")  # registered, serves other keys
    rc, out, _ = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct")
    assert rc == 0 and out.splitlines()[3:6] == [
        "HICACHE_STRATEGY=core.reference: not a candidate for this key, ignored",
        "candidates, in order:",
        "  1. core.direct (generic; hicache-core 0.1.0): chosen",
    ]


def test_matrix_on_cuda_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    note = ("note: CUDA is not available on this machine, so none of this can run here, and what needs the CUDA "
            "runtime (the copy engine: direct, auto's copy-engine picks) shows as unavailable where a GPU machine "
            "serves it: run this on the GPU machine for its real picture")
    rc, out, _ = run(capsys, "matrix", "--device", "cuda", "--kind", "mha", "--io-backend", "direct")
    assert rc == 0 and out.splitlines()[0] == (
        "pools (device cuda; CUDA is not available on this machine: see the note at the end):")
    assert out.splitlines()[-1] == note
    rc, out, _ = run(capsys, "explain", "--device", "cuda", "--layout", "page_head", "--io-backend", "reference")
    assert rc == 0 and out.splitlines()[-1] == note


def test_trace_is_printed(capsys, monkeypatch):
    import logging

    monkeypatch.setenv("HICACHE_TRACE", "1")
    logger = logging.getLogger("hicache_core.registry")
    root = logging.getLogger()
    handler = logging.StreamHandler()  # what basicConfig would install, writing to the captured stderr
    monkeypatch.setattr(root, "handlers", [handler])
    level = logger.level
    try:
        rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct")
    finally:
        logger.setLevel(level)  # setLevel also clears logging's level cache
    assert rc == 0
    assert ("hicache: (page_head, direct, sharded=False) mha [k:32B+v:32B] x 4 layers, page 16 -> core.direct "
            "from hicache-core 0.1.0") in err


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_verify_progress_on_a_terminal(capsys, monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--no-timing", "--kind", "mha", "--io-backend", "direct")
    assert rc == 0 and out.splitlines()[-1] == "verify on cpu: 2 cells, 2 passed, 0 failed, 0 skipped"
    first = "[1/2] verifying page_head/direct/unsharded/mha"
    second = "[2/2] verifying page_head/direct/sharded/mha  "  # padded over the longer previous text
    assert tty.getvalue() == f"\r{first}\r{second}\r{' ' * len(second.rstrip())}\r"


def test_verify_interpreter_without_numpy(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numpy" else real(name, *a))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, err = run(capsys, "verify", "--device", "cpu")
    assert rc == 2 and out == ""
    assert err == ("hicache verify: TRITON_INTERPRET=1 needs numpy, which is not installed: "
                   "pip install 'hicache-core[interpret]'\n")


def test_doctor(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("HICACHE_CALIBRATION", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no calibration file
    rc, out, err = run(capsys, "doctor")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"hicache-core 0.1.0, Python {sys.version.split()[0]}, torch {torch.__version__}")
    cuda = 1 if torch.cuda.is_available() else 0  # a CUDA machine's doctor also names auto's calibration
    assert not cuda or lines[3].startswith("auto's calibration: ")
    assert lines[3 + cuda] == (f"calibration file: no file at {tmp_path}/.cache/hicache/calibration.json: the shipped "
                               "values (NVIDIA H200) apply")
    assert lines[5 + cuda].startswith("Triton interpreter: off; numpy: ")
    assert lines[6 + cuda] == ("plugins: 3 plugins (0 broken), layouts: page_head; "
                               "io_backends: auto, direct, fakedma, reference")
    if not torch.cuda.is_available():
        assert lines[1:3] == [
            "CUDA: not available (CPU pools only; the kernel io_backend needs TRITON_INTERPRET=1)",
            "copy engine (direct): memmove on CPU pools (no CUDA runtime needed)",
        ]
        assert lines[7:] == [
            "verify on cpu: 8 of 16 cells will run, 8 will be skipped:",
            "  8 cells (page_head/auto, page_head/direct, page_head/fakedma, page_head/reference): layout page_head: "
            "page_head stores per-head rows of MHA pools only; this pool is 'mla'",
        ]


def test_explain_environment_pick_that_names_no_strategy(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_STRATEGY", "zz.other")
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct")
    assert rc == 2 and "ignored" not in out
    assert "HICACHE_STRATEGY='zz.other' names no registered strategy" in err


def test_listing_commands_never_import_triton():
    """Triton fixes interpreted vs compiled kernels when it is first imported: commands that only list or
    diagnose (doctor, plugins, matrix) must not import it, or a later TRITON_INTERPRET=1 run in the same
    process would fail (an order-dependent test failure seen before)."""
    import subprocess

    code = ("import sys; from hicache_core import cli\n"
            "for argv in (['doctor'], ['plugins'], ['matrix']):\n"
            "    cli.main(argv)\n"
            "loaded = sorted(m for m in sys.modules if m == 'triton' or m.endswith('.kernels'))\n"
            "print('LOADED', loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "LOADED []"


def test_bench_passes_the_neighbour_flags_to_the_runner(monkeypatch, tmp_path):
    bench = pytest.importorskip("hicache_core.bench")
    seen: dict = {}
    monkeypatch.setattr(bench.run, "run_bench", lambda **kw: seen.update(kw) or [])
    monkeypatch.setattr(bench.command, "plot", lambda rows, path: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"multi_processor_count": 1}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert bench.main(["--out", str(tmp_path), "--hbm", "--ops", "backup_all_layers"]) == 2  # nothing measured
    assert (seen["hbm"], seen["gemm"], seen["ops"]) == (True, False, ["backup_all_layers"])
    assert bench.main(["--out", str(tmp_path), "--gemm"]) == 2
    assert (seen["hbm"], seen["gemm"]) == (False, True)
    assert seen["backends"] == ["direct", "auto"]  # the default io_backends that are installed (no kernel here)
    assert not (tmp_path / "bench.json").exists()


def test_bench_checks_its_options_before_measuring_and_writes_its_rows_whole(monkeypatch, tmp_path, capsys):
    bench = pytest.importorskip("hicache_core.bench")
    monkeypatch.setattr(bench.run, "run_bench", lambda **kw: pytest.fail("measured with a bad option"))
    for argv, says in ((["--tokens", "4k"], "--tokens: must be a comma list of whole numbers >= 1, got '4k'"),
                       (["--page-sizes", "0"], "--page-sizes: must be a comma list of whole numbers >= 1"),
                       (["--shapes", "mla61x576"], "--shapes: 'mla61x576' not among mha32x8x128-bf16"),
                       (["--ops", "load"], "--ops: 'load' not among backup_all_layers"),
                       (["--reps", "0"], "--reps: '0' is not a positive integer")):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--out", str(tmp_path), *argv])
        assert exc.value.code == 2 and says in capsys.readouterr().err
    for argv, says in ((["--io-backends", "kernal"], "--io-backends 'kernal': installed are auto, direct, fakedma"),
                       (["--layouts", "page_hed"], "--layouts 'page_hed': installed are page_head")):
        assert bench.main(["--out", str(tmp_path), *argv]) == 2
        assert says in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    # the SM count of the device the run uses (the current one, as the name), not of device 0
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"multi_processor_count": 100 + i}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(bench.command, "plot", lambda rows, path: False)
    rows = [{"op": "load_layer", "shape": "s", "strategy": "x", "page_size": 1, "tokens": 8, "ratio": 0.5}]
    written = []

    def fake_run(**kw):
        kw["sink"](object())  # one measured row (asdict below gives its fields)
        written.append(json.loads((tmp_path / "bench.json").read_text()))

    monkeypatch.setattr(bench.command, "asdict", lambda row: dict(rows[0]))
    monkeypatch.setattr(bench.run, "run_bench", fake_run)
    assert bench.main(["--out", str(tmp_path), "--io-backends", "direct"]) == 0
    assert written == [{"meta": written[0]["meta"], "rows": rows}]
    assert written[0]["meta"]["sms"] == 101
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no temporary file left beside it


def test_bench_plot_only_reports_unreadable_input_without_a_traceback(capsys, tmp_path):
    out_dir = tmp_path / "results"
    bad = tmp_path / "bad.json"
    for content in (None, "{not json", '{"meta": {}}'):
        if content is not None:
            bad.write_text(content)
        rc, _, err = run(capsys, "bench", "--plot-only", str(bad), "--out", str(out_dir))
        assert rc == 2 and f"hicache bench --plot-only: cannot read rows from {bad}" in err
        assert "Traceback" not in err and not out_dir.exists()  # nothing made before the input was read
    for rows, says in (([], "'rows' must be a non-empty list"), ([1], "row 0 lacks op, shape"),
                       ([{"op": "load_layer"}], "row 0 lacks shape, strategy, page_size, tokens, ratio")):
        bad.write_text(json.dumps({"rows": rows}))
        rc, _, err = run(capsys, "bench", "--plot-only", str(bad), "--out", str(out_dir))
        assert rc == 2 and says in err and not out_dir.exists()


def test_calibrate_takes_verbose_after_its_name():
    args = cli.build_parser().parse_args(["calibrate", "-vv", "--target", "0.9"])
    assert args.verbose == 2 and args.target == 0.9


def test_plugins_lists_a_layout_two_plugins_register_as_disabled(capsys, monkeypatch):
    """A plugin registering an installed layout's name disables it for both: ``plugins`` says so (it crashed)."""
    from hicache_test_page_head.layout import PageHeadLayout

    class Copycat:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[object], None]) -> None:
            register(PageHeadLayout())

    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("copycat", Copycat())]))
    rc, out, err = run(capsys, "plugins")
    assert rc == 1 and "Traceback" not in err
    assert "  layout page_head: DISABLED, layout 'page_head' is registered by " in out
    listed = {}  # the plugin each DISABLED line is listed under
    for line in out.splitlines():
        if not line.startswith(" "):
            plugin = line.split(" ")[0]
        elif "layout page_head: DISABLED" in line:
            listed[plugin] = True
    assert set(listed) == {"page_head", "copycat"}  # under both plugins that registered it
    rc, out, _ = run(capsys, "plugins", "--json")
    assert rc == 1 and "page_head" not in json.loads(out)["layouts"]
    rc, out, err = run(capsys, "verify", "--no-timing")  # page_head was the only layout: none is left to verify
    assert rc == 1 and "DISABLED: layout 'page_head' is registered by " in err and "no layout is installed" not in err


def test_plugins_lists_a_key_two_plugins_register_as_disabled(capsys, monkeypatch):
    """Two plugins registering one exact key disable it: ``plugins`` listed both strategies as if nothing were wrong
    (only a log warning said so), where the docs promise it shows the key DISABLED."""
    from hicache_core.testing import strategies_plugin

    acme = strategies_plugin(StrategyInfo("acme.dma", "fakedma", ("page_head",), DirectStrategy, (False,)))
    monkeypatch.setattr(cli.shared, "_registry", lambda: create_registry(plugins=[("acme", acme)]))
    rc, out, _ = run(capsys, "plugins")
    assert rc == 1
    line = ("  key (layout='page_head', io_backend='fakedma', sharded=False): DISABLED, key (layout='page_head', "
            "io_backend='fakedma', sharded=False) is registered by ")
    listed = {}
    for text in out.splitlines():
        if not text.startswith(" "):
            plugin = text.split(" ")[0]
        elif text.startswith(line):
            listed[plugin] = listed.get(plugin, 0) + 1
    assert listed == {"fake_vendor": 1, "acme": 1}, out


def test_a_closed_output_pipe_ends_quietly_with_its_own_exit_code():
    """``hicache plugins | head -1``: not exit 1 (a failing verify cell) and no traceback (the write that finds the
    pipe closed is made to fail every time here, in a child process: the handler redirects the real stdout)."""
    import subprocess

    code = ("import sys\nfrom hicache_core import cli\n"
            "def closed():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "cli.shared._registry = closed\nsys.exit(cli.main(['plugins']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == cli.BROKEN_PIPE == 141 and "Traceback" not in out.stderr and out.stdout == ""
