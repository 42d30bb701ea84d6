"""Timing collectives: all-reduce latency and bandwidth, and the gradient all-reduce of one step.

Example::

    group = mx.distributed.init()
    timing = time_all_sum(group, nbytes=8 * 2**20)     # AllReduceTiming(latency_s=..., bandwidth=...)
    timing.seconds_for(4 * 10**6)                        # estimated seconds to all-reduce 4 MB
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

BUCKET_BYTES = 32 * 2**20  # nn.average_gradients' default all_reduce_size


@dataclass(frozen=True)
class AllReduceTiming:
    """Median all-reduce latency (a 4-byte message) and algorithm bandwidth (bytes/s, large message)."""

    latency_s: float
    bandwidth: float
    world_size: int

    @property
    def bus_bandwidth(self) -> float:
        """The bandwidth each link carries in a ring all-reduce: ``2 (n-1) / n`` times the algorithm's."""
        n = self.world_size
        return self.bandwidth * 2 * (n - 1) / n if n > 1 else 0.0

    def seconds_for(self, nbytes: int) -> float:
        """Estimated time to all-reduce ``nbytes`` in ``average_gradients``' 32 MiB buckets."""
        if self.world_size == 1 or nbytes <= 0:
            return 0.0
        buckets = max(1, -(-nbytes // BUCKET_BYTES))
        return buckets * self.latency_s + nbytes / max(self.bandwidth, 1.0)


def _timed(fn: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_all_sum(group: Any, nbytes: int = 8 * 2**20, repeats: int = 5, small_repeats: int = 30) -> AllReduceTiming:
    """Measure ``all_sum`` on ``group`` (every rank must call this together)."""
    world = group.size()
    if world == 1:
        return AllReduceTiming(0.0, float("inf"), 1)
    small = mx.ones((1,), dtype=mx.float32)
    big = mx.ones((max(1, nbytes // 4),), dtype=mx.float32)
    mx.eval(small, big)

    def reduce(x: mx.array) -> Callable[[], None]:
        return lambda: mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))

    reduce(small)()  # warm up the connections
    latency = statistics.median(_timed(reduce(small), small_repeats))
    reduce(big)()
    seconds = statistics.median(_timed(reduce(big), repeats))
    bandwidth = big.nbytes / max(seconds - latency, 1e-9)
    return AllReduceTiming(latency, bandwidth, world)


def gradient_bytes(model: Any) -> int:
    """Bytes of the gradients of ``model``'s trainable parameters (what each step all-reduces)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))


def estimate_step_comm_seconds(model: Any, group: Any) -> float:
    """Estimated seconds one optimizer step spends all-reducing ``model``'s gradients on ``group``."""
    if group is None or group.size() == 1:
        return 0.0
    nbytes = gradient_bytes(model)
    timing = time_all_sum(group, nbytes=min(max(nbytes, 4096), 16 * 2**20), repeats=3, small_repeats=10)
    return timing.seconds_for(nbytes)
