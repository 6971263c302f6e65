"""A compiled ``cuLaunchKernel`` call for :mod:`hicache_core.drvlaunch`: the same launch, without :mod:`ctypes`.

A replayed ``load_layer`` costs the host the driver's own launch (3.9-5.0 us on the H200 host) plus what it
takes to get there; through :mod:`ctypes` the launch alone costs 7.4-10.2 us there
(``benchmarks/launch_floor.py``).  This module builds, once per machine and Python, a small CPython extension
(the C source below, compiled with the system C compiler, as Triton builds its own launchers) whose
``launch(handle, grid, stream, *values)`` copies a packed launch's parameter pointer array onto its stack,
points each dynamic parameter at its new value there, and calls ``cuLaunchKernel`` through its address (for a
dependent launch ``cuLaunchKernelEx``, with the programmatic stream serialization attribute on).  It
writes nothing shared, so concurrent launches of one packed launch need no lock, and it releases the GIL
around the driver call (which blocks while the launch queue is full).

The launch it makes is exactly :meth:`hicache_core.drvlaunch.DriverKernel.launch`'s (same function, grid,
block, shared memory, stream and parameter bytes; ``tests/test_claunch.py`` compares them byte for byte).
Where the extension cannot be built (no C compiler or Python headers) or ``HICACHE_C_LAUNCH=0``, the
:mod:`ctypes` call is used; the reason is logged once at INFO.  The build goes to ``HICACHE_CACHE_DIR``
(default ``~/.cache/hicache``), keyed by the source and the Python build; kernel strategies ask for it when a
pool is made, so the build (a fraction of a second, once per machine) never lands inside a transfer.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from .envflags import check_switch, env_on

__all__ = ["ENV_C_LAUNCH", "ENV_CACHE_DIR", "LAUNCH_EX_TYPES", "MAX_PARAMS", "module", "set_c_launch"]

logger = logging.getLogger(__name__)

#: ``0`` keeps the :mod:`ctypes` launch.
ENV_C_LAUNCH = "HICACHE_C_LAUNCH"
#: Where the extension is built (default ``~/.cache/hicache``).
ENV_CACHE_DIR = "HICACHE_CACHE_DIR"
#: Parameters a compiled launch takes at most (its stack copy); larger launches keep :mod:`ctypes`.
MAX_PARAMS = 256
#: Dynamic parameters a compiled launch rewrites at most.
MAX_DYNAMIC = 16
#: Seconds the compiler may take (a hung compiler wrapper must not hold the first transfer forever).
BUILD_TIMEOUT_S = 60

_NAME = "_hicache_claunch"
#: C declarations of ``cuLaunchKernelEx``'s configuration (``CUlaunchAttribute``, ``CUlaunchConfig``, the programmatic
#: stream serialization attribute's id) as cuda.h lays them out, for C code built without the CUDA headers (needs
#: <stddef.h>); the compiled launch and benchmarks/launch_floor.py's driver loop share them.
LAUNCH_EX_TYPES = r"""
/* CUlaunchAttribute and CUlaunchConfig as cuda.h lays them out (no CUDA header here): an id padded to 8 bytes and a
   64-byte value; grid, block, shared bytes, stream, attributes and their count */
typedef struct {
  int id;
  char pad[4];
  union {
    char raw[64];
    int on;
    unsigned long long align; /* 8-byte aligned, as cuda.h's union (it holds pointers) */
  } value;
} launch_attr_t;
typedef struct {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  void *stream;
  launch_attr_t *attrs;
  unsigned n_attrs;
} launch_config_t;
_Static_assert(sizeof(launch_attr_t) == 72 && offsetof(launch_attr_t, value) == 8 && _Alignof(launch_attr_t) == 8,
               "CUlaunchAttribute layout");
_Static_assert(sizeof(void *) != 8 || (sizeof(launch_config_t) == 56 && offsetof(launch_config_t, stream) == 32),
               "CUlaunchConfig layout");
typedef int (*launch_ex_t)(const launch_config_t *, void *, void **, void **);
/* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */
#define PDL_ATTRIBUTE 6
"""
_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS %(max_params)d
#define MAX_DYNAMIC %(max_dynamic)d
#define CAPSULE "hicache.claunch"

typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                        void **, void **);

%(launch_ex_types)s
typedef struct {
  launch_t launch;
  launch_ex_t launch_ex; /* set: a dependent launch, through cuLaunchKernelEx with PDL_ATTRIBUTE on */
  void *function;
  unsigned block, shared;
  void **params; /* the packed launch's pointer array (static parameters point into its storage) */
  PyObject *owner; /* keeps that array and storage alive as long as this handle */
  int n_params, n_dynamic;
  int dynamic[MAX_DYNAMIC]; /* parameter index of each dynamic value, in the order launch() takes them */
} Handle;

static void drop(PyObject *capsule) {
  Handle *h = PyCapsule_GetPointer(capsule, CAPSULE);
  if (h) {
    Py_XDECREF(h->owner);
    PyMem_Free(h);
  }
}

/* make(launch_address, function, block, shared, params_address, n_params, dynamic_indices, owner[, ex_address])
   -> handle; ex_address (cuLaunchKernelEx's, 0: none) makes every launch of the handle a dependent one */
static PyObject *make(PyObject *self, PyObject *args) {
  unsigned long long launch, function, params, launch_ex = 0;
  unsigned block, shared;
  int n_params;
  PyObject *dynamic, *owner;
  if (!PyArg_ParseTuple(args, "KKIIKiO!O|K", &launch, &function, &block, &shared, &params, &n_params, &PyTuple_Type,
                        &dynamic, &owner, &launch_ex))
    return NULL;
  Py_ssize_t n_dynamic = PyTuple_GET_SIZE(dynamic);
  if (!launch || !params || n_params < 0 || n_params > MAX_PARAMS || n_dynamic > MAX_DYNAMIC) {
    PyErr_SetString(PyExc_ValueError, "claunch.make: launch address, parameters or dynamic count out of range");
    return NULL;
  }
  Handle *h = PyMem_Malloc(sizeof(Handle));
  if (!h) return PyErr_NoMemory();
  h->launch = (launch_t)(uintptr_t)launch;
  h->launch_ex = (launch_ex_t)(uintptr_t)launch_ex;
  h->function = (void *)(uintptr_t)function;
  h->block = block;
  h->shared = shared;
  h->params = (void **)(uintptr_t)params;
  h->owner = NULL;
  h->n_params = n_params;
  h->n_dynamic = (int)n_dynamic;
  for (Py_ssize_t i = 0; i < n_dynamic; ++i) {
    long k = PyLong_AsLong(PyTuple_GET_ITEM(dynamic, i));
    if (k < 0 || k >= n_params) {
      PyMem_Free(h);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "claunch.make: dynamic index out of range");
      return NULL;
    }
    h->dynamic[i] = (int)k;
  }
  PyObject *capsule = PyCapsule_New(h, CAPSULE, drop);
  if (!capsule) {
    PyMem_Free(h);
    return NULL;
  }
  Py_INCREF(owner);
  h->owner = owner;
  return capsule;
}

/* launch(handle, grid, stream, *values) -> CUresult.  Each value is an int written as 8 little-endian bytes
   (a 4-byte parameter reads the low four). */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 3) {
    PyErr_SetString(PyExc_TypeError, "claunch.launch(handle, grid, stream, *values)");
    return NULL;
  }
  Handle *h = PyCapsule_GetPointer(args[0], CAPSULE);
  if (!h) return NULL;
  if (nargs - 3 != h->n_dynamic) {
    PyErr_SetString(PyExc_TypeError, "claunch.launch: one value per dynamic parameter");
    return NULL;
  }
  /* every conversion is checked at once: nothing runs with an error set, nothing launches after one */
  unsigned long grid = PyLong_AsUnsignedLong(args[1]);
  if (grid == (unsigned long)-1 && PyErr_Occurred()) return NULL;
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[2]);
  if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  uint64_t values[MAX_DYNAMIC];
  for (int i = 0; i < h->n_dynamic; ++i) {
    values[i] = (uint64_t)PyLong_AsUnsignedLongLongMask(args[3 + i]);
    if (values[i] == (uint64_t)-1 && PyErr_Occurred()) return NULL;
  }
  void *params[MAX_PARAMS];
  memcpy(params, h->params, sizeof(void *) * (size_t)h->n_params);
  for (int i = 0; i < h->n_dynamic; ++i) params[h->dynamic[i]] = &values[i];
  launch_t fn = h->launch;
  launch_ex_t fn_ex = h->launch_ex;
  void *function = h->function;
  unsigned block = h->block, shared = h->shared;
  int res;
  if (fn_ex) {
    launch_attr_t attr;
    memset(&attr, 0, sizeof attr);
    attr.id = PDL_ATTRIBUTE;
    attr.value.on = 1;
    launch_config_t cfg = {(unsigned)grid, 1, 1, block, 1, 1, shared, (void *)(uintptr_t)stream, &attr, 1};
    Py_BEGIN_ALLOW_THREADS
    res = fn_ex(&cfg, function, params, NULL);
    Py_END_ALLOW_THREADS
  } else {
    Py_BEGIN_ALLOW_THREADS
    res = fn(function, (unsigned)grid, 1, 1, block, 1, 1, shared, (void *)(uintptr_t)stream, params, NULL);
    Py_END_ALLOW_THREADS
  }
  return PyLong_FromLong(res);
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS,
     "make(launch_address, function, block, shared, params_address, n_params, dynamic, owner[, ex_address])"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch(handle, grid, stream, *values)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, methods};

PyMODINIT_FUNC PyInit_%(name)s(void) { return PyModule_Create(&mod); }
""" % {"max_params": MAX_PARAMS, "max_dynamic": MAX_DYNAMIC, "name": _NAME, "launch_ex_types": LAUNCH_EX_TYPES}


def _env() -> bool:
    return env_on(ENV_C_LAUNCH)


_ON = [_env()]
_MOD: list[ModuleType | None] = []  # [] until first asked; then [the module or None]
_LOCK = threading.Lock()


def set_c_launch(enabled: bool | None = None) -> bool:
    """Turn the compiled call on or off; ``None`` re-reads ``HICACHE_C_LAUNCH``.  Off takes effect at the next
    launch; on applies to launches packed from then on (those packed while it was off keep ctypes)."""
    check_switch("set_c_launch", ENV_C_LAUNCH, enabled)
    _ON[0] = _env() if enabled is None else bool(enabled)
    return _ON[0]


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cmd = shlex.split(cc)
    if cmd and shutil.which(cmd[0]):
        return cmd
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _build(target: Path) -> None:
    cc = _compiler()
    include = sysconfig.get_paths().get("include")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang or $CC)")
    if not include or not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"no Python.h under {include!r} (install the Python development headers)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / f"{_NAME}.c", Path(tmp) / target.name
        src.write_text(_SOURCE)
        includes = dict.fromkeys([include, sysconfig.get_paths().get("platinclude") or include])
        cmd = [*cc, "-O2", "-DNDEBUG", "-shared", "-fPIC", *[f"-I{i}" for i in includes], str(src), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT_S)
        if proc.returncode:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
        os.replace(out, target)  # atomic: another process building at once finds one whole file


def _target() -> Path:
    """Where this source, built for this Python, lives in the cache."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256((_SOURCE + sys.version + suffix).encode()).hexdigest()[:16]
    root = Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "hicache")
    return root / "claunch" / key / f"{_NAME}{suffix}"


def _load() -> ModuleType:
    target = _target()
    if not target.exists():
        _build(target)
        logger.info("built the compiled launch call: %s", target)
        return _import(target)
    try:
        return _import(target)
    except ImportError as exc:  # a damaged file (a full disk, a killed copy): built again, once
        logger.info("rebuilding the compiled launch call (%s)", exc)
        _build(target)
        return _import(target)


def _import(target: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(target))
    spec = importlib.util.spec_from_loader(_NAME, loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def module() -> ModuleType | None:
    """The compiled launch module (built on first use), or ``None`` when it is off or cannot be built here."""
    if not _ON[0]:
        return None
    if not _MOD:
        with _LOCK:
            if not _MOD:
                try:
                    _MOD.append(_load())
                except Exception as exc:  # noqa: BLE001 - any failure keeps the ctypes call
                    logger.info("compiled launch call unavailable (%s); launches go through ctypes (slower on the "
                                "host).  It needs a C compiler ($CC, cc, gcc or clang), the Python headers and a "
                                "writable %s (default ~/.cache/hicache); %s=0 stops trying", exc, ENV_CACHE_DIR,
                                ENV_C_LAUNCH)
                    _MOD.append(None)
    return _MOD[0]
