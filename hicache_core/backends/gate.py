"""Copy-engine transfers submitted by a worker thread, gated into the caller's stream.

The copy engine needs index *values* on the host: its descriptors are host
addresses.  An engine that hands a transfer GPU-resident index tensors (SGLang's
``kernel`` io_backend does) would make the calling thread read them back, and
that read waits for every kernel queued on the stream before the call (the
forward pass): the scheduler thread stalls for milliseconds.

A :class:`SubmitWorker` takes such a call off the calling thread.  The caller
(microseconds of host time) records an event on its stream, then enqueues a
*gate* on the same stream: a ``cuStreamWaitValue32`` that holds the stream until
a flag in device memory reaches the call's sequence number.  The worker thread
then, in call order, makes its own stream wait for that event, reads the index
values (only this thread waits for the queued work), submits the copies on its
stream and, after them, enqueues a ``cuStreamWriteValue32`` of the sequence
number.  Work the caller enqueues on its stream after the call (an event the
forward pass waits on, the next layer's load) therefore runs after the copies,
exactly as if they had been submitted inline; other streams are not held.

Errors: the worker cannot raise into a call that has returned.  A job that
fails moves nothing it had not queued, still opens its gate (a gate left closed
would hold the caller's stream for ever), logs the error, and the *next* call
through the worker (or :meth:`SubmitWorker.raise_pending`) raises
:class:`~hicache_core.errors.DeferredTransferError` with the original error as
its cause.

Sequence numbers are 32-bit and wrap: the driver compares them cyclically
(``(int32_t)(*flag - seq) >= 0``), which holds while fewer than 2**31 jobs are
in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import queue
import threading
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol

import torch

from ..errors import DeferredTransferError

__all__ = ["GateOps", "CudaGate", "SubmitWorker", "driver_unavailable_reason"]

logger = logging.getLogger(__name__)

_SEQ_MASK = 0xFFFFFFFF
_CU_STREAM_WAIT_VALUE_GEQ = 0  # cyclic: (int32_t)(*addr - value) >= 0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0  # with a memory fence before the write


class GateOps(Protocol):
    """The device side of a gate (:class:`CudaGate`; tests pass a fake)."""

    def record(self, stream: Any) -> Any:
        """An event marking the caller's work queued on ``stream`` so far."""
        ...

    def gate(self, stream: Any, seq: int) -> None:
        """Hold ``stream`` (work queued after this point) until :meth:`release` of ``seq`` or later has run."""
        ...

    def worker_context(self) -> ContextManager[None]:
        """Entered once by the worker thread: the device and the worker stream current."""
        ...

    def follow(self, event: Any) -> None:
        """Order the worker stream's next work after ``event``."""
        ...

    def wait(self, event: Any) -> None:
        """Block the calling (worker) thread until ``event`` has completed."""
        ...

    def release(self, seq: int) -> None:
        """After everything queued on the worker stream, open the gates up to ``seq``."""
        ...


class _Driver:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` of the driver torch loaded."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u32, uint = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint
        self.wait_value = self._fn(lib, "cuStreamWaitValue32", [vp, ctypes.c_uint64, u32, uint])
        self.write_value = self._fn(lib, "cuStreamWriteValue32", [vp, ctypes.c_uint64, u32, uint])

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)  # _v2 since CUDA 11.7; the header maps to it
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn


_driver_lock = threading.Lock()
_driver: Optional[_Driver] = None
_driver_failure: Optional[str] = None


def _load_driver() -> _Driver:
    global _driver, _driver_failure
    with _driver_lock:
        if _driver is None and _driver_failure is None:
            if not torch.cuda.is_available():
                _driver_failure = "CUDA is not available to torch"
            else:
                try:
                    _driver = _Driver()
                except (OSError, AttributeError) as exc:
                    _driver_failure = f"the CUDA driver's stream memory operations are not loadable: {exc}"
    if _driver is None:
        raise RuntimeError(f"the submission worker needs cuStreamWaitValue32: {_driver_failure}")
    return _driver


def driver_unavailable_reason() -> str | None:
    """``None`` when gates can be built here, else why not (one line)."""
    try:
        _load_driver()
    except RuntimeError as exc:
        return str(exc)
    return None


class CudaGate:
    """Gates on one CUDA device: a flag word in device memory and the worker's own stream."""

    def __init__(self, device: torch.device) -> None:
        self._drv = _load_driver()
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
            self.stream = torch.cuda.Stream(self.device)
        self._addr = self.flag.data_ptr()

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed on {self.device} (CUresult {err})")

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def gate(self, stream: torch.cuda.Stream, seq: int) -> None:
        self._check(self._drv.wait_value(stream.cuda_stream, self._addr, seq, _CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32")

    @contextlib.contextmanager
    def worker_context(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def follow(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()  # torch releases the GIL while it waits

    def release(self, seq: int) -> None:
        err = self._drv.write_value(self.stream.cuda_stream, self._addr, seq, _CU_STREAM_WRITE_VALUE_DEFAULT)
        if err:  # the gate must open: a kernel write on the worker stream does it too
            logger.error("hicache submission worker: cuStreamWriteValue32 failed on %s (CUresult %d); opening "
                         "the gate with a kernel write", self.device, err)
            with torch.cuda.stream(self.stream):
                self.flag.fill_(seq - (1 << 32) if seq >= 1 << 31 else seq)  # the same 32 bits, as int32


class SubmitWorker:
    """One thread that runs transfer jobs in call order, each behind the caller's stream position and
    ahead of the caller's later work (see the module docstring).

    :param ops: the device side (:class:`CudaGate` on CUDA).
    :param name: names the thread and the log lines.
    """

    def __init__(self, ops: GateOps, name: str) -> None:
        self.ops = ops
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[int, Any, Callable[[Callable[[], None]], None]]] = queue.SimpleQueue()
        self._seq = 0
        self._submit_lock = threading.Lock()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished by the worker."""
        return self._pending

    def submit(self, stream: Any, job: Callable[[Callable[[], None]], None]) -> None:
        """Queue ``job`` behind the work queued on ``stream`` so far, and hold ``stream``'s later work
        until the worker has queued the job's copies and they have run.

        ``job(wait)`` runs on the worker thread with the worker stream current; it enqueues its
        work there (already ordered after the caller's event) and calls ``wait()`` first if it needs
        values the caller's earlier work produces on the host (index tensors read back).  Raises the
        error of an earlier failed job (:meth:`raise_pending`) before queueing anything.
        """
        self.raise_pending()
        with self._submit_lock:  # sequence order = queue order = gate order on every stream
            seq = (self._seq + 1) & _SEQ_MASK
            event = self.ops.record(stream)
            self.ops.gate(stream, seq)  # raises before anything is queued for the worker
            self._seq = seq
            with self._idle:
                self._pending += 1
            self._jobs.put((seq, event, job))
            self._start()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has been run by the worker (its copies queued, not finished);
        ``False`` on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def raise_pending(self) -> None:
        """Raise (once) the error of a job that failed since the last call."""
        with self._idle:
            err, self._error = self._error, None
        if err is not None:
            raise DeferredTransferError(
                f"{self.name}: a transfer handed to the submission worker failed after its call returned "
                f"({type(err).__name__}: {err}); it moved nothing it had not queued before the error, and "
                "its stream was released") from err

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        with self.ops.worker_context():
            while True:
                seq, event, job = self._jobs.get()
                try:
                    self.ops.follow(event)
                    job(functools.partial(self.ops.wait, event))
                except BaseException as exc:  # noqa: BLE001 - reported to the next call, never lost
                    logger.error("%s: transfer %d failed in the submission worker: %s", self.name, seq, exc)
                    with self._idle:
                        if self._error is None:
                            self._error = exc
                finally:
                    try:
                        self.ops.release(seq)
                    except BaseException:  # noqa: BLE001
                        logger.critical("%s: could not open gate %d; the caller's stream stays held", self.name,
                                        seq, exc_info=True)
                    with self._idle:
                        self._pending -= 1
                        self._idle.notify_all()
