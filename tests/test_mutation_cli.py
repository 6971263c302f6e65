"""Tests that pin behaviour of ``hicache_core.cli`` and ``hicache_core.calibration`` which mutation testing found
unchecked: calibration bounds and defaults, ``hicache calibrate``'s threshold pick and what it writes, and the CLI's
exit codes, progress, and doctor/explain/plugins lines in corner cases."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import types
from typing import Callable

import pytest
import torch

from hicache_core import StrategyInfo, calibration, cli, create_registry, hookimpl
from hicache_core.backends.direct import DirectStrategy
from hicache_core.calibration import DEFAULT, load_calibration
from hicache_core.logonce import forget_logged

CPU = torch.device("cpu")
ALLOW = "core,page_head,fake_vendor"
GOOD = {"d2h_min_block": 4096, "h2d_min_block": 8192, "submit_us": 0.4, "link_gbps": 50.0, "call_us": 5.0}


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HICACHE_DISABLE_PLUGINS", "HICACHE_STRATEGY", "HICACHE_TRACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HICACHE_PLUGINS", ALLOW)
    forget_logged()


@pytest.fixture
def cal_file(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("HICACHE_CALIBRATION", str(path))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- calibration file -----------------------------------------------------------------
@pytest.mark.parametrize("change,why", [
    ({"d2h_min_block": 0}, "block sizes and link_gbps must be positive"),
    ({"h2d_min_block": -4096}, "block sizes and link_gbps must be positive"),
    ({"submit_us": -0.1}, "submit_us and call_us not negative"),
    ({"call_us": -1}, "submit_us and call_us not negative"),
])
def test_out_of_range_entries_fall_back(cal_file, caplog, change, why):
    cal_file.write_text(json.dumps({"cpu": {**GOOD, **change}}))
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU) == DEFAULT
    assert f"calibration {cal_file} entry 'cpu' is malformed" in caplog.text and why in caplog.text


def test_zero_overheads_are_allowed(cal_file, caplog):
    cal_file.write_text(json.dumps({"cpu": {**GOOD, "submit_us": 0, "call_us": 0, "d2h_min_block": 1}}))
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        cal = load_calibration(CPU)
    assert (cal.submit_us, cal.call_us, cal.d2h_min_block) == (0.0, 0.0, 1) and caplog.text == ""


def test_absent_optional_keys_take_the_shipped_values_and_source_names_the_file(cal_file, caplog):
    cal_file.write_text(json.dumps({"cpu": {"d2h_min_block": 4096, "h2d_min_block": 8192, "measurements": [1]}}))
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        cal = load_calibration(CPU)
    assert (cal.submit_us, cal.link_gbps, cal.call_us) == (DEFAULT.submit_us, DEFAULT.link_gbps, DEFAULT.call_us)
    assert (cal.submit_us, cal.link_gbps, cal.call_us) == (0.5, 55.0, 6.0)
    assert cal.source == str(cal_file)
    assert caplog.text == ""  # "measurements" (written by hicache calibrate) is no unknown key


def test_default_path_missing_is_silent(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("HICACHE_CALIBRATION", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration.calibration_path() == str(tmp_path / ".cache" / "hicache" / "calibration.json")
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU) == DEFAULT
    assert caplog.text == ""


# -- hicache calibrate --------------------------------------------------------------
def test_target_one_is_accepted():
    parser = argparse.ArgumentParser()
    calibration.add_parser(parser.add_subparsers())
    assert parser.parse_args(["calibrate", "--target", "1"]).target == 1.0


def test_threshold_is_the_smallest_block_reaching_the_target_inclusive():
    rows = [{"to_host": True, "block": b, "ratio": r} for b, r in ((65536, 0.99), (8192, 0.92), (4096, 0.5),
                                                                      (16384, 0.95))]
    rows.append({"to_host": False, "block": 1024, "ratio": 1.0})
    assert calibration._threshold(rows, True, 0.92) == 8192
    assert calibration._threshold(rows, True, 0.995) is None
    assert calibration._threshold(rows, False, 0.92) == 1024


def _rows() -> list[dict]:
    # link_gbps, not memcpy_gbps, is the link's speed (measure() takes the faster of the memcpy and the batched copies)
    return [{"to_host": t, "block": b, "gbps": 10.0 + b / 4096, "memcpy_gbps": 50.0 if t else 52.0,
             "link_gbps": 52.0 if t else 54.0, "ratio": {4096: 0.5, 8192: 0.93, 16384: 0.99}[b] if t else 0.95, "submit_us_per_block": 0.25 if t else 0.75}
            for t in (True, False) for b in (4096, 8192, 16384)]


def test_calibrate_writes_the_measured_entry_and_keeps_other_gpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: _rows())
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda *a: "GPU X")
    out = tmp_path / "cal.json"
    out.write_text(json.dumps({"GPU Y": {"d2h_min_block": 1, "h2d_min_block": 2}}))
    assert calibration._cmd(argparse.Namespace(out=str(out), target=0.92, total_mb=1, kernel=False)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"GPU X: copy engine from 8192 B blocks (D2H), 4096 B (H2D); written to {out}"
    data = json.loads(out.read_text())
    assert data["GPU Y"] == {"d2h_min_block": 1, "h2d_min_block": 2}
    entry = data["GPU X"]
    assert (entry["d2h_min_block"], entry["h2d_min_block"]) == (8192, 4096)
    assert (entry["submit_us"], entry["link_gbps"], entry["call_us"]) == (0.5, 53.0, 6.0)
    assert entry["source"].startswith("hicache calibrate --target 0.92 on ") and entry["measurements"] == _rows()


def test_calibrate_refuses_a_folder_as_its_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured"))
    assert calibration._cmd(argparse.Namespace(out=str(tmp_path), target=0.92, total_mb=1, kernel=False)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hicache calibrate: calibration file {tmp_path} exists but cannot be read (")
    assert err.rstrip().endswith("(it is never overwritten)")


# -- verify ---------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_verify_json_shows_no_progress_on_a_terminal(capsys, monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--no-timing", "--kind", "mha", "--io-backend", "direct",
                     "--json")
    assert rc == 0 and [r["result"] for r in json.loads(out)["rows"]] == ["PASS", "PASS"]
    assert tty.getvalue() == ""


def test_verify_a_failing_timed_pool_fails_the_cell(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli.verify, "_throughput", boom)
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--kind", "mha", "--io-backend", "direct", "--json")
    rows = json.loads(out)["rows"]
    assert rc == 1
    assert [(r["result"], r["note"], r["backup_gbps"]) for r in rows] == \
        [("FAIL", "timed pool: RuntimeError: boom", None)] * 2


# -- explain --------------------------------------------------------------------------
def test_explain_does_not_mention_the_environment_pick_under_strategy(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_STRATEGY", "core.reference")  # registered, no candidate for this key
    rc, out, _ = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct", "--strategy", "core.direct")
    assert rc == 0 and "HICACHE_STRATEGY" not in out
    assert out.splitlines()[3:5] == ["candidates, in order:", "  1. core.direct (generic; hicache-core 0.1.0): chosen"]


def test_explain_of_a_miss_exits_2(capsys):
    rc, out, err = run(capsys, "explain", "--layout", "page_head", "--io-backend", "direct", "--kind", "mla")
    assert rc == 2 and err.startswith("hicache explain: ")


# -- doctor ---------------------------------------------------------------------------
class _Lossy(DirectStrategy):
    pass


class _UnshardedPlugin:
    @hookimpl
    def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
        register(StrategyInfo("unsharded.only", "unsharded", ("*",), _Lossy, (False,)))


def test_doctor_leaves_out_cells_without_candidates(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = cli.doctor_lines(create_registry(plugins=[("unsharded", _UnshardedPlugin())]))
    assert lines[next(i for i, line in enumerate(lines) if line.startswith("verify on")):] == [  # a cell whose strategy serves the other kind of pool only is a skip that says so
        "verify on cpu: 9 of 20 cells will run, 11 will be skipped:",
        "  10 cells (page_head/auto, page_head/direct, page_head/fakedma, page_head/reference, page_head/unsharded): "
        "layout page_head: page_head stores per-head rows of MHA pools only; this pool is 'mla'",
        "  1 cell (page_head/unsharded): (none): unsharded.only serves unsharded pools only (registered with "
        "sharded=(False,)); add True to its registration's sharded to serve these",
    ]


def test_doctor_on_cuda_does_not_report_the_cpu_interpreter_problem(monkeypatch, tmp_path):
    monkeypatch.setenv("HICACHE_CALIBRATION", str(tmp_path / "none.json"))  # whatever this machine calibrated
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(cli.doctor, "_interpreter_problem", lambda: "PROBLEM")
    from hicache_core.backends import cudart

    rt = types.SimpleNamespace(path="/x/libcudart.so.12", version=12080, driver_version=12090, has_batch=True)
    monkeypatch.setattr(cudart, "runtime", lambda: rt)
    monkeypatch.setattr(cudart, "loaded_cudart_paths", lambda: ["/o/libcudart.so.11.0", rt.path])
    monkeypatch.setattr(cli.doctor, "matrix_cells", lambda reg, device: [])  # (resolving CUDA pools needs a CUDA build)
    lines = cli.doctor_lines(create_registry())
    assert lines[1] == "CUDA: available, 1 device (Fake GPU)"
    assert lines[2] == ("copy engine (direct): CUDA runtime /x/libcudart.so.12 (runtime 12080, driver 12090: batched "
                        "copies); also mapped, unused: /o/libcudart.so.11.0")
    assert lines[3].startswith("auto's calibration: NVIDIA H200, shipped (H200) (file: ")
    assert ("): copy engine from 32768 B blocks (backups) / 32768 B (loads), 0.50 us per descriptor, 6 us per call, "
            "link 55.0 GB/s; measured on another GPU") in lines[3]  # the values auto decides by
    assert lines[3].endswith("; measured on another GPU than this Fake GPU: run `hicache calibrate` here")
    assert lines[-1] == "verify on cuda: 0 of 0 cells will run, 0 will be skipped" and not any(ln.startswith("problem:") for ln in lines)


def test_doctor_names_why_the_copy_engine_has_no_runtime_and_when_it_cannot_batch(monkeypatch):
    from hicache_core.backends import cudart

    def missing():
        raise RuntimeError("no usable libcudart found in this process or next to torch\nsecond line")

    monkeypatch.setattr(cudart, "runtime", missing)
    assert cli._copy_engine_runtime() == ("unavailable (RuntimeError: no usable libcudart found in this process or "
                                          "next to torch)")
    rt = types.SimpleNamespace(path="/x/libcudart.so.12", version=12080, driver_version=12040, has_batch=False)
    monkeypatch.setattr(cudart, "runtime", lambda: rt)
    monkeypatch.setattr(cudart, "loaded_cudart_paths", lambda: [rt.path])
    assert cli._copy_engine_runtime() == ("CUDA runtime /x/libcudart.so.12 (runtime 12080, driver 12040: one call per "
                                          "copy (no cudaMemcpyBatchAsync))")


def test_doctor_does_not_list_the_bound_runtime_as_another_one_through_a_link(monkeypatch, tmp_path):
    """The runtime may be bound through a link (torch's lib folder) while /proc/self/maps names the file itself."""
    from hicache_core.backends import cudart

    real = tmp_path / "libcudart.so.12.8.90"
    real.write_bytes(b"")
    link = tmp_path / "libcudart.so.12"
    link.symlink_to(real)
    rt = types.SimpleNamespace(path=str(link), version=12080, driver_version=12090, has_batch=True)
    monkeypatch.setattr(cudart, "runtime", lambda: rt)
    monkeypatch.setattr(cudart, "loaded_cudart_paths", lambda: [str(real)])
    assert cli._copy_engine_runtime() == f"CUDA runtime {link} (runtime 12080, driver 12090: batched copies)"


# -- plugins, logging -------------------------------------------------------------------
def test_plugins_with_no_plugin_loaded_says_so(capsys, monkeypatch):
    from hicache_core.registry import Registry

    monkeypatch.setattr(cli.shared, "_registry", lambda: Registry(env={}))
    rc, out, _ = run(capsys, "plugins")
    assert rc == 0 and out.splitlines()[0] == "no hicache plugin is loaded"


def test_sharded_text():
    assert cli._sharded_text((False, True)) == "both"
    assert cli._sharded_text((True, True)) == "yes"
    assert cli._sharded_text((False,)) == "no"
    assert cli._sharded_text(()) == "none"


@pytest.mark.parametrize("verbose,level", [(0, "WARNING"), (1, "INFO"), (2, "DEBUG"), (3, "DEBUG")])
def test_verbosity_sets_the_log_level(verbose, level):
    code = f"import logging; from hicache_core import cli; cli._configure_logging({verbose}); " \
           "print(logging.getLevelName(logging.getLogger().level))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HICACHE_TRACE": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == level


def test_whole_float_block_sizes_are_taken_as_ints(cal_file):
    cal_file.write_text(json.dumps({"cpu": {**GOOD, "d2h_min_block": 4096.0}}))
    cal = load_calibration(CPU)
    assert cal.d2h_min_block == 4096 and type(cal.d2h_min_block) is int


def test_a_missing_block_size_is_named(cal_file, caplog):
    cal_file.write_text(json.dumps({"cpu": {"h2d_min_block": 8192}}))
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU) == DEFAULT
    assert "entry 'cpu' is malformed ('d2h_min_block' is missing)" in caplog.text


def test_verify_passes_tokens_and_reps_to_the_timed_pool(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(cli.verify, "_throughput", lambda reg, cell, device, tokens, reps: seen.append((tokens, reps)) or (1.0, 2.0))
    rc, out, _ = run(capsys, "verify", "--device", "cpu", "--kind", "mha", "--io-backend", "direct", "--tokens", "48",
                     "--reps", "3", "--json")
    assert rc == 0 and seen == [(48, 3), (48, 3)] and json.loads(out)["tokens"] == 48
    assert [(r["backup_gbps"], r["load_gbps"]) for r in json.loads(out)["rows"]] == [(1.0, 2.0)] * 2


def test_matrix_cells_are_in_layout_name_order():
    class _Stub:
        layouts = {"zeta": None, "alpha": None}
        io_backends = ["x"]

        def try_resolve(self, spec, layout, backend):
            return None, [("(none)", "no")]

        def candidates(self, layout, backend, sharded):
            return []

    cells = cli.matrix_cells(_Stub(), kinds=("mha",))
    assert [(c.layout, c.sharded) for c in cells] == [("alpha", False), ("alpha", True), ("zeta", False), ("zeta", True)]
