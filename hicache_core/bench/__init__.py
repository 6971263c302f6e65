"""``hicache bench``: throughput of every installed strategy against pinned memcpy of the same bytes.

For each shape, layout, io_backend, page size, token count, SM budget and
operation it reports GB/s, the ratio to a pinned ``copy_`` of the same number
of bytes in the same direction measured in the same run, the host time per
call, and (optionally) the slowdown of a bf16 GEMM on another stream while a
transfer runs (``--gemm``), and of a memory-bound reduction, with the transfer's own speed beside it
(``--hbm``).  Data are checked bit-exact (round trip against the original
rows) before timing.  The configurations of one layout in a cell are timed in turns: each operation's timed calls
are split into ``--rounds`` rounds, every configuration running its share in each, so that the host's drift over
seconds reaches them alike.  Results go to ``<out>/bench.json``; ``--plot`` renders
``<out>/bench.png`` (ratio vs tokens per strategy) when matplotlib is present.

The modules: :mod:`.shapes` (:data:`SHAPES`, the operations and their constants, :class:`BenchRow`); :mod:`.timing`
(the clocks: event-timed medians, host time, the pinned memcpy reference, the GEMM and memory-bound neighbours, the
memory hand-back); :mod:`.workload` (device layers, indices, the probes' set-up, the bit-exact check); :mod:`.run`
(:func:`run_bench` and the grid it walks); :mod:`.command` (the subcommand's parser and handler, :func:`main`,
:func:`plot`).  Every name is importable from here, as from the single module this package was.  A test or probe that
replaces a function does it in the module that looks it up: the runner calls the clocks and the workload through
their modules, so ``timing._samples_ms`` (or ``workload._check``, ``run._configs``) replaced there reaches every
caller, and the command calls ``run.run_bench``; replacing the name here changes nothing.
"""

from __future__ import annotations

from .command import (DEFAULT_BACKENDS, PLOT_KEYS, _cmd, _int_list, _name_list, _plot_rows, _progress_printer, add_parser,
                      main, peers_module, plot)
from .run import _configs, _one_pool_each, _served_by, _targets, _timed_calls, _uneven, run_bench
from .shapes import (DEFAULT_ROUNDS, DIRECT_VARIANTS, ENV_PLACEMENT, GEMM_OPS, HBM_LONE_OPS, HBM_READ_BYTES,
                     MAX_DIRECT_COPIES, OPS, SHAPES, WARMUP, BenchRow, _mha, _mla)
from .timing import (_burst_host_us, _gemm_slowdown, _hbm_reader, _host_us, _in_turns, _keep_busy, _LinkWarmer,
                     _median_ms, _Memcpy, _ms_beside, _ms_beside_gemm, _neighbor_slowdown, _queue, _release_memory,
                     _samples_ms, _shares, _turn, _two_streams)
from .workload import _check, _compare, _device_buffers, _indices, _scramble, _workload

__all__ = ["SHAPES", "BenchRow", "run_bench", "add_parser", "main"]

#: Also importable from here, as from the single module this package was: the constants, the other public functions,
#: and the private helpers that other modules, benchmarks and tests call (replacing one here would not reach the module
#: that calls it).  Naming them here is what tells pyflakes they are used.
_REEXPORTED = (DEFAULT_BACKENDS, DEFAULT_ROUNDS, DIRECT_VARIANTS, ENV_PLACEMENT, GEMM_OPS, HBM_LONE_OPS, HBM_READ_BYTES,
               MAX_DIRECT_COPIES, OPS, PLOT_KEYS, WARMUP, peers_module, plot, _burst_host_us, _check, _cmd, _compare,
               _configs, _device_buffers, _gemm_slowdown, _hbm_reader, _host_us, _indices, _int_list, _keep_busy,
               _LinkWarmer, _median_ms, _Memcpy, _mha, _mla, _ms_beside, _ms_beside_gemm, _name_list,
               _neighbor_slowdown, _plot_rows,
               _progress_printer, _queue, _release_memory, _samples_ms, _scramble, _served_by, _targets, _timed_calls,
               _two_streams, _uneven, _workload, _in_turns, _shares, _turn, _one_pool_each)
