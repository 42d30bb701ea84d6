"""Timing collectives: all-reduce latency and bandwidth, the gradient all-reduce of a data-parallel
step, and the collectives inside a tensor-parallel step.

Data parallelism (``estimate_step_comm_seconds``): a step all-reduces its gradients once; the time is
*estimated* at start-up from the gradient bytes and an all-reduce latency and bandwidth *measured* on
the group (``time_all_sum``).

Tensor parallelism (``StepCommunication``): the all-reduces run inside the model's forward and backward
passes (a split layer sums its output, or its input's gradient; the sharded adapters their rank-``r``
activations; the split vocabulary its lookup, gathered logits and log-softmax), so they depend on the model,
the batch shape, which inputs need a gradient, gradient checkpointing and accumulation. They are *counted
exactly*: every layer of a split model makes its collectives through one seam
(``distributed.collectives``: MLX's own functions, listed while a recording is active in the calling
context; nothing of MLX is replaced). The first time a micro-batch shape is seen, the step's own objective and
gradient (and, for the update, the reduction's vote and clipping norm) are traced once more, lazily and never
evaluated, inside ``recording_collectives``: every collective the step makes, with the shape and dtype of what
it moves. That list is then *replayed* on the group (the same operations on zero arrays of the same shapes,
one after the other, each evaluated before the next; the median of 3 replays, ``time_collectives``), and each
later step of that shape is charged the measured time. What is *estimated*: that the collectives take inside
the step what they take replayed alone (inside the step they may wait for a slower rank, or overlap and
compete with computation, which this does not see). Not counted: collectives a model's own code makes with
``mx.distributed`` directly (``distributed.tensor.untracked_modules`` names split layers of unknown types).
No per-step host work beyond reading the batch's shapes.

Example::

    group = mx.distributed.init()
    timing = time_all_sum(group, nbytes=8 * 2**20)     # AllReduceTiming(latency_s=..., bandwidth=...)
    timing.seconds_for(4 * 10**6)                        # estimated seconds to all-reduce 4 MB
    with recording_collectives() as seen:               # [Collective("all_sum", (8, 64, 576), float32), ...]
        loss_and_grad(model.trainable_parameters())      # a split model's step: built, not evaluated
    time_collectives(seen, group)                        # seconds to run them one after the other
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_train.distributed.collectives import Collective, all_sum, recording_collectives

__all__ = ["AllReduceTiming", "time_all_sum", "gradient_bytes", "estimate_step_comm_seconds", "Collective",
           "recording_collectives", "time_collectives", "StepComm", "StepCommunication"]

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
        return lambda: mx.eval(all_sum(x, group=group, stream=mx.cpu))

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


# -- the collectives of a tensor-parallel step ---------------------------------------------------


def time_collectives(collectives: Sequence[Collective], group: Any, repeats: int = 3) -> float:
    """Seconds to run ``collectives`` on ``group`` one after the other, each evaluated before the next (as
    in a step, where each waits for the computation before it): the median of ``repeats`` runs after one
    warm-up run. Every rank must call it with the same list. 0.0 for a group of one or an empty list.

    Example: ``time_collectives([Collective("all_sum", (4, 64, 576), mx.float32)] * 60, group)``
    """
    if group is None or group.size() == 1 or not collectives:
        return 0.0
    arrays = {(c.shape, c.dtype): mx.zeros(c.shape, dtype=c.dtype) for c in collectives}
    mx.eval(list(arrays.values()))
    calls = [(getattr(mx.distributed, c.op), arrays[c.shape, c.dtype]) for c in collectives]

    def replay() -> None:
        for function, x in calls:
            mx.eval(function(x, group=group, stream=mx.cpu))

    replay()
    return statistics.median(_timed(replay, repeats))


@dataclass(frozen=True)
class StepComm:
    """The communication of an optimizer step: ``seconds`` (timed, see ``StepCommunication``), the number of
    ``collectives`` and the ``nbytes`` given to them (all ranks give the same)."""

    seconds: float = 0.0
    collectives: float = 0.0
    nbytes: float = 0.0


def _shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    if hasattr(batch, "shape"):
        return (tuple(batch.shape),)
    values = batch.values() if isinstance(batch, dict) else batch
    return tuple(tuple(v.shape) for v in values)


class StepCommunication:
    """The collectives of a tensor-parallel run's steps, counted per micro-batch shape and timed on the group.

    ``install(step)`` observes a ``TrainStep``'s micro-batches: the first with a new (micro-batch shape,
    update, weighted) traces the step's objective and gradient once more with the collectives recorded
    (nothing evaluated; the step's state and random key are put back), and every call adds one to that
    shape's tally. ``per_step`` lists collectives made once per step outside the ``TrainStep`` (the memory
    guard's vote). ``window(steps)``, called by every rank at a report, times the collective lists not yet
    timed (``time_collectives``) and returns the mean ``StepComm`` of the ``steps`` steps since the last
    call. See the module docstring for what is measured and what is estimated.

    Example::

        comm = StepCommunication(group)
        guard.observe(comm)
        ...                                   # steps
        comm.window(steps=10).seconds         # time_comm
    """

    def __init__(self, group: Any, per_step: Sequence[Collective] = ()) -> None:
        self.group = group
        self.per_step = list(per_step)
        self.per_step_seconds: float | None = None
        #: The collectives of one micro-batch call, by (shapes, update, weighted).
        self.calls: dict[tuple[Any, ...], list[Collective]] = {}
        self.seconds: dict[tuple[Any, ...], float] = {}
        self.tally: dict[tuple[Any, ...], int] = {}

    def set_per_step(self, collectives: Sequence[Collective]) -> None:
        """The collectives made once per step outside the ``TrainStep`` (timed again when they change)."""
        if list(collectives) != self.per_step:
            self.per_step = list(collectives)
            self.per_step_seconds = None

    def install(self, step: Any) -> None:
        """Count the collectives of ``step``'s micro-batches (``step.observe``; the memory guard's ``observe``
        shows it the steps it rebuilds too)."""
        step.observe(self)

    def before_micro_batch(self, step: Any, batch: Any, update: bool, weighted: bool) -> None:
        """Trace a new (micro-batch shape, update, weighted) once; count every call."""
        key = (_shapes(batch), update, weighted)
        if key not in self.calls:
            self.calls[key] = self.record(step, batch, update, weighted)
        self.tally[key] = self.tally.get(key, 0) + 1

    def after_micro_batch(self, step: Any, batch: Any, result: Any, update: bool, weighted: bool) -> None:
        """Nothing: counted before."""

    def record(self, step: Any, batch: Any, update: bool, weighted: bool) -> list[Collective]:
        """The collectives one ``step.micro(batch, ..., update, weighted)`` makes: its objective's value and
        gradient, then (``update``) the reduction's; traced, never evaluated, and undone."""
        from mlx_train.snapshot import array_slots, rng_key, set_rng_key

        slots = array_slots(step.state, [])
        saved, key = [container[name] for container, name in slots], rng_key()
        reduction = step.reduction
        votes = dict(reduction.state) if reduction is not None and reduction.state is not None else None
        params = step.model.trainable_parameters()
        try:
            with recording_collectives() as seen:
                objective = step._objective  # the step's own: precision casts, loss scaling
                (_, (_, n_items, _)), grads = mx.value_and_grad(objective)(params, batch, weighted)
                if update and reduction is not None:
                    grads, _ = reduction.reduce(grads, n_items if weighted else None)
                    if reduction.clip is not None:
                        reduction.clip(grads, step.options.max_grad_norm)
        finally:
            step.model.update(params)
            for (container, name), value in zip(slots, saved, strict=True):
                container[name] = value
            if votes is not None:
                reduction.state.update(votes)
            set_rng_key(key)
        return list(seen)

    def window(self, steps: int) -> StepComm:
        """The mean communication per step of the ``steps`` steps since the last call (every rank must call
        it: collective lists seen for the first time are timed on the group now)."""
        for key in [k for k in self.calls if k not in self.seconds]:
            self.seconds[key] = time_collectives(self.calls[key], self.group)
        if self.per_step_seconds is None:
            self.per_step_seconds = time_collectives(self.per_step, self.group)
        tally, self.tally = self.tally, {}
        if steps <= 0:
            return StepComm()
        lists = [(self.calls[k], self.seconds[k], n) for k, n in tally.items()]
        lists.append((self.per_step, self.per_step_seconds, steps))
        return StepComm(seconds=sum(s * n for _, s, n in lists) / steps,
                        collectives=sum(len(c) * n for c, _, n in lists) / steps,
                        nbytes=sum(sum(x.nbytes for x in c) * n for c, _, n in lists) / steps)
