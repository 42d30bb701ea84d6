"""A consumer of a DataLoader with worker processes that never finishes its epoch (for the no-orphan test).

Once it has a batch from each of its two workers (they take turns), so that both are at work, it prints
their pids on one line; the test then interrupts or kills this process.

    python process_loader_consumer.py
"""

from __future__ import annotations

import multiprocessing
import time

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

from mlx_train.data import DataLoader
from mlx_train.data.workers import PROCESS_PREFIX


class Slow:
    """Samples that take a while, so an epoch is still running when the signal comes."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> tuple:
        time.sleep(0.01)
        return [i, i + 1], i


if __name__ == "__main__":
    from process_loader_consumer import Slow as Importable  # pickled by module name, not as __main__.Slow

    loader = DataLoader(Importable(), batch_size=4, num_workers=2, worker_type="process")
    for k, _batch in enumerate(loader):
        if k == 1:  # batch 0 came from worker 0 and batch 1 from worker 1
            workers = [p.pid for p in multiprocessing.active_children() if p.name.startswith(PROCESS_PREFIX)]
            print(*workers, flush=True)
        time.sleep(0.05)
