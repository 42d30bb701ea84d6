"""Background threads that produce loader tasks ahead of the consumer, in order.

Worker ``w`` of ``n`` produces tasks ``w, w + n, w + 2n, ...`` into its own
bounded queue and the consumer reads the queues round-robin, so results come
back in task order without a reorder buffer. Closing (which happens when the
consuming generator is closed or garbage-collected, e.g. after ``break``) sets
a stop flag, drains the queues so no worker stays blocked, and joins the
threads. Threads are daemons, so even a worker stuck in user code never blocks
interpreter exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

__all__ = ["prefetch", "THREAD_PREFIX"]

THREAD_PREFIX = "mlx_train-data"
_END = object()  # a produce() that raised StopIteration: the stream is over
_JOIN_SECONDS = 2.0


class _Failure:
    """An exception raised in a worker, re-raised on the consumer thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _work(
    produce: Callable[[int], Any],
    tasks: range | Iterator[int],
    out: queue.Queue[Any],
    stop: threading.Event,
) -> None:
    for task in tasks:
        if stop.is_set():
            return
        try:
            item = produce(task)
        except StopIteration:
            item = _END
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, never swallowed
            item = _Failure(e)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if item is _END or isinstance(item, _Failure):
            return


def prefetch(
    produce: Callable[[int], Any], num_tasks: int | None, num_workers: int, depth: int = 2
) -> Generator[Any, None, None]:
    """Yield ``produce(0), produce(1), ...`` computed ahead on ``num_workers`` threads.

    ``num_tasks=None`` means "until ``produce`` raises StopIteration" and needs a
    single worker (the tasks then share an iterator and must run in order).

    Example::

        for result in prefetch(lambda k: k * k, num_tasks=10, num_workers=2):
            ...
    """
    if num_tasks is None and num_workers != 1:
        raise ValueError("an unbounded task stream needs exactly one worker")
    stop = threading.Event()
    queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=depth) for _ in range(num_workers)]
    threads = []
    for w in range(num_workers):
        tasks: Any = range(w, num_tasks, num_workers) if num_tasks is not None else _count()
        thread = threading.Thread(
            target=_work, args=(produce, tasks, queues[w], stop), name=f"{THREAD_PREFIX}-{w}", daemon=True
        )
        thread.start()
        threads.append(thread)
    try:
        task = 0
        while num_tasks is None or task < num_tasks:
            item = queues[task % num_workers].get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
            task += 1
    finally:
        stop.set()
        for q in queues:  # unblock workers waiting on a full queue
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for thread in threads:
            thread.join(timeout=_JOIN_SECONDS)


def _count() -> Iterator[int]:
    task = 0
    while True:
        yield task
        task += 1
