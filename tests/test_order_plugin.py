"""dev/order_plugin.py, the contributors' check for tests that depend on what ran before them, reorders as it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parent.parent / "dev"
TESTS = '''
import os
def _log(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(name + "\\n")
def test_a():
    _log("a")
def test_b():
    _log("b")
'''


@pytest.mark.parametrize("order,seen", [("reverse", "ba"), ("twice", "abab")])
def test_the_order_plugin_runs_items_reversed_or_twice(tmp_path: Path, order: str, seen: str) -> None:
    (tmp_path / "test_two.py").write_text(TESTS)
    log = tmp_path / "order.log"
    env = {**os.environ, "PYTHONPATH": str(DEV), "HICACHE_TEST_ORDER": order, "ORDER_LOG": str(log)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "order_plugin", "-p", "no:cacheprovider",
                          str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert log.read_text().split() == list(seen)


def test_an_unknown_order_is_refused(tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(DEV), "HICACHE_TEST_ORDER": "shuffle", "ORDER_LOG": str(tmp_path / "x")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "order_plugin", "-p", "no:cacheprovider",
                          str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "HICACHE_TEST_ORDER='shuffle': use one of ('reverse', 'twice')" in run.stdout + run.stderr
