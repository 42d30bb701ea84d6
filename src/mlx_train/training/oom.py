"""Out of memory: recognising MLX's allocation failures, and recovering from them in the Trainer.

MLX reports a failed allocation as a ``RuntimeError`` whose text names the allocator
(``[malloc] Unable to allocate ...`` on the CPU, ``[metal::malloc] ...`` on Apple GPUs,
``... failed: out of memory`` from CUDA); ``is_out_of_memory`` recognises them all.

``MemoryGuard`` runs the Trainer's optimizer steps. When a step runs out of memory it puts the
model, optimizer and random state back as they were before the step (nothing of a failed step is
applied) and retries the **same** step batch with half the micro-batch and twice the
accumulation, so the effective batch and the result stay the same; at a micro-batch of one it
turns on gradient checkpointing; only then does it fail, with an ``OutOfMemoryError`` that says
what to try.

With a memory budget (``memory_limit``) the first step already keeps to it: before it, real steps at
micro-batches 1, 2, 4, ... (each undone) measure how the step's memory grows, stopping before one
that would not fit, and the guard starts from the largest micro-batch (same effective batch) that
this line says fits. Then the first step of each batch shape and settings is measured, and one over
the budget is treated as above (that step is kept: it did finish). Decisions come only from such
first steps, measured as the growth over the memory held before them plus what the run held when
it started, which identical runs measure alike (later steps of a shape vary by the order in which
MLX frees buffers): two identical runs shrink at the same step, and the checkpoint records what
was measured, so a resumed run takes the same decisions.

A step can be undone when the guard kept the state of before it. Keeping it costs a little (MLX
cannot update those buffers in place), so the guard keeps it where running out of memory is
plausible: the first ``WARMUP`` steps of each batch shape and settings (a step's memory is first
reached there), after a step that used more than half of the device's memory, and for every step
once memory has proved tight, when ``memory_limit`` is set, or in a distributed run. A failure
anywhere else (a shape that already ran well within memory: another process took it) ends with
advice instead.

In a distributed run all ranks take the same decision. In data parallelism the ranks vote in the
step's own all-reduce (``distributed.reduction.Votes``): a rank whose step ran out of memory before
the all-reduce joins it with zero gradients and its vote, the others then skip their update, and every
rank retries the step with the same smaller micro-batch. What is known only after the update (a rank
that ran out of memory after the all-reduce, a peak over the budget) the ranks compare in a small
all-reduce of their own, on the steps that some rank asks to check: where running out of memory is
plausible (as above) and measured steps. A step no rank asked to check makes no collective besides its
all-reduce and one host read of the votes (already evaluated by then); running out of memory after its
all-reduce ends the run with advice (the other ranks applied the step). With tensor parallelism and FSDP,
whose all-reduces carry no such vote, the ranks compare after every step.

Example::

    trainer = Trainer(model, optimizer, batch_size=64, memory_limit="8GB")
    trainer.train(data)                 # settles on the micro-batch that stays under 8 GB
    trainer.memory_guard.events         # [{"step": 1, "batch_size": 32, "gradient_accumulation": 2, ...}]
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from mlx_train.device import format_bytes
from mlx_train.distributed import collectives
from mlx_train.distributed.topology import any_rank
from mlx_train.errors import MLXTrainError, OutOfMemoryError
from mlx_train.snapshot import array_slots as array_slots
from mlx_train.snapshot import set_rng_key
from mlx_train.training.losses import batch_size_of
from mlx_train.training.step import ANOTHER_RANK

if TYPE_CHECKING:
    from mlx_train.distributed.reduction import Votes
    from mlx_train.training.step import StepObserver

__all__ = ["is_out_of_memory", "out_of_memory", "any_rank", "MemoryGuard", "MemoryPolicy", "CPU_MESSAGE",
           "METAL_MESSAGE", "CUDA_MESSAGE"]

#: What MLX's allocators say when an allocation fails (examples; ``mlx_train.testing`` raises them).
CPU_MESSAGE = "[malloc] Unable to allocate 17179869184 bytes."
METAL_MESSAGE = ("[metal::malloc] Attempting to allocate 68719476736 bytes which is greater than the maximum "
                 "allowed buffer size of 34359738368 bytes.")
CUDA_MESSAGE = "cudaMallocAsync(&data, size, stream) failed: out of memory"

_MARKERS = (
    "[malloc] unable to allocate", "[malloc_or_wait] unable to allocate", "[metal::malloc]", "[cuda::malloc]",
    "out of memory", "outofmemory", "insufficient memory", "cudaerrormemoryallocation", "alloc_failed",
    "cannot allocate memory", "bad_alloc",
)


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocation failure (MLX's CPU, Metal or CUDA message, or Python's MemoryError).

    Example::

        is_out_of_memory(RuntimeError("[metal::malloc] Resource limit (499000) exceeded."))   # True
    """
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in _MARKERS)


@contextlib.contextmanager
def out_of_memory(where: str, advice: str) -> Iterator[None]:
    """Turn an allocation failure inside the block into ``OutOfMemoryError`` saying where and what to do.

    Example::

        with out_of_memory("evaluation", "lower eval_batch_size"):
            metrics = trainer.evaluate(test_data)
    """
    try:
        yield
    except MLXTrainError:
        raise
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        raise OutOfMemoryError(f"out of memory during {where}: {error}. To fix: {advice}") from error


#: Steps of each batch shape (and settings) that keep the state to undo them: the first run
#: compiles, the second is the first at steady memory.
WARMUP = 2

#: The state arrays and random key of before a step (what undoing it puts back).
_Saved = tuple[list[Any], mx.array]


def _shape(batch: Any) -> tuple[Any, ...]:
    """The shape of a batch's first array: steps of the same shape need the same memory."""
    return cast("tuple[Any, ...]", (next(iter(batch.values())) if isinstance(batch, dict) else batch[0]).shape)


@dataclass
class MemoryPolicy:
    """What the guard may do: ``recover`` (shrink and retry) and ``budget`` (bytes a step may peak at).

    ``device_memory`` (bytes, when known) sets when memory counts as tight: above half of it the guard
    keeps the state to undo every step. ``can_checkpoint`` says whether gradient checkpointing is a
    step down left to take.
    """

    recover: bool = True
    budget: int | None = None
    device_memory: int | None = None
    can_checkpoint: bool = False


class MemoryGuard:
    """Runs optimizer steps and recovers from running out of memory.

    ``build(accumulation, checkpointing) -> step`` makes a step function (``running = step(state,
    batch)``); the guard wraps it: ``running = guard(state, batch)``. When a step runs out of
    memory the guard puts the step's state back, builds a step with twice the accumulation (or
    gradient checkpointing) and retries the same batch. The settings it runs with are ``settings()``
    (the loop's owner records them in the loop state for a checkpoint; the guard only reads that state);
    ``events`` lists every change and why. ``observe(observer)`` shows every micro-batch of its steps,
    rebuilt ones included, to a ``StepObserver``.

    Example::

        guard = MemoryGuard(lambda acc, ckpt: build_step(...), accumulation=1, policy=MemoryPolicy())
        state.advance(guard(state, batch), samples)
    """

    #: The in-step callbacks its steps were built with (set by the Trainer that builds it).
    extensions: tuple[Any, ...]

    def __init__(self, build: Callable[[int, bool], Any], accumulation: int, policy: MemoryPolicy,
                 group: Any = None, log: Callable[[str], None] = print, settings: dict[str, Any] | None = None) -> None:
        settings = settings or {}
        self.build, self.policy, self.log = build, policy, log
        self.base_accumulation = accumulation
        self.split = int(settings.get("split", 1))
        self.checkpointing = bool(settings.get("gradient_checkpointing", False))
        self.step_batch: int | None = settings.get("step_batch")
        self.events: list[dict[str, Any]] = list(settings.get("events", []))
        # Under a budget: the plan before the first step is made once; the memory the run held when it
        # started; the (shape, settings) whose first step was measured.
        self.planned = bool(settings.get("planned", False))
        self.resident: int | None = settings.get("resident")
        self.checked: list[str] = list(settings.get("checked", []))
        voting = group is not None and group.size() > 1 and (policy.recover or policy.budget is not None)
        self.group = group if voting else None
        self.observers: list[StepObserver] = []  # shown every micro-batch of every step it builds
        memory = policy.budget or policy.device_memory
        self._tight_above = memory / 2 if memory else 0
        self._tight = False
        # Always ready to undo a step: with a budget (memory matters more than a few microseconds) and
        # when distributed (a rank must be able to undo a step that failed on another before the all-reduce).
        self._always = policy.budget is not None or self.group is not None
        self.step: Any = None
        self._bind()

    # -- the hot path -------------------------------------------------------------------

    def __call__(self, state: Any, batch: Any) -> dict[str, Any]:
        # Keeping the state of before the step lets a failed step be undone, but costs a little on
        # every step (MLX cannot update those buffers in place), so it is kept only where running out
        # of memory is plausible: the first steps of each batch shape and settings, steps after ones
        # that used over half the memory there is, and every step once memory has proved tight.
        if not self.planned and (self.policy.budget is not None or self.group is not None):
            self._plan(state, batch)
        if not (self._always or self._plausible(batch)):
            try:  # the common case: a known shape well within memory, no budget, no group to vote with
                result = self.step(state, batch)
            except MLXTrainError:
                raise
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                self._stand_in()
                raise self._not_undoable(state, str(error)) from error
            self._tight = mx.get_peak_memory() > self._tight_above
            return result  # type: ignore[no-any-return]  # the step's running sums
        saved = [container[name] for container, name in self._slots], mx.random.state[0]  # type: ignore[index]
        try:
            result, failure = self._attempt(state, batch, saved)
            while failure is not None:  # (the state of before the step is back)
                self._shrink(state, batch, failure)
                result, failure = self._attempt(state, batch, saved)
        except BaseException:
            # Any failure (a bad batch, an interrupted trace) leaves the state as before the step: a
            # failed first trace would otherwise leave placeholders in the model and MLX's random state.
            self._restore(saved, strict=False)
            raise
        shape = batch[0].shape if type(batch) is tuple else _shape(batch)
        self._runs[shape] = self._runs.get(shape, 0) + 1
        self._tight = mx.get_peak_memory() > self._tight_above
        return result  # type: ignore[return-value]  # not None: the loop ends on a step that ran

    def _plausible(self, batch: Any) -> bool:
        """Whether running out of memory is plausible in this step: the first ``WARMUP`` steps of its shape with
        these settings, after a step that used over half the memory there is, once memory proved tight."""
        shape = batch[0].shape if type(batch) is tuple else _shape(batch)
        return self._runs.get(shape, 0) < WARMUP or self._tight or bool(self.events)

    def _attempt(self, state: Any, batch: Any, saved: _Saved) -> tuple[dict[str, Any] | None, str | None]:
        """Run the step once: ``(running, None)``, or ``(None, why)`` when it ran out of memory here or,
        in a distributed run, on any rank (the state of before the step is then back). A step over the
        budget is kept, and the next ones shrink.

        Distributed, the ranks agree in the step's own all-reduce (``Votes``) when a rank's step failed before
        it; a failure after it, or a peak over the budget, is known only after the update: the ranks compare
        those in a small all-reduce of their own, on the steps that some rank asked to check (where running out
        of memory is plausible, or a step is measured), and on every step where the all-reduce carries no
        votes (tensor parallelism, FSDP)."""
        budget = self.policy.budget
        key = f"{_shape(batch)} x{self.accumulation}{' checkpointed' if self.checkpointing else ''}"
        measured = budget is not None and key not in self.checked
        before = self._measure_from() if measured else 0
        votes = self._votes
        if votes is not None and self.group is not None:  # whether the ranks check this step after its update
            votes.cast(out_of_memory=False, check_after=measured or self._plausible(batch))
        try:
            result, failure = self.step(state, batch), None
        except MLXTrainError:
            raise
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            result, failure = None, str(error)  # leaving the except block drops the failed step's arrays
        counts = votes.summed() if votes is not None and self.step.exchanged else None
        if failure is not None:
            self._restore(saved)  # nothing of the failed attempt stays applied
            mx.clear_cache()
            if votes is not None and counts is None:
                counts = self._stand_in()
        peak = 0
        if measured and failure is None:
            peak = mx.get_peak_memory() - before + (self.resident or 0)
            self.checked.append(key)
        over = here = peak > (budget or 0)
        checked = counts is None or (counts["check_after"] > 0 and not counts["out_of_memory"])
        if self.group is not None and checked:
            over, failed = self._vote(here, failure is not None)
            if failed and failure is None:
                self._restore(saved)
                result, failure = None, ANOTHER_RANK
        elif self.group is not None and failure is not None and counts is not None and not counts["out_of_memory"]:
            raise self._after_all_reduce(state, failure)  # failed after the all-reduce, which others applied
        if over and failure is None:
            reason = (f"peak memory {format_bytes(int(peak))} is over the memory_limit budget of "
                      f"{format_bytes(budget or 0)}" if here else "another rank went over its memory_limit")
            self._shrink(state, batch, reason, kept=True)
        return result, failure

    def _stand_in(self) -> dict[str, int] | None:
        """After this rank's step failed before its all-reduce: join the other ranks' all-reduce with the failure
        (``TrainStep.stand_in``); returns the summed votes (None without votes in the all-reduce)."""
        if self._votes is None or self.step.exchanged:
            return None
        self.step.stand_in()
        return self._votes.summed()

    def _vote(self, over: bool, failed: bool) -> tuple[bool, bool]:
        """(any rank over its budget, any rank out of memory): one small all_sum across the group."""
        votes = collectives.all_sum(mx.array([int(over), int(failed)], dtype=mx.int32),
                                    group=self.group, stream=mx.cpu).tolist()
        return votes[0] > 0, votes[1] > 0  # type: ignore[index,operator]  # a list of two ints

    # -- settings -----------------------------------------------------------------------

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step now (the configured accumulation times the splits)."""
        if self.step_batch is None:
            return self.base_accumulation * self.split
        return min(self.base_accumulation * self.split, self.step_batch)

    @property
    def budget(self) -> int | None:
        """The memory budget in bytes (``memory_limit``), or None."""
        return self.policy.budget

    @property
    def batch_size(self) -> int | None:
        """The micro-batch now (per device); None before the first step of a run without a known batch."""
        if self.step_batch is None:
            return None
        return math.ceil(self.step_batch / self.accumulation)

    def settings(self) -> dict[str, Any]:
        """What the loop state records (and a resume starts from)."""
        return {"split": self.split, "gradient_checkpointing": self.checkpointing, "step_batch": self.step_batch,
                "batch_size": self.batch_size, "gradient_accumulation": self.accumulation, "events": self.events,
                "planned": self.planned, "resident": self.resident, "checked": list(self.checked)}

    def _bind(self) -> None:
        """(Re)build the step function for the current settings."""
        self.step = self.build(self.accumulation, self.checkpointing)
        self._slots = array_slots(self.step.state, [])
        votes = self.step.votes  # the ranks' votes in its all-reduce, when they include running out of memory
        self._votes: Votes | None = votes if votes is not None and "out_of_memory" in votes.names else None
        self._runs: dict[tuple[Any, ...], int] = {}  # completed steps per batch shape, with these settings
        for observer in self.observers:
            self.step.observe(observer)

    def observe(self, observer: StepObserver) -> None:
        """Show every micro-batch of the steps it runs (and of those it rebuilds later) to ``observer``."""
        if observer not in self.observers:
            self.observers.append(observer)
        self.step.observe(observer)

    # -- the budget ---------------------------------------------------------------------

    def _measure_from(self) -> int:
        """Start measuring a step: reset MLX's peak counter; returns the memory held now."""
        if self.resident is None:
            self.resident = mx.get_active_memory()
        mx.reset_peak_memory()
        return mx.get_active_memory()

    def _plan(self, state: Any, batch: Any) -> None:
        """Before the first step under a budget: start from the largest micro-batch expected to fit. In a
        distributed run every rank plans when any has a budget, and all take the smallest micro-batch."""
        self.planned = True
        if self.group is not None and not any_rank(self.policy.budget is not None, self.group):
            return
        floor = _held_bytes(self.step)
        below = self.policy.budget is not None and self.policy.budget < sum(floor.values())
        if (any_rank(below, self.group) if self.group is not None else below):  # every rank votes
            raise self._below_floor(floor) if below else OutOfMemoryError(
                "another rank's memory_limit is below what training holds at any micro-batch (see its message)")
        full = math.ceil(batch_size_of(batch) / self.accumulation)
        points = self._probe(batch, full)
        budget = self.policy.budget or math.inf
        grad_sum = _trainable_bytes(self.step)  # the running gradient sum, once micro-batches add up

        def expected(size: int, accumulation: int) -> float:
            (b0, p0), (b1, p1) = (points[-2] if len(points) > 1 else (0, points[-1][1])), points[-1]
            slope = max((p1 - p0) / (b1 - b0), 0.0) if b1 > b0 else 0.0
            return p1 + slope * (size - b1) + (grad_sum if accumulation > 1 else 0)

        split, size = 1, full
        while size > 1 and expected(size, self.accumulation * split) > budget:
            split, size = split * 2, math.ceil(full / (split * 2))
        mine, split = split, _largest(split, self.group)
        if split == 1:
            return
        self.step_batch, self.split = batch_size_of(batch), self.split * split
        self._bind()
        reason = (f"the memory model measured before the first step expects micro-batch {full} to peak at "
                  f"{format_bytes(int(expected(full, self.base_accumulation)))}, over the memory_limit budget "
                  f"of {format_bytes(int(budget))}" if mine == split else
                  "another rank went over its memory_limit (by the memory model measured before the first step)")
        self.events.append({"step": state.step + 1, "reason": reason, "batch_size": self.batch_size,
                            "gradient_accumulation": self.accumulation,
                            "gradient_checkpointing": self.checkpointing})
        self.log(f"{reason}; starting with micro-batch {self.batch_size} x accumulation {self.accumulation} "
                 "(same effective batch)")

    def _probe(self, batch: Any, full: int) -> list[tuple[int, float]]:
        """(micro-batch, expected peak) of real first steps at micro-batches 1, 2, 4, ... below ``full``,
        each undone; it stops before one that the growth so far says would not fit."""
        probe = self.build(1, self.checkpointing)
        slots = array_slots(probe.state, [])
        saved, key = [container[name] for container, name in slots], mx.random.state[0]  # type: ignore[index]
        points: list[tuple[int, float]] = []
        size, budget = 1, self.policy.budget or math.inf
        try:
            while True:
                before = self._measure_from()
                probe(types.SimpleNamespace(running=probe.zero_running()), _head(batch, size))
                points.append((size, mx.get_peak_memory() - before + (self.resident or 0)))
                following = min(2 * size, full)
                (b0, p0), (b1, p1) = points[-2] if len(points) > 1 else points[-1], points[-1]
                growth = (p1 - p0) / (b1 - b0) if b1 > b0 else 0.0
                stop = following == size or points[-1][1] + 2 * max(growth, 0.0) * (following - size) > budget
                if any_rank(stop, self.group):
                    break
                size = following
        finally:
            for (container, name), value in zip(slots, saved, strict=False):
                container[name] = value
            set_rng_key(key.tolist())
            del probe
            mx.clear_cache()
        return points

    # -- recovery -----------------------------------------------------------------------

    def _not_undoable(self, state: Any, failure: str) -> OutOfMemoryError:
        return OutOfMemoryError(
            f"out of memory at step {state.step + 1} ({failure}), although steps of this shape ran before "
            "(did another process take memory?); the step was not prepared to be undone. Resume from the last "
            "checkpoint, and set memory_limit below the free memory so the Trainer shrinks the micro-batch "
            "before running out")

    def _restore(self, saved: _Saved, strict: bool = True) -> None:
        """Put back the state arrays and random key of before the step: nothing of the failed step stays applied."""
        arrays, key = saved
        current = array_slots(self.step.state, [])
        same = len(current) == len(self._slots) and all(
            a[0] is b[0] and a[1] == b[1] for a, b in zip(current, self._slots, strict=False))
        if not same and not strict:
            set_rng_key(key.tolist())  # type: ignore[arg-type]  # a uint32 key: a list of ints
            return
        if not same:
            raise OutOfMemoryError(
                "out of memory in a training step, and the model or optimizer state was restructured since "
                "the run started, so the step cannot be undone safely; resume from the last checkpoint with a "
                "smaller batch_size (or set memory_limit so the Trainer adapts before running out)")
        for (container, name), value in zip(self._slots, arrays, strict=False):
            container[name] = value
        set_rng_key(key.tolist())  # type: ignore[arg-type]  # mx.random.state is not a list: reseed to the same key

    def _after_all_reduce(self, state: Any, failure: str) -> OutOfMemoryError:
        return OutOfMemoryError(
            f"out of memory at step {state.step + 1} on this rank after the step's all-reduce ({failure}): the "
            "other ranks applied the step and went on, so it cannot be undone (the ranks compare this after the "
            "update only on a shape's first steps, once memory is tight or ran out, and on measured steps). "
            "Resume from the last checkpoint, and set memory_limit below the free memory so that every rank "
            "shrinks the micro-batch before running out")

    def _shrink(self, state: Any, batch: Any, reason: str, kept: bool = False) -> None:
        """Take the next step down: half the micro-batch, else checkpointing, else fail."""
        self.step_batch = batch_size_of(batch)
        step = state.step + 1
        if not self.policy.recover:
            raise self._failure(reason, step, "oom_recovery is off")
        if (self.batch_size or 1) > 1:
            self.split *= 2
            change = f"micro-batch {self.batch_size} x accumulation {self.accumulation} (same effective batch)"
        elif not self.checkpointing and self.policy.can_checkpoint:
            self.checkpointing = True
            change = "gradient checkpointing on"
        else:
            raise self._failure(reason, step, "micro-batch 1 with gradient checkpointing"
                                if self.checkpointing else "micro-batch 1 (this model cannot checkpoint)")
        self._bind()
        self.events.append({"step": step, "reason": reason, "batch_size": self.batch_size,
                            "gradient_accumulation": self.accumulation,
                            "gradient_checkpointing": self.checkpointing})
        if kept:
            self.log(f"step {step} went over the memory budget ({reason}); the step is kept, the next ones use "
                     f"{change}")
        else:
            self.log(f"out of memory at step {step} ({reason}); retrying the same step with {change}")

    def _below_floor(self, floor: dict[str, int]) -> OutOfMemoryError:
        """The budget is below what is held at every micro-batch: refused before the first step."""
        held = ", ".join(f"{what} {format_bytes(size)}" for what, size in floor.items())
        lines = [f"the memory_limit budget of {format_bytes(self.policy.budget)} is below what training holds at any "
                 f"micro-batch, {format_bytes(sum(floor.values()))} ({held}), before any activation: no split of "
                 "the batch can fit it. What to try:"]
        lines += [f"  - {tip}" for tip in _advice(self.step, self.policy.budget)[1:] if "activation" not in tip]
        return OutOfMemoryError("\n".join(lines))

    def _failure(self, reason: str, step: int, tried: str) -> OutOfMemoryError:
        lines = [f"out of memory at step {step}: {reason}; tried down to {tried}. What to try:"]
        lines += [f"  - {tip}" for tip in _advice(self.step, self.policy.budget)]
        return OutOfMemoryError("\n".join(lines))


def _largest(value: int, group: Any = None) -> int:
    """The largest ``value`` over the ranks of ``group`` (every rank must call it); ``value`` alone."""
    if group is None or group.size() == 1:
        return value
    values = collectives.all_gather(mx.array([value], dtype=mx.int32), group=group, stream=mx.cpu)
    return int(values.max().item())  # type: ignore[arg-type]  # an int32 scalar


def _head(batch: Any, size: int) -> Any:
    """The first ``size`` samples of a batch (tuple, list or dict of arrays)."""
    if isinstance(batch, dict):
        return {k: v[:size] for k, v in batch.items()}
    return type(batch)(v[:size] for v in batch)


def _trainable_bytes(step: Any) -> int:
    """Bytes of the trainable parameters: what a float32 gradient sum takes."""
    from mlx.utils import tree_flatten

    return sum(4 * v.size for _, v in tree_flatten(step.model.trainable_parameters()))


def _held_bytes(step: Any) -> dict[str, int]:
    """What a step holds whatever its micro-batch: the weights, the gradients of the trainable ones, and the
    optimizer's state (before its first update, estimated from the state it makes for a 64 x 64 matrix)."""
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for _, v in tree_flatten(step.model.parameters()))
    trainable = sum(v.nbytes for _, v in tree_flatten(step.model.trainable_parameters()))
    state = sum(int(v.nbytes) for _, v in tree_flatten(step.optimizer.state) if isinstance(v, mx.array) and v.ndim)
    if not state:
        probe, made = mx.zeros((64, 64)), dict[str, Any]()
        try:
            step.optimizer.init_single(probe, made)
        except Exception:  # noqa: BLE001 - an optimizer without per-parameter state of its own (a wrapper)
            made = {}
        per_byte = sum(v.nbytes for _, v in tree_flatten(made) if isinstance(v, mx.array)) / probe.nbytes
        state = int(per_byte * trainable)
    return {"weights": weights, "gradients": trainable, "optimizer state": state}


def _advice(step: Any, budget: int | None) -> list[str]:
    """Concrete things to try, with the sizes of what the model and optimizer hold."""
    from mlx.utils import tree_flatten

    params = sum(v.nbytes for _, v in tree_flatten(step.model.parameters()))
    state = sum(v.nbytes for _, v in tree_flatten(step.optimizer.state) if isinstance(v, mx.array))
    tips = [f"the weights ({format_bytes(params)}), their gradients ({format_bytes(params)}) and the optimizer "
            f"state ({format_bytes(state)}) are held all the time, and the update briefly needs new copies of "
            "the weights and optimizer state"]
    if step.options.precision == "float32":
        tips.append("precision='bfloat16' (about half the activation memory)")
    name = type(step.optimizer).__name__
    if state and name != "Adafactor":
        lighter = "" if name == "SGD" else "SGD keeps one copy of the weights (MLX's SGD keeps a velocity even " \
                                             "without momentum), "
        tips.append(f"an optimizer with less state than {name}: {lighter}Adafactor very little")
    tips.append("shorter sequences, a smaller model, or fewer/smaller layers")
    if budget is not None:
        tips.append(f"a larger memory_limit than {format_bytes(budget)}, if the machine has the memory")
    tips.append("print(MemoryOptimizer.suggest_config(...)) or 'mlx-train optimize' for a plan that fits")
    return tips

