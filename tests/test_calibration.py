"""The calibration file as ``auto`` reads it and ``hicache calibrate`` updates it: what is taken, what falls back to
the shipped values with a warning naming the file and the fix, and what the command refuses before it measures."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from hicache_core import calibration
from hicache_core.calibration import DEFAULT, load_calibration
from hicache_core.logonce import forget_logged

CPU = torch.device("cpu")


@pytest.fixture
def cal_file(tmp_path, monkeypatch):
    """A calibration path named by ``HICACHE_CALIBRATION`` (not yet written), warnings not yet given."""
    path = tmp_path / "cal.json"
    monkeypatch.setenv("HICACHE_CALIBRATION", str(path))
    forget_logged()
    return path


def _write(path, entry) -> None:
    path.write_text(json.dumps({"cpu": entry}, allow_nan=True))


GOOD = {"d2h_min_block": 4096, "h2d_min_block": 8192, "submit_us": 0.4, "link_gbps": 50.0, "call_us": 5.0}


def test_doctors_file_report_checks_every_entry_whatever_the_machine(cal_file):
    """``hicache doctor`` checks the whole file on any machine (a CPU machine's pools read only the 'cpu' entry, so a
    GPU entry's mistake showed nowhere but in a warning on that GPU)."""
    assert calibration.file_report() == (f"no file at {cal_file} (HICACHE_CALIBRATION names it): the shipped values "
                                         "(NVIDIA H200) apply", [f"HICACHE_CALIBRATION={cal_file} does not exist"])
    cal_file.write_text(json.dumps({"cpu": GOOD, "NVIDIA A": {**GOOD, "link_gbps": 5e4}, "NVIDIA B": {**GOOD, "x": 1},
                                    "NVIDIA C": [1]}))
    where, problems = calibration.file_report()
    assert where == f"{cal_file}, entries for ['NVIDIA A', 'NVIDIA B', 'NVIDIA C', 'cpu']"
    assert problems == [
        f"{cal_file} entry 'NVIDIA A' is malformed (link_gbps=50000 is over 1000 GB/s, faster than any host link: "
        "write GB/s (1e9 bytes per second), not MB/s): auto uses the shipped calibration for that GPU",
        f"{cal_file} entry 'NVIDIA B': unknown keys ['x'] ignored",
        f"{cal_file} entry 'NVIDIA C' is malformed (the entry must be an object, got list): auto uses the shipped "
        "calibration for that GPU"]
    cal_file.write_text("[1]")
    assert calibration.file_report() == (str(cal_file), [f"{cal_file} must be a JSON object of GPU name -> entry, "
                                                         "got list"])
    cal_file.write_text("{")
    where, problems = calibration.file_report()
    assert len(problems) == 1 and problems[0].startswith(f"{cal_file} is unreadable (")


def test_a_good_entry_is_taken(cal_file):
    _write(cal_file, {**GOOD, "source": "test", "measurements": []})
    cal = load_calibration(CPU)
    assert (cal.gpu, cal.d2h_min_block, cal.h2d_min_block, cal.submit_us, cal.link_gbps, cal.call_us, cal.source) == \
        ("cpu", 4096, 8192, 0.4, 50.0, 5.0, "test")


@pytest.mark.parametrize("change,why", [
    ({"link_gbps": float("nan")}, "'link_gbps' must be a finite number, got nan"),
    ({"submit_us": float("inf")}, "'submit_us' must be a finite number, got inf"),
    ({"d2h_min_block": 1e400}, "'d2h_min_block' must be a finite number"),
    ({"d2h_min_block": True}, "'d2h_min_block' must be a finite number, got True"),
    ({"h2d_min_block": 1.9}, "'h2d_min_block' must be a whole number of bytes, got 1.9"),
    ({"h2d_min_block": "16k"}, "'h2d_min_block' must be a finite number, got '16k'"),
    ({"link_gbps": 0}, "block sizes and link_gbps must be positive"),
    ({"d2h_min_block": 10**400}, "'d2h_min_block' must be a finite number, got 1000000000000000000000000000000000000000..."),
    ({"submit_us": -10**400}, "'submit_us' must be a finite number"),
    ({"link_gbps": 55000}, "link_gbps=55000 is over 1000 GB/s, faster than any host link: write GB/s"),
])
def test_a_malformed_entry_falls_back_with_a_warning(cal_file, caplog, change, why):
    _write(cal_file, {**GOOD, **change})
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU) == DEFAULT
    assert f"calibration {cal_file} entry 'cpu' is malformed" in caplog.text and why in caplog.text
    assert "hicache calibrate" in caplog.text


@pytest.mark.parametrize("content,why", [
    (None, "does not exist"),
    ("[1, 2]", "must be a JSON object of GPU name -> entry, got list"),
    ('{"NVIDIA A100": {"d2h_min_block": 1, "h2d_min_block": 1}}', "has no entry for 'cpu' (entries: ['NVIDIA A100'])"),
    ("{not json", "ignoring unreadable calibration"),
    ("[" * 100_000, "(nested too deeply to parse)"),
])
def test_a_named_file_that_gives_nothing_for_this_device_is_warned_about(cal_file, caplog, content, why):
    if content is not None:
        cal_file.write_text(content)
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU) == DEFAULT
        assert load_calibration(CPU) == DEFAULT  # pools load it one by one: warned once
    assert why in caplog.text and len(caplog.records) == 1
    # a CPU pool's fix is the file's "cpu" entry: `hicache calibrate` cannot run without a GPU
    assert "on this GPU" not in caplog.text and 'its "cpu" entry, written by hand' in caplog.text


def test_a_null_entry_is_malformed_not_missing(cal_file, caplog):
    """``{"cpu": null}`` has an entry for ``cpu``: the warning says what is wrong with it, not that it is missing."""
    _write(cal_file, None)
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU) == DEFAULT
    assert "entry 'cpu' is malformed (the entry must be an object, got NoneType)" in caplog.text
    assert "no entry" not in caplog.text


def test_unknown_keys_are_warned_about_and_ignored(cal_file, caplog):
    _write(cal_file, {**GOOD, "link_gpbs": 12.0})
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(CPU).link_gbps == 50.0
    assert "unknown keys ['link_gpbs'] ignored" in caplog.text


def test_calibrate_never_overwrites_a_file_it_cannot_read(cal_file, capsys, monkeypatch):
    """An existing file that is not JSON (a hand edit with a trailing comma) or not an object stops the command
    before it measures anything (exit 2, naming the file); a readable one keeps its other GPUs' entries."""
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured before checking the file"))
    args = argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=False)
    for text in ('{"NVIDIA A100": {"d2h_min_block": 1, "h2d_min_block": 1},}', "[1]"):
        cal_file.write_text(text)
        assert calibration._cmd(args) == 2
        assert cal_file.read_text() == text
        assert f"calibration file {cal_file}" in capsys.readouterr().err
    rows = calibration.rated([{"to_host": t, "block": 4096, "gbps": 50.0, "submit_us_per_block": 0.5}
                              for t in (True, False)], {True: 52.0, False: 52.0})
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: rows)
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    cal_file.write_text('{"NVIDIA A100": {"d2h_min_block": 1, "h2d_min_block": 1}}')
    assert calibration._cmd(args) == 0
    data = json.loads(cal_file.read_text())
    assert sorted(data) == ["NVIDIA A100", "NVIDIA H200"] and data["NVIDIA H200"]["d2h_min_block"] == 4096


def test_calibrate_refuses_a_file_nested_too_deeply_to_read(cal_file, capsys, monkeypatch):
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured before checking the file"))
    text = "[" * 100_000
    cal_file.write_text(text)
    assert calibration._cmd(argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=False)) == 2
    assert "cannot be read (nested too deeply to parse)" in capsys.readouterr().err and cal_file.read_text() == text


@pytest.mark.parametrize("args,why", [
    (([4096], 0), r"measure\(total_bytes=0, reps=10\): both must be >= 1"),
    (([4096], 8192, 0), r"measure\(total_bytes=8192, reps=0\): both must be >= 1"),
    (([4096], 8192.0), r"measure\(total_bytes\) must be an int, got float"),
    (([0, 4096], 8192), r"measure\(block_sizes\): \[0\] outside 1\.\.total_bytes=8192"),
    (([4096, 16384], 8192), r"measure\(block_sizes\): \[16384\] outside 1\.\.total_bytes=8192; .* a larger total_bytes"),
    (([4096.5], 8192), r"measure\(block_sizes\) entry must be an int"),
])
def test_measure_refuses_bad_arguments_before_touching_the_gpu(monkeypatch, args, why):
    """A zero block or count would divide by zero, ``reps=0`` take the median of nothing: refused up front, naming the
    argument (this runs on CPU: the check comes before the CUDA runtime is asked for)."""
    from hicache_core.backends import cudart

    monkeypatch.setattr(cudart, "runtime", lambda: pytest.fail("reached the CUDA runtime"))
    with pytest.raises(ValueError, match=why):
        calibration.measure(*args)


@pytest.mark.parametrize("flag,value", [("--target", "5"), ("--target", "nan"), ("--target", "0"),
                                        ("--total-mb", "0"), ("--total-mb", "-3")])
def test_calibrate_refuses_out_of_range_options(flag, value, capsys):
    parser = argparse.ArgumentParser()
    calibration.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["calibrate", flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def _rows(ratio_d2h: float, ratio_h2d: float) -> list[dict]:
    """What ``measure`` returns where a pinned memcpy reaches 52 GB/s both ways and 64 KiB blocks ``ratio_*`` of it."""
    raw = [{"to_host": t, "block": b, "gbps": 52.0 * r * (b / 65536) ** 0.1, "submit_us_per_block": 0.5}
           for t, r in ((True, ratio_d2h), (False, ratio_h2d)) for b in (4096, 65536)]
    return calibration.rated(raw, {True: 52.0, False: 52.0})


#: ``hicache calibrate`` on an H100 host (2026-12-05): one pinned D2H memcpy of 64 MB timed at 38.9 GB/s while
#: batched copies of 256 KiB blocks reached 54.2 (H2D: 54.7 and 53.8), GB/s per block size
H100_D2H = {4096: 32.1, 8192: 46.6, 16384: 46.5, 32768: 52.8, 65536: 53.8, 131072: 53.8, 262144: 54.2}
H100_H2D = {4096: 33.7, 8192: 47.8, 16384: 47.7, 32768: 53.5, 65536: 53.8, 131072: 53.8, 262144: 53.8}


def test_a_memcpy_slower_than_the_batched_copies_does_not_set_the_thresholds_or_the_link(cal_file, capsys,
                                                                                          monkeypatch):
    """Ratios are to the faster of the memcpy and the best batched copy of each direction: a slow memcpy (a passing
    disturbance, or a host where one copy is slower) once gave 8 KiB D2H blocks a ratio of 1.2 and a link of 46.8
    GB/s, the mean of 38.9 and 54.7; now the thresholds are where the blocks reach 0.92 of the link, and it says why."""
    raw = [{"to_host": t, "block": b, "gbps": g, "submit_us_per_block": 0.4}
           for t, table in ((True, H100_D2H), (False, H100_H2D)) for b, g in table.items()]
    rows = calibration.rated(raw, {True: 38.9, False: 54.7})
    assert max(r["ratio"] for r in rows) == 1.0 and all(r["ratio"] <= 1.0 for r in rows)
    assert {r["link_gbps"] for r in rows if r["to_host"]} == {54.2}
    assert {r["link_gbps"] for r in rows if not r["to_host"]} == {54.7}
    assert {r["memcpy_gbps"] for r in rows if r["to_host"]} == {38.9}  # kept as measured
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: rows)
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert calibration._cmd(argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=False)) == 0
    out = capsys.readouterr().out
    assert "D2H: one pinned memcpy reached 38.9 GB/s, batched copies 54.2: ratios and the link's speed are taken " \
        "from the faster" in out and "H2D: one pinned memcpy" not in out
    entry = json.loads(cal_file.read_text())["NVIDIA H100 80GB HBM3"]
    assert (entry["d2h_min_block"], entry["h2d_min_block"]) == (32768, 32768)
    assert entry["link_gbps"] == pytest.approx((54.2 + 54.7) / 2)


def test_calibrate_writes_nothing_when_no_block_reaches_the_target(cal_file, capsys, monkeypatch):
    """Never the shipped thresholds saved as this GPU's measure: exit 1, the best ratio named, the file untouched."""
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: _rows(0.80, 0.97))
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    text = '{"NVIDIA H200": {"d2h_min_block": 1, "h2d_min_block": 1}}'
    cal_file.write_text(text)
    assert calibration._cmd(argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=False)) == 1
    err = capsys.readouterr().err
    assert "no block size up to 256 KiB reached --target 0.92 D2H (best 0.800 at 64 KiB blocks)" in err
    assert "H2D (best" not in err and f"nothing written to {cal_file}" in err
    assert cal_file.read_text() == text


def test_calibrate_checks_it_can_write_before_measuring_and_keeps_a_measure_it_cannot_write(tmp_path, capsys,
                                                                                             monkeypatch):
    from hicache_core import jsonfile

    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured a result it cannot write"))
    blocked = tmp_path / "file"
    blocked.write_text("")
    args = argparse.Namespace(out=str(blocked / "cal.json"), target=0.92, total_mb=64, kernel=False)  # under a plain file
    assert calibration._cmd(args) == 2
    assert "pass --out a file in a folder you can write" in capsys.readouterr().err
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: _rows(0.97, 0.97))

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibration, "write_json", full_disk)
    out = tmp_path / "cal.json"
    assert calibration._cmd(argparse.Namespace(out=str(out), target=0.92, total_mb=64, kernel=False)) == 2
    captured = capsys.readouterr()
    assert "No space left on device" in captured.err and not out.exists()
    assert json.loads(captured.out[captured.out.index("{"):])["NVIDIA H200"]["d2h_min_block"] == 65536  # on stdout
    monkeypatch.setattr(calibration, "write_json", jsonfile.write_json)


def test_json_files_are_replaced_whole_or_not_at_all(tmp_path):
    from hicache_core.jsonfile import write_json

    path = tmp_path / "sub" / "f.json"
    write_json(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json(str(path), {"a": object()})  # fails midway through serialising: the old file stays whole
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in path.parent.iterdir()] == ["f.json"]
    import os

    umask = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.json"
        write_json(str(fresh), {})
        assert fresh.stat().st_mode & 0o777 == 0o644  # as open() would make it, not the temporary file's 0600
        os.chmod(path, 0o640)
        write_json(str(path), {"a": 2})
        assert path.stat().st_mode & 0o777 == 0o640  # a file replaced keeps its permissions
    finally:
        os.umask(umask)


@pytest.mark.parametrize("gpu,warned", [("NVIDIA H100 80GB HBM3", True), (DEFAULT.gpu, False)])
def test_a_gpu_without_a_calibration_file_is_told_the_shipped_one_is_another_gpus(tmp_path, monkeypatch, caplog, gpu,
                                                                                  warned):
    """No file at the default path: a GPU other than the shipped calibration's is warned about once (auto's line
    between the copy engine and the kernel was measured elsewhere), the shipped GPU and CPU pools are not."""
    monkeypatch.delenv("HICACHE_CALIBRATION", raising=False)
    monkeypatch.setattr(calibration.os.path, "expanduser", lambda p: str(tmp_path / "home"))
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda device=None: gpu)
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        assert load_calibration(torch.device("cuda", 0)) == DEFAULT
        assert load_calibration(torch.device("cuda", 0)) == DEFAULT
        assert load_calibration(CPU) == DEFAULT
    text = f"no calibration for {gpu!r} ({tmp_path / 'home'}/.cache/hicache/calibration.json does not exist)"
    assert caplog.text.count(text) == (1 if warned else 0)
    assert ("run `hicache calibrate` on this GPU" in caplog.text) == warned
    assert ("measured on an NVIDIA H200" in caplog.text) == warned


def test_doctor_reports_another_gpus_calibration_in_its_line_alone(tmp_path, monkeypatch, caplog):
    """``hicache doctor`` on a GPU without a calibration file says once, in its own line, that the shipped calibration
    is another GPU's; it does not also log the pools' warning (which a pool made later in the process still gets)."""
    from hicache_core import cli

    gpu = "NVIDIA H100 80GB HBM3"
    monkeypatch.delenv("HICACHE_CALIBRATION", raising=False)
    monkeypatch.setattr(calibration.os.path, "expanduser", lambda p: str(tmp_path / "home"))
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda device=None: gpu)
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        line = cli._calibration_line()
        assert "no calibration for" not in caplog.text
        assert line.endswith(f"; measured on another GPU than this {gpu}: run `hicache calibrate` here")
        assert load_calibration(torch.device("cuda", 0)) == DEFAULT  # a pool's load: warned, once
    assert caplog.text.count(f"no calibration for {gpu!r}") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_measures_hand_their_memory_back():
    """``hicache calibrate``'s measures allocate hundreds of MB of pinned host memory and device memory (a pool's host
    buffers, device rows, a memcpy's source and target); once each returns, torch's caching allocators hold no more
    than before, give or take a few MB (they kept it all until the process ended)."""
    from hicache_core import kernel_rate
    from hicache_core.bench import _release_memory

    def held() -> tuple[int, int]:
        return torch.cuda.memory_reserved(), torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    _release_memory()  # what an earlier test left cached does not count
    slack = 16 << 20
    before = held()
    rows = kernel_rate.measure_kernel_loads(reps=2, shapes=("mla61x576-fp8",))
    after_kernel = held()
    calibration.measure([65536], 64 << 20, reps=2)
    after_copy = held()
    assert rows and rows[0]["ratio"] > 0, "the layout plugins' kernels serve this pool: it was measured"
    for after in (after_kernel, after_copy):
        assert after[0] <= before[0] + slack and after[1] <= before[1] + slack, (before, after_kernel, after_copy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_keeps_the_faster_memcpy_timing_and_rates_blocks_against_the_link(monkeypatch):
    """On a GPU: ``measure`` times the memcpy of each direction before and after its blocks and keeps the faster (each
    direction's first timing made 4x slower here, as a passing disturbance would); every ratio is ``gbps`` over the
    faster of that memcpy and the direction's best batched copy, so none exceeds 1."""
    from hicache_core import bench

    real, timed = bench._median_ms, []

    def disturbed(fn, reps, warmup=bench.WARMUP, **kw):
        ms = real(fn, reps, warmup=warmup, **kw)
        timed.append(ms)
        return ms * 4 if len(timed) in (1, 3) else ms

    monkeypatch.setattr(bench.timing, "_median_ms", disturbed)
    total = 8 << 20
    rows = calibration.measure([4096, 65536], total, reps=3)
    assert len(timed) == 4 and [(r["to_host"], r["block"]) for r in rows] == \
        [(True, 4096), (True, 65536), (False, 4096), (False, 65536)]
    for to_host, (before, after) in ((True, timed[0:2]), (False, timed[2:4])):
        mine = [r for r in rows if r["to_host"] == to_host]
        assert {r["memcpy_gbps"] for r in mine} == {max(total / (4 * before), total / after) / 1e6}
        assert {r["link_gbps"] for r in mine} == {max([mine[0]["memcpy_gbps"]] + [r["gbps"] for r in mine])}
        assert all(r["ratio"] == r["gbps"] / r["link_gbps"] <= 1.0 for r in mine)


def test_doctor_prints_the_files_problems(cal_file, monkeypatch):
    """``hicache doctor`` names the file and a PROBLEM line per bad entry (a report: it exits 0)."""
    from hicache_core import cli, create_registry

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cal_file.write_text(json.dumps({"cpu": GOOD, "NVIDIA A": {**GOOD, "h2d_min_block": 0}}))
    lines = cli.doctor_lines(create_registry(plugins=[]))
    at = lines.index(f"calibration file: {cal_file}, entries for ['NVIDIA A', 'cpu']")
    assert lines[at + 1] == (f"  PROBLEM: {cal_file} entry 'NVIDIA A' is malformed (block sizes and link_gbps must be "
                             "positive, submit_us and call_us not negative): auto uses the shipped calibration for that "
                             "GPU")
    assert not lines[at + 2].startswith("  PROBLEM")


@pytest.mark.parametrize("value,ok", [(0.58, True), (None, True), (2.0, True), (0, False), (-0.5, False), (2.5, False),
                                      ("0.8", False), (True, False)])
def test_kernel_load_ratio_is_optional_and_checked(cal_file, caplog, value, ok):
    """``kernel_load_ratio`` (what ``hicache calibrate`` measured of the kernels' load bursts) is optional (absent or
    null: not measured) and, where given, a ratio in (0, 2]; anything else makes the entry malformed (shipped values,
    a warning naming the key)."""
    _write(cal_file, {"d2h_min_block": 4096, "h2d_min_block": 8192, "kernel_load_ratio": value})
    with caplog.at_level(logging.WARNING, logger="hicache_core.calibration"):
        cal = load_calibration(torch.device("cpu"))
    if ok:
        assert cal.h2d_min_block == 8192 and cal.kernel_load_ratio == value and not caplog.records
    else:
        assert cal is DEFAULT and "kernel_load_ratio" in caplog.text
    _write(cal_file, {"d2h_min_block": 4096, "h2d_min_block": 8192})
    assert load_calibration(torch.device("cpu")).kernel_load_ratio is None


def test_calibrate_writes_the_slower_kernel_burst_and_its_rows(cal_file, capsys, monkeypatch):
    """With the kernels measured, the entry holds the slower shape's ratio as ``kernel_load_ratio`` and every row under
    ``kernel_measurements``, which a later read accepts; with none measured (``--no-kernel``, no kernel installed, or
    the measure failing) neither key is written and the copy engine's entry stands."""
    from hicache_core import kernel_rate

    rows = calibration.rated([{"to_host": t, "block": 4096, "gbps": 50.0, "submit_us_per_block": 0.5}
                              for t in (True, False)], {True: 52.0, False: 52.0})
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: rows)
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda *a: "cpu")
    krows = [{"shape": "mla61x576-bf16", "layout": "x", "ratio": 0.87, "burst_ms": 1.0, "memcpy_ms": 0.87},
             {"shape": "mla61x576-fp8", "layout": "x", "ratio": 0.58, "burst_ms": 1.0, "memcpy_ms": 0.58}]
    monkeypatch.setattr(kernel_rate, "measure_kernel_loads", lambda *a, **k: krows)
    assert calibration._cmd(argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=True)) == 0
    entry = json.loads(cal_file.read_text())["cpu"]
    assert entry["kernel_load_ratio"] == 0.58 and entry["kernel_measurements"] == krows
    assert "kernel load bursts, mla61x576-fp8 via x: ratio 0.580" in capsys.readouterr().out
    forget_logged()
    assert load_calibration(torch.device("cpu")).kernel_load_ratio == 0.58
    for measured in ([], RuntimeError("no Triton here")):
        def fake(*a, measured=measured, **k):
            if isinstance(measured, Exception):
                raise measured
            return measured
        monkeypatch.setattr(kernel_rate, "measure_kernel_loads", fake)
        cal_file.unlink()
        assert calibration._cmd(argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=True)) == 0
        entry = json.loads(cal_file.read_text())["cpu"]
        assert "kernel_load_ratio" not in entry and "kernel_measurements" not in entry and entry["d2h_min_block"] == 4096
        assert "kernel_load_ratio left out" in capsys.readouterr().err
    monkeypatch.setattr(kernel_rate, "measure_kernel_loads", lambda *a, **k: pytest.fail("measured with --no-kernel"))
    assert calibration._cmd(argparse.Namespace(out=None, target=0.92, total_mb=64, kernel=False)) == 0
    parser = argparse.ArgumentParser()
    calibration.add_parser(parser.add_subparsers())
    assert parser.parse_args(["calibrate"]).kernel and not parser.parse_args(["calibrate", "--no-kernel"]).kernel


@pytest.mark.parametrize("ratio,said", [(0.42, "kernels' load bursts 0.42 of memcpy: auto's loads get 2.00x room"),
                                        (0.87, "kernels' load bursts 0.87 of memcpy"), (None, None)])
def test_doctor_names_the_kernels_measured_load_speed(cal_file, monkeypatch, ratio, said):
    """``hicache doctor``'s calibration line gives a measured ``kernel_load_ratio`` and, where it is under the usual
    speed, the room it gives ``auto``'s loads; nothing where the entry holds none."""
    from hicache_core import cli

    gpu = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(calibration.torch.cuda, "get_device_name", lambda device=None: gpu)
    entry = {"d2h_min_block": 4096, "h2d_min_block": 8192, **({} if ratio is None else {"kernel_load_ratio": ratio})}
    cal_file.write_text(json.dumps({gpu: entry}))
    line = cli._calibration_line()
    if said is None:
        assert "kernels' load bursts" not in line
        assert line.endswith("; kernels' load speed not measured (taken as usual): `hicache calibrate` measures it")
    else:
        assert said in line and ("room" in line) == (ratio < 0.84)
