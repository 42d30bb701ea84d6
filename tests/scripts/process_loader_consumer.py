"""A consumer of a DataLoader with worker processes that never finishes its epoch (for the no-orphan test).

Each worker writes a file named by its pid into the folder given on the command line when it
reads its first sample; the test then interrupts or kills this process.

    python process_loader_consumer.py FOLDER
"""

from __future__ import annotations

import os
import sys
import time

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

from mlx_train.data import DataLoader


class Slow:
    """Samples that take a while, so an epoch is still running when the signal comes."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> tuple:
        mark = os.path.join(self.folder, str(os.getpid()))
        if not os.path.exists(mark):
            open(mark, "w").close()
        time.sleep(0.01)
        return [i, i + 1], i


if __name__ == "__main__":
    from process_loader_consumer import Slow as Importable  # pickled by module name, not as __main__.Slow

    loader = DataLoader(Importable(sys.argv[1]), batch_size=4, num_workers=2, worker_type="process")
    for _batch in loader:
        time.sleep(0.05)
