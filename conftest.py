"""Repository-wide pytest set-up: without a GPU, Triton kernels run in the interpreter; a session build cache."""

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton fixes its interpreter mode when first imported: import it now, so a test that unsets the variable for a
    # while (tests/test_review_driver.py's launcher fixture) cannot decide it for every test after it
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - Triton-less runs skip the kernel tests
        pass

#: The HICACHE_* variables of the calling shell (before the cache directory below is set): the header names them.
_SHELL_SETTINGS = {k: v for k, v in os.environ.items() if k.startswith("HICACHE_")}

# The compiled launch call (hicache_core/claunch.py) is built by the first test that needs it: into a directory of
# this session, not the user's cache (a build there would outlive the tests).
if "HICACHE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="hicache-test-cache-")
    os.environ["HICACHE_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)


import pytest  # noqa: E402


@pytest.fixture(params=["python", "torch"])
def index_check_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways ``check_indices`` checks a batch's page starts: as Python ints (few, on the CPU) and with torch."""
    if request.param == "torch":
        monkeypatch.setattr("hicache_core.validate.SMALL_STARTS", 0)
    return request.param


def _interpreter_note() -> str | None:
    """Where the kernel tests cannot pass here (a CPU run with a Triton whose interpreter cannot run them): why."""
    if _cuda:
        return None
    from hicache_core.kernel_support import interpreter_problem

    problem = interpreter_problem()
    return f"hicache: {problem}: the kernel tests fail on this machine" if problem else None


def _environment_note() -> str | None:
    """The ``HICACHE_*`` variables the calling shell sets: the code under test reads them (CI sets none; tests/ clears
    ``HICACHE_AUTO_FORWARD``, ``HICACHE_AUTO_BACKUP_ROOM`` and ``HICACHE_CALIBRATION`` for its own tests), so a result
    that differs from CI's may come from one of them."""
    if not _SHELL_SETTINGS:
        return None
    return "hicache: set in this environment, and read by the code under test: " + ", ".join(
        f"{k}={v!r}" for k, v in sorted(_SHELL_SETTINGS.items()))


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [note for note in (_interpreter_note(), _environment_note()) if note]


def pytest_terminal_summary(terminalreporter: "pytest.TerminalReporter") -> None:
    for note in (_interpreter_note(), _environment_note()):  # again at the end, where a -q run's reader looks
        if note:
            terminalreporter.write_line(note, yellow=True, bold=True)
