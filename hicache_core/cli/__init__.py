"""The ``hicache`` command: ``plugins``, ``matrix``, ``explain``, ``verify``, ``doctor`` (and ``bench``).

Results go to stdout, diagnostics through :mod:`logging` (stderr); ``verify``
shows progress on stderr when it is a terminal.  Every command builds a fresh
registry from the environment, so ``HICACHE_PLUGINS``, ``HICACHE_DISABLE_PLUGINS``,
``HICACHE_STRATEGY`` and ``HICACHE_TRACE`` apply (``HICACHE_TRACE=1`` prints
each resolution on stderr).

Exit codes: 0 success; 1 ``verify`` found a failing cell; 2 a usage, registry
or resolution error (unknown names, ``explain`` on a miss, no CUDA for ``bench``, ``verify`` with
nothing left to verify).

Each subcommand is one ``_cmd_<name>(args) -> int`` plus one ``_parser_<name>(sub)``
listed in :data:`SUBCOMMANDS`; adding a subcommand is adding such a pair.

Examples::

    hicache plugins
    hicache matrix --kind mla
    hicache explain --layout page_first --io-backend kernel --sharded --kind mla
    hicache verify --tokens 4096
    hicache doctor

The modules: :mod:`.command` (the parser, :data:`SUBCOMMANDS` and :func:`main`); one module per subcommand, holding
its pair (:mod:`.plugins`, :mod:`.matrix`, :mod:`.explain`, :mod:`.verify`, :mod:`.doctor`; ``bench`` and
``calibrate`` come from :mod:`hicache_core.bench` and :mod:`hicache_core.calibration`); :mod:`.args` (the options
and argument types several subcommands take) and :mod:`.shared` (the registry every command builds, the
representative pools, the text helpers).  The public names are importable from here; a test that replaces a
function does it in the module that looks it up (``shared._registry`` for every command's registry).
"""

from __future__ import annotations

from .args import _positive_int
from .command import BROKEN_PIPE, SUBCOMMANDS, _configure_logging, build_parser, main
from .doctor import _calibration_line, _copy_engine_runtime, doctor_lines
from .explain import explain_lines
from .matrix import Cell, matrix_cells, render_matrix
from .plugins import _sharded_text
from .shared import (DTYPES, INSTALL_LAYOUTS, INTERPRET_EXTRA, KINDS, LAYERS, NO_LAYOUT, UsageError, install_problems,
                     no_layout, representative_spec)
from .verify import (CPU_GBPS, PASS_MEANS, VERIFY_REPS, VERIFY_TOKENS, VerifyRow, render_verify, verified_cells,
                     verify_cell, verify_cells)

__all__ = ["main", "build_parser", "representative_spec", "Cell", "matrix_cells", "VerifyRow", "verify_cells",
           "doctor_lines", "UsageError", "SUBCOMMANDS"]

#: Also importable from here, as from the single module this package was: the constants, the other public functions,
#: and the private helpers that other modules and tests call (replacing one here would not reach the module that
#: calls it).  Naming them here is what tells pyflakes they are used.
_REEXPORTED = (BROKEN_PIPE, CPU_GBPS, DTYPES, INSTALL_LAYOUTS, INTERPRET_EXTRA, KINDS, LAYERS, NO_LAYOUT, PASS_MEANS,
               VERIFY_REPS, VERIFY_TOKENS, explain_lines, install_problems, no_layout, render_matrix, render_verify,
               verified_cells, verify_cell, _calibration_line, _configure_logging, _copy_engine_runtime,
               _positive_int, _sharded_text)
