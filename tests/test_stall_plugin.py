"""dev/stall_plugin.py, the contributors' check for tests that depend on real elapsed time, still finds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEV = Path(__file__).resolve().parents[1] / "dev"

TESTS = '''
import time

from hicache_core.backends.pace import HostPace


def test_real_clock_read_twice():
    t0 = time.perf_counter()
    x = 1
    assert time.perf_counter() - t0 < 50.0  # fails under the plugin's 100 s per line


def test_a_measure_on_its_default_clock_goes_stale():
    pace = HostPace()
    for _ in range(5):
        pace.record(100.0, 100, 1)
    assert len(pace.samples()) == 5  # fails: on the library's default clock, each sample comes after a stall


def test_a_fake_clock_stands_still():
    t = [0.0]
    pace = HostPace(now=lambda: t[0])
    for _ in range(5):
        pace.record(100.0, 100, 1)
    assert len(pace.samples()) == 5
'''


def test_the_stall_plugin_fails_exactly_the_tests_that_read_real_time(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_clocks.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DEV), os.environ.get("PYTHONPATH", "")]), "STALL_S": "100"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "stall_plugin", "-p", "no:cacheprovider",
                          "-rf", str(tests)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "stall_plugin: +100 s per test line; clock defaults of" in out.stdout, out.stdout + out.stderr
    failed = sorted(line.split("::")[1].split()[0] for line in out.stdout.splitlines() if line.startswith("FAILED"))
    assert failed == ["test_a_measure_on_its_default_clock_goes_stale", "test_real_clock_read_twice"], out.stdout
    # without the plugin the fake-clock test passes too (the two real-clock probes are left out: run without the
    # plugin, their outcome would be the machine's load, which no test here may depend on)
    clean = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "fake_clock",
                            str(tests)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0 and "1 passed, 2 deselected" in clean.stdout, clean.stdout
