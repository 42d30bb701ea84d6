"""The link probe of ``mlx-train check-network``: runs on every rank, launched by ``mlx.launch``.

Every neighbouring pair of ranks plays ping-pong (latency, bandwidth), then the group times an
all-reduce; rank 0 writes the results as JSON for the launching process to read.

Example::

    mlx.launch -n 2 -- python -m mlx_train.distributed.probe /tmp/probe.json 8388608
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import mlx.core as mx


def _ping_pong(group: mx.distributed.Group, a: int, b: int, x: mx.array, repeats: int) -> float:
    """Median one-way time of ``x`` between ranks ``a`` and ``b`` (meaningful on rank ``a``)."""
    import mlx.core as mx

    rank, times = group.rank(), []
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == a:
            mx.eval(mx.distributed.send(x, b, group=group))
            mx.eval(mx.distributed.recv_like(x, b, group=group))
        elif rank == b:
            y = mx.distributed.recv_like(x, a, group=group)
            mx.eval(y)
            mx.eval(mx.distributed.send(y, a, group=group))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def probe(out: str, message_bytes: int) -> None:
    """Measure every neighbouring pair and the all-reduce; rank 0 writes the results to ``out``."""
    import mlx.core as mx

    import mlx_train  # noqa: F401  (the optimized BLAS first)
    from mlx_train.distributed.comm import time_all_sum

    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    pairs = [(i, (i + 1) % world) for i in range(world if world > 2 else 1)]
    small = mx.ones((1,), dtype=mx.float32)
    big = mx.ones((max(1, message_bytes // 4),), dtype=mx.float32)
    table = mx.zeros((len(pairs), 2), dtype=mx.float32)
    for k, (a, b) in enumerate(pairs):
        _ping_pong(group, a, b, small, 3)  # connect and warm up
        latency = _ping_pong(group, a, b, small, 30)
        seconds = _ping_pong(group, a, b, big, 5)
        if rank == a:
            table[k] = mx.array([latency, big.nbytes / max(seconds - latency, 1e-9)])
        mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))  # barrier before the next pair
    table = mx.distributed.all_sum(table, group=group, stream=mx.cpu)
    mx.eval(table)  # on every rank, before the next collective
    timing = time_all_sum(group, nbytes=message_bytes)
    if rank == 0:
        rows = cast("list[list[float]]", table.tolist())  # a (pairs, 2) float32 table
        result = {"world_size": world,
                  "links": [{"ranks": list(pair), "latency_s": row[0], "bandwidth": row[1]}
                            for pair, row in zip(pairs, rows, strict=False)],
                  "all_reduce": {"latency_s": timing.latency_s, "bandwidth": timing.bandwidth}}
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    probe(sys.argv[1], int(sys.argv[2]))
