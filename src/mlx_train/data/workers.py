"""Worker processes that read and collate batches, for datasets whose per-sample Python work holds the GIL.

``DataLoader(..., worker_type="process")`` runs ``dataset[i]`` and the collate function in
``num_workers`` processes started with ``spawn`` (never ``fork``: the parent holds MLX and BLAS
threads). The dataset and ``collate_fn`` are pickled once per worker; only batch indices go to a
worker and numpy batches come back. A batch of at least :data:`SHARED_MEMORY_MIN_BYTES` comes back
through one shared-memory block (the consumer copies it into ``mx.array`` and unlinks it); smaller
batches are pickled through the worker's pipe, which is cheaper for them.

Order: worker ``w`` of ``n`` produces batches ``w, w + n, ...`` in turn and the consumer reads the
workers round-robin, so batches come back in order without a reorder buffer, exactly as with
threads or without workers. At most ``depth`` batches per worker are asked for ahead.

Errors: an exception in a worker is re-raised in the consumer with its type and message, the note
naming the sample (as without workers) and a note holding the worker's traceback. A worker that
dies (a crash in native code, the out-of-memory killer) is reported with its exit code.

Lifetime: a :class:`WorkerPool` serves every epoch of its DataLoader (starting processes costs about
a second); an iteration abandoned part-way leaves its in-flight batches to be read and dropped by
the next one. ``DataLoader.close()``, garbage collection of the loader or interpreter exit close
the pool: each worker is asked to stop, then terminated and killed if it does not within a couple
of seconds, and joined. A worker that died or a broken pool is replaced at the next epoch.
Workers ignore SIGINT (Ctrl-C reaches the whole process group; the consumer decides), exit by
themselves when the consumer's end of their pipe closes (even if it was SIGKILLed), and are
daemons.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Generator
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from mlx_train.errors import DataError

from .collate import Batch, pad_collate

__all__ = ["read_batch", "WorkerPool", "PROCESS_PREFIX", "SHARED_MEMORY_MIN_BYTES", "START_METHOD"]

PROCESS_PREFIX = "mlx_train-data-process"
SHARED_MEMORY_MIN_BYTES = 1 << 20  # smaller batches are pickled through the pipe
START_METHOD = "spawn"
_STOP_SECONDS = 2.0
_POLL_SECONDS = 0.2
_ALIGN = 64


def read_batch(source: Any, collate_fn: Callable[[list[Any]], Batch] | None, index: np.ndarray | slice) -> Batch:
    """The batch of ``source`` at ``index`` as numpy arrays: gathered (arrays) or read and collated.

    Runs on the consumer, a prefetch thread or a worker process alike.
    Example: ``read_batch(make_source((x, y)), None, np.array([3, 1]))`` -> ``(x[[3, 1]], y[[3, 1]])``.
    """
    if collate_fn is None and hasattr(source, "gather"):
        return source.gather(index)
    samples = source.samples(index)
    if collate_fn is not None:
        return collate_fn(samples)
    where = range(index.start, index.stop) if isinstance(index, slice) else index.tolist()
    return pad_collate(samples, indices=where)


# ---------------------------------------------------------------- the worker side
def _serve(conn: Connection, job: bytes, worker: int, shared_min_bytes: int) -> None:
    """A worker's loop: receive ``(task, index)``, send back ``("ok", batch)`` or ``("error", ...)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        source, collate_fn = pickle.loads(job)
        broken: BaseException | None = None
    except BaseException as error:  # noqa: BLE001 - reported with the first task
        broken = error
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the consumer is gone
        if message is None:
            return
        task, index = message
        try:
            if broken is not None:
                raise broken
            reply = ("ok", _pack(read_batch(source, collate_fn, index), shared_min_bytes))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, never swallowed
            reply = ("error", _failure(error, worker, task))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            _release(reply)
            return


def _failure(error: BaseException, worker: int, task: int) -> tuple[bytes | None, str]:
    """The exception, pickled when it can be (with the worker's traceback as a note), and as text."""
    where = f"in data worker process {worker} while producing batch {task} of this iteration"
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    text = f"{type(error).__name__}: {error} ({where})\nworker traceback:\n{trace}"
    if hasattr(error, "add_note"):
        error.add_note(f"raised {where}; worker traceback:\n{trace.rstrip()}")
    try:
        return pickle.dumps(error), text
    except Exception:  # noqa: BLE001 - an exception that cannot be pickled travels as text
        return None, text


def _leaves(batch: Any) -> list[np.ndarray]:
    if isinstance(batch, (tuple, list)):
        return [leaf for v in batch for leaf in _leaves(v)]
    if isinstance(batch, dict):
        return [leaf for v in batch.values() for leaf in _leaves(v)]
    return [batch] if isinstance(batch, np.ndarray) else []


def _pack(batch: Batch, shared_min_bytes: int) -> Any:
    """``batch`` as is (pickled by the pipe), or its arrays moved into one shared-memory block."""
    arrays = _leaves(batch)
    total = sum(-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays)
    if not arrays or total < shared_min_bytes or any(a.dtype.hasobject for a in arrays):
        return ("inline", batch)
    block = SharedMemory(create=True, size=max(total, 1))
    try:
        offset, places = 0, {}
        for a in arrays:
            view = np.ndarray(a.shape, dtype=a.dtype, buffer=block.buf, offset=offset)
            view[...] = a
            places[id(a)] = (offset, a.shape, a.dtype.str)
            offset += -(-a.nbytes // _ALIGN) * _ALIGN
            del view  # no view may outlive the block
        return ("shared", block.name, _replace(batch, lambda a: ("shared", *places[id(a)])))
    finally:
        block.close()


def _replace(batch: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(batch, tuple):
        return tuple(_replace(v, fn) for v in batch)
    if isinstance(batch, list):
        return [_replace(v, fn) for v in batch]
    if isinstance(batch, dict):
        return {k: _replace(v, fn) for k, v in batch.items()}
    return fn(batch) if isinstance(batch, np.ndarray) else batch


# ---------------------------------------------------------------- the consumer side
def _unpack(packed: Any, convert: Callable[[Batch], Batch]) -> Batch:
    """A packed batch through ``convert`` (which must copy, as ``to_mx`` does); shared memory is then freed."""
    if packed[0] == "inline":
        return convert(packed[1])
    _, name, layout = packed
    block = SharedMemory(name=name)
    try:
        def view(leaf: Any) -> Any:
            if isinstance(leaf, tuple) and len(leaf) == 4 and leaf[0] == "shared":
                _, offset, shape, dtype = leaf
                return np.ndarray(shape, dtype=np.dtype(dtype), buffer=block.buf, offset=offset)
            return leaf

        return convert(_restore(layout, view))
    finally:
        try:
            block.close()
        except BufferError:  # a view is still referenced (convert raised): the memory goes with it
            pass
        block.unlink()


def _restore(layout: Any, view: Callable[[Any], Any]) -> Any:
    if isinstance(layout, tuple) and len(layout) == 4 and layout[0] == "shared":
        return view(layout)
    if isinstance(layout, tuple):
        return tuple(_restore(v, view) for v in layout)
    if isinstance(layout, list):
        return [_restore(v, view) for v in layout]
    if isinstance(layout, dict):
        return {k: _restore(v, view) for k, v in layout.items()}
    return layout


def _release(reply: Any) -> None:
    """Free the shared memory of a reply that will not be used."""
    if isinstance(reply, tuple) and reply[0] == "ok" and reply[1][0] == "shared":
        try:
            block = SharedMemory(name=reply[1][1])
            block.close()
            block.unlink()
        except FileNotFoundError:
            pass


def _job(source: Any, collate_fn: Any) -> bytes:
    """The dataset and collate function, pickled once for all workers (with a clear error if they cannot be)."""
    try:
        return pickle.dumps((source, collate_fn))
    except Exception as error:  # noqa: BLE001 - pickling raises many types
        raise DataError(
            f"worker_type='process' sends the dataset ({type(getattr(source, 'dataset', source)).__name__}) and "
            f"collate_fn to each worker process by pickling, and that failed: {type(error).__name__}: {error}; "
            "define the dataset class and collate function at module level (not lambdas or local classes), "
            "or use worker_type='thread'"
        ) from None


class WorkerPool:
    """``num_workers`` spawned processes that read and collate batches of one dataset, each with its own pipe.

    The pool outlives an iteration (a DataLoader keeps it for its next epochs); :meth:`close` stops it.
    Example::

        pool = WorkerPool(make_source(dataset), None, num_workers=2)
        for batch in pool.batches(lambda k: np.arange(4 * k, 4 * k + 4), 10, to_mx):
            ...
        pool.close()
    """

    def __init__(self, source: Any, collate_fn: Callable[[list[Any]], Batch] | None, num_workers: int) -> None:
        job = _job(source, collate_fn)
        context: Any = multiprocessing.get_context(START_METHOD)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.waiting = [0] * num_workers  # tasks asked of each worker and not yet answered
        self.broken = False
        try:
            for w in range(num_workers):
                ours, theirs = context.Pipe(duplex=True)
                proc = context.Process(target=_serve, args=(theirs, job, w, SHARED_MEMORY_MIN_BYTES),
                                       name=f"{PROCESS_PREFIX}-{w}", daemon=True)
                self.conns.append(ours)
                self.procs.append(proc)
                proc.start()
                theirs.close()  # so the consumer sees EOF when the worker dies
        except BaseException:
            self.close()
            raise

    @property
    def usable(self) -> bool:
        """Whether every worker is alive and answering."""
        return not self.broken and bool(self.procs) and all(p.is_alive() for p in self.procs)

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [int(p.pid) for p in self.procs]

    def batches(self, index_of: Callable[[int], Any], num_tasks: int, convert: Callable[[Batch], Batch],
                depth: int = 2) -> Generator[Batch, None, None]:
        """Yield ``convert(batch k)`` for ``k < num_tasks`` in order, ``depth`` batches per worker ahead."""
        self._settle()
        n = len(self.conns)
        ahead = depth * n
        for task in range(min(ahead, num_tasks)):
            self._ask(task % n, task, index_of(task))
        for task in range(num_tasks):
            kind, payload = self._answer(task % n, task)
            if kind == "error":
                _raise(*payload)
            if task + ahead < num_tasks:
                self._ask(task % n, task + ahead, index_of(task + ahead))
            yield _unpack(payload, convert)

    def _ask(self, w: int, task: int, index: Any) -> None:
        self.conns[w].send((task, index))
        self.waiting[w] += 1

    def _answer(self, w: int, task: int) -> Any:
        """The next reply of worker ``w`` (a worker answers in the order it was asked)."""
        conn, proc = self.conns[w], self.procs[w]
        while True:
            try:
                if conn.poll(_POLL_SECONDS):
                    reply = conn.recv()
                    self.waiting[w] -= 1
                    return reply
            except (EOFError, OSError):
                proc.join(_POLL_SECONDS)
            except BaseException:
                self.broken = True  # interrupted inside recv: the pipe may hold half a message
                raise
            if not proc.is_alive():
                code = proc.exitcode
                self.close()  # the other workers are of no use without this one
                raise DataError(
                    f"data worker process {w} (pid {proc.pid}) ended with exit code {code} while producing "
                    f"batch {task} of this iteration (killed for memory? a crash in native code?); with "
                    "worker_type='process' a script must start from an `if __name__ == \"__main__\":` block; run "
                    "with num_workers=0 to see the failure in this process"
                )

    def _settle(self) -> None:
        """Read and free the replies an abandoned iteration left in flight."""
        for w, waiting in enumerate(self.waiting):
            for _ in range(waiting):
                _release(self._answer(w, -1))

    def close(self) -> None:
        """Stop every worker: ask, wait a little, then terminate and kill; free unread shared memory."""
        self.broken = True
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + _STOP_SECONDS
        for conn, proc in zip(self.conns, self.procs, strict=False):
            if proc.pid is not None:
                self._drain(conn, proc, deadline)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(_STOP_SECONDS)
                if proc.is_alive():
                    proc.kill()
                proc.join()
            conn.close()
        self.conns, self.procs = [], []

    @staticmethod
    def _drain(conn: Connection, proc: Any, deadline: float) -> None:
        """Read (and free) replies until the worker exits or the deadline passes."""
        try:
            while proc.is_alive() and time.monotonic() < deadline:
                if conn.poll(0.05):
                    _release(conn.recv())
            while conn.poll(0):
                _release(conn.recv())
        except (EOFError, OSError, ValueError):
            pass


def _raise(pickled: bytes | None, text: str) -> None:
    error: BaseException | None = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - fall back to the text
            error = None
    if isinstance(error, BaseException):
        raise error
    raise DataError(f"a data worker process failed: {text}")
