"""The set-up contract: README's two commands, .ci/run, and the distributions' metadata."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    block = re.match(r"# hicache\n\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md must open with the two set-up commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines()]


def test_readme_opens_with_the_main_job_and_the_test_command() -> None:
    assert _readme_commands() == [
        "bash dev/bootstrap.sh && .venv/bin/hicache verify",
        "bash dev/bootstrap.sh --test && .venv/bin/python -m pytest -q",
    ]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    lines = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))]
    assert lines == [_readme_commands()[1]]


def test_main_job_installs_no_test_distribution() -> None:
    script = (ROOT / "dev/bootstrap.sh").read_text()
    code = [ln for ln in script[: script.index('if [ "$TEST" = 1 ]')].splitlines() if not ln.lstrip().startswith("#")]
    main_job = "\n".join(code)
    for test_only in ("tests/plugins", "examples/", "[test]", "sglang"):
        assert test_only not in main_job.lower()


@pytest.mark.parametrize("folder", [".", "plugins/layer_first", "plugins/page_first", "plugins/kv_split",
                                    "examples/hicache_example"])
def test_distributions_carry_readme_and_license(folder: str) -> None:
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert (ROOT / folder / project["readme"]).is_file() and (ROOT / folder / "LICENSE").is_file()


def test_core_extras() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["interpret"] == ["numpy"] and extras["plot"] == ["matplotlib"]
