"""benchmarks/stress.py runs tiny on the CPU (so it cannot rot) and fails when a byte is wrong."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "stress.py"


@pytest.fixture(scope="module")
def stress():
    spec = importlib.util.spec_from_file_location("hicache_stress", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_tiny_stress_passes_and_reports(stress, tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    assert stress.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ok"] is True and r["interleaved"]["transfers"] == 120 and r["interleaved"]["corrupt_total"] == 0
    assert len(r["interleaved"]["pools"]) == 3 and r["skipped"] == {}
    assert sum(r["interleaved"]["calls"].values()) == 120 and min(r["interleaved"]["calls"].values()) > 0
    assert r["sglang"]["batches"] == 6 and r["sglang"]["corrupt_total"] == 0 and not r["sglang"]["errors"]
    assert r["lifecycle"]["lifecycles"] == 8 and r["lifecycle"]["leak"] is False


def test_a_corrupt_byte_fails_the_run(stress, tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    assert stress.main(["--tiny", "--device", "cpu", "--out", str(out), "--inject-fault"]) == 1
    r = json.loads(out.read_text())
    assert r["ok"] is False and r["interleaved"]["corrupt_bytes"]["layer_first:direct:mha"]["host"] > 0


def test_no_buildable_target_exits_2(stress, tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    assert stress.main(["--tiny", "--device", "cpu", "--out", str(out), "--targets", "nope:direct:mha"]) == 2
    assert "nope:direct:mha" in json.loads(out.read_text())["skipped"]
