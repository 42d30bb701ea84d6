"""Plans: the micro-batch, accumulation, checkpointing and precision that fit a device's memory.

Example::

    from mlx_train import MemoryOptimizer
    plan = MemoryOptimizer.suggest_config(model_size=1e9, num_devices=2)
    print(plan)                   # the settings, the estimated peak and its breakdown, and why
    trainer = Trainer(model, optimizer, **plan.to_config())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_train.device import format_bytes, parse_bytes
from mlx_train.errors import ConfigError
from mlx_train.memory.model import _MAX_BATCH, MemoryBreakdown, MemoryModel

__all__ = ["MemoryPlan", "MemoryOptimizer", "plan_memory", "for_strategy", "HEADROOM"]

#: Plans use this share of the device memory: MLX's buffer cache and fragmentation need the rest.
HEADROOM = 0.9
#: Without a target batch, plans suggest at most this micro-batch (more rarely trains better).
MAX_SUGGESTED_BATCH = 4096
#: Checkpointing is worth its extra forward pass when it keeps this many times fewer activations.
CHECKPOINT_GAIN = 4

_WORKSPACE = "update copies of weights and optimizer state, low-precision weights, kernel scratch"


@dataclass(frozen=True)
class MemoryPlan:
    """Settings that fit a device's memory, the peak they are expected to reach, and why.

    ``batch_size`` is the micro-batch per device (the Trainer's ``batch_size``); an optimizer step
    sees ``effective_batch_size = batch_size * gradient_accumulation * num_devices`` samples.
    ``print(plan)`` explains every choice.
    """

    batch_size: int
    gradient_accumulation: int
    gradient_checkpointing: bool
    precision: str
    num_devices: int
    device_memory: int
    budget: int
    peak: MemoryBreakdown
    fits: bool
    model: MemoryModel
    target_batch_size: int | None = None
    reasons: tuple[tuple[str, str], ...] = ()  #: (setting, why it was chosen)
    suggestions: tuple[str, ...] = ()

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size * self.gradient_accumulation * self.num_devices

    def to_config(self) -> dict[str, Any]:
        """The TrainConfig fields this plan sets: ``Trainer(model, opt, **plan.to_config())``."""
        return {"batch_size": self.batch_size, "gradient_accumulation": self.gradient_accumulation,
                "gradient_checkpointing": self.gradient_checkpointing, "precision": self.precision}

    def apply(self, config: Any) -> Any:
        """``config`` (a TrainConfig) with this plan's settings."""
        return config.replace(**self.to_config())

    @property
    def ranks_needed(self) -> int | None:
        """The fewest tensor-parallel ranks over which this plan's micro-batch fits the budget (the model's
        split from its ``shard``; None when the split is unknown or no rank count up to 64 fits).

        Example: ``MemoryOptimizer.suggest_config(7e9, device_memory="40GB").ranks_needed``
        """
        if self.model.split is None:
            return None
        return self.model.ranks_to_fit(self.budget, self.batch_size, self.gradient_accumulation,
                                       self.gradient_checkpointing)

    def _ranks_text(self, needed: int | None) -> str:
        memory = format_bytes(self.device_memory)
        if needed is None:
            split = self.model.split
            counts = ", ".join(map(str, split.ranks)) if split is not None and split.ranks else "up to 64"
            return f"no split the model allows ({counts} ranks) fits it in {memory} per device"
        return f"needs {needed} rank{'s' if needed != 1 else ''} of tensor parallelism to fit in {memory} per device"

    def __str__(self) -> str:
        m = self.model
        devices = f"{self.num_devices} device{'s' if self.num_devices != 1 else ''}"
        where = devices if m.tensor_parallel == 1 else \
            f"{m.tensor_parallel} tensor-parallel ranks (per rank; every rank trains on the whole batch)"
        lines = [f"Memory plan for {m.description or 'the model'} on {where} ({m.source} estimate)"]
        why = dict(self.reasons)

        def row(label: str, value: Any, note: str = "") -> None:
            lines.append(f"  {label:<24}{value!s:<10}{('  ' + note) if note else ''}".rstrip())

        row("batch size per device", self.batch_size, why.get("batch_size", ""))
        row("gradient accumulation", self.gradient_accumulation,
            f"effective batch {self.effective_batch_size} = {self.batch_size} x {self.gradient_accumulation} x "
            f"{devices}" + (f"; {why['accumulation']}" if "accumulation" in why else ""))
        row("gradient checkpointing", "on" if self.gradient_checkpointing else "off",
            why.get("gradient_checkpointing", ""))
        row("precision", self.precision, why.get("precision", ""))
        share = f"{HEADROOM:.0%} of {format_bytes(self.device_memory)} device memory"
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {'peak per device':<24}{format_bytes(self.peak.total):<10}  of a "
                     f"{format_bytes(self.budget)} budget ({share}): {verdict}")
        notes = {"parameters": "float32 master weights" if m.parameter_bytes == 4 * m.parameter_count else "",
                 "gradients": "float32" + (", plus the running sum of accumulation"
                                           if self.gradient_accumulation > 1 else ""),
                 "optimizer state": m.optimizer,
                 "activations": f"{self.batch_size} sample{'s' if self.batch_size != 1 else ''}"
                                + (f" x {m.sequence_length} tokens" if m.sequence_length else "")
                                + (", recomputed per block" if self.gradient_checkpointing else ""),
                 "workspace": _WORKSPACE}
        for name, value in self.peak.items():
            lines.append(f"    {name:<22}{format_bytes(value):<10}  {notes[name]}".rstrip())
        needed = self.ranks_needed
        if m.split is not None and (m.tensor_parallel > 1 or not self.fits):
            lines.append(f"  tensor parallelism: {self._ranks_text(needed)}")
        for suggestion in self.suggestions:
            lines.append(f"  to fit: {suggestion}")
        for note in m.notes:
            lines.append(f"  note: {note}")
        config = ", ".join(f"{k}={v!r}" for k, v in self.to_config().items())
        lines.append(f"  as Trainer arguments: {config}")
        return "\n".join(lines)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


def _micro_batches(per_device: int, largest: int) -> tuple[int, int]:
    """(micro-batch, accumulation) for ``per_device`` samples with micro-batches of at most ``largest``.

    Prefers an exact split (``micro * accumulation == per_device``) unless it needs more than twice
    the fewest accumulation steps.
    """
    fewest = math.ceil(per_device / largest)
    for steps in range(fewest, 2 * fewest + 1):
        if per_device % steps == 0:
            return per_device // steps, steps
    return math.ceil(per_device / fewest), fewest


def plan_memory(model: MemoryModel, num_devices: int = 1, *, device_memory: int | str | None = None,
                target_batch_size: int | None = None, batch_size: int | None = None,
                precision_reason: str = "") -> MemoryPlan:
    """Plan for a memory model: the micro-batch, accumulation and checkpointing that fit.

    ``target_batch_size`` is the effective (global) batch to reach; ``batch_size`` fixes the
    micro-batch (only checkpointing and accumulation are then chosen).

    Example::

        plan = plan_memory(profile, num_devices=1, device_memory="16GB", target_batch_size=256)
    """
    devices = _positive_int(num_devices, "num_devices")
    memory = parse_bytes(device_memory, "device_memory") if device_memory is not None else _detected_memory()
    if not memory or memory <= 0:
        raise ConfigError("device_memory is unknown on this machine; pass device_memory='16GB' (per device)")
    budget = int(memory * HEADROOM)
    target = None if target_batch_size is None else _positive_int(target_batch_size, "target_batch_size")
    fixed = None if batch_size is None else _positive_int(batch_size, "batch_size")
    per_device = None if target is None else math.ceil(target / devices)
    reasons: list[tuple[str, str]] = []

    largest: dict[bool, int] = {}
    for checkpointing in [False] + ([True] if model.can_checkpoint else []):
        fit = model.max_batch_size(budget, 1, checkpointing)
        if (fixed or per_device or 0) > fit:  # will accumulate: the running gradient sum needs room too
            fit = model.max_batch_size(budget, 2, checkpointing)
        largest[checkpointing] = fit

    gain = 0.0
    if model.can_checkpoint:
        plain, recomputed = model.curves[False].per_sample, model.curves[True].per_sample
        gain = plain / recomputed if recomputed > 0 else math.inf
    checkpointing, why = _choose_checkpointing(largest, fixed or per_device, fixed is not None, gain)
    reasons.append(("gradient_checkpointing", why))
    room = largest[checkpointing]
    if fixed is not None:
        micro, steps = fixed, max(1, math.ceil((per_device or fixed) / fixed))
        reasons.append(("batch_size", "as given" + (f" ({_room(room)})" if room < fixed else "")))
    elif per_device is not None:
        micro, steps = _micro_batches(per_device, max(room, 1))
        share = f"{target} over {devices} devices" if devices > 1 else f"target {target}"
        reasons.append(("batch_size", f"{share}; " + _room(room)))
        if steps > 1:
            reasons.append(("accumulation", f"{steps} micro-batches per step reach the target"))
    else:
        micro = max(1, min(room, MAX_SUGGESTED_BATCH))
        micro = micro - micro % 8 if micro >= 16 else micro  # multiples of 8 suit GPU kernels
        steps = 1
        reasons.append(("batch_size", "the smallest; not even one sample fits" if room == 0 else
                        f"the largest that fits (at most {room})" if room <= MAX_SUGGESTED_BATCH
                        else f"memory allows {room}; capped at {MAX_SUGGESTED_BATCH}"))
    if target is not None and micro * steps * devices != target:
        reasons.append(("accumulation", f"{target} does not split evenly; the nearest split is used"))
    reasons.append(("precision", precision_reason or "the precision the model was measured with"))
    peak = model.estimate(micro, steps, checkpointing)
    fits = peak.total <= budget
    return MemoryPlan(micro, steps, checkpointing, model.precision, devices, int(memory), budget, peak, fits,
                      model, target, tuple(reasons), () if fits else tuple(_suggestions(model, budget)))


def _room(room: int) -> str:
    if room == 0:
        return "not even one sample fits"
    return "memory is no limit" if room >= _MAX_BATCH else f"at most {room} fit per micro-batch"


def _choose_checkpointing(largest: dict[bool, int], wanted: int | None, fixed: bool,
                          gain: float) -> tuple[bool, str]:
    """Checkpointing or not, and why. On when nothing fits without it, when a given micro-batch needs it,
    or when it keeps ``CHECKPOINT_GAIN`` times fewer activations per sample and the wanted micro-batch
    does not fit without it. ``gain`` (activations per sample without / with) does not depend on the
    memory, so more memory never gives a smaller micro-batch."""
    plain, recomputed = largest[False], largest.get(True)
    if plain >= (wanted or MAX_SUGGESTED_BATCH):
        return False, f"{wanted} fit without it" if wanted else "not needed"
    if recomputed is None or recomputed == 0:
        return recomputed == 0 and plain == 0, _no_recompute(recomputed)
    if plain == 0:
        return True, f"without it not even one sample fits; with it {recomputed} do"
    if fixed and wanted is not None and recomputed >= wanted:  # a fixed micro-batch is always given
        return True, f"{wanted} samples need it ({plain} fit without)"
    if gain >= CHECKPOINT_GAIN:
        return True, f"{recomputed} samples fit per micro-batch with it, {plain} without"
    return False, (f"{plain} samples fit without it ({recomputed} with): accumulating costs less than "
                   "recomputing the activations")


def _no_recompute(recomputed: int | None) -> str:
    if recomputed is None:
        return "the model has no blocks to recompute (model.layers or checkpoint_modules)"
    return "not even one sample fits, with it or without"


def _suggestions(model: MemoryModel, budget: int) -> list[str]:
    one = model.estimate(1, 1, model.can_checkpoint)
    state = one.parameters + one.gradients + one.optimizer_state
    update = model.curves[False].update
    if max(state, update) > budget:
        tips = [f"the weights, gradients and optimizer state alone take {format_bytes(state)} "
                f"({format_bytes(update)} while the update runs); the budget is {format_bytes(budget)}"]
    else:
        tips = [f"one sample needs {format_bytes(one.total)} per device; the budget is {format_bytes(budget)}"]
    if model.precision == "float32":
        tips.append("precision='bfloat16' about halves the activations")
    if model.optimizer_state_bytes:
        tips.append(f"the {model.optimizer} state takes {format_bytes(model.optimizer_state_bytes)} (twice that "
                    "while the update runs): optimizer='sgd' keeps none, 'adafactor' very little")
    if not model.can_checkpoint:
        tips.append("name the model's repeated blocks with checkpoint_modules so they can be recomputed")
    if model.sequence_length:
        tips.append("shorter sequences, or a smaller model")
    tips.append("data parallelism does not split the weights: every device holds all of them "
                "(strategy='tensor_parallel' splits the large layers over the ranks; 'fsdp' shards them all, on "
                "NCCL or JACCL)")
    return tips


def _detected_memory() -> int | None:
    from mlx_train.device import DeviceConfig

    return DeviceConfig().device_memory()


class MemoryOptimizer:
    """Plans training settings that fit the memory of a device, from an estimate or a measurement.

    Example::

        plan = MemoryOptimizer.suggest_config(model_size=1e9, num_devices=2)          # from the size
        profile = MemoryOptimizer.measure(model, data["train"], optimizer="adamw")     # real steps
        plan = MemoryOptimizer.suggest_config(profile, num_devices=1, target_batch_size=256)
        print(plan)
    """

    @staticmethod
    def suggest_config(model_size: float | MemoryModel, num_devices: int = 1, *,
                       device_memory: int | str | None = None, precision: str = "auto",
                       optimizer: str = "adamw", sequence_length: int | None = None,
                       target_batch_size: int | None = None, strategy: str = "data_parallel") -> MemoryPlan:
        """Plan for a model of ``model_size`` parameters (or a measured MemoryModel) on ``num_devices``.

        ``device_memory`` is per device (bytes or ``"80GB"``; default: what this machine's device
        has available). ``precision="auto"`` picks bfloat16 on a GPU and float32 on a CPU.
        ``sequence_length`` defaults to 2048 tokens for a size-only estimate. ``strategy="tensor_parallel"``:
        the model is split over the ``num_devices`` ranks (``MemoryModel.over_ranks``), each of which trains
        on the whole ``target_batch_size``.
        """
        if isinstance(model_size, MemoryModel):
            given = {"precision": precision != "auto", "optimizer": optimizer != "adamw",
                     "sequence_length": sequence_length is not None}
            if any(given.values()):
                names = ", ".join(k for k, v in given.items() if v)
                raise ConfigError(f"{names} cannot be changed for a measured memory model; measure again with "
                                  "MemoryOptimizer.measure(..., precision=..., optimizer=...)")
            model, devices = for_strategy(model_size, num_devices, strategy)
            return plan_memory(model, devices, device_memory=device_memory, target_batch_size=target_batch_size)
        chosen, reason = _precision(precision)
        model, devices = for_strategy(MemoryModel.analytic(model_size, chosen, optimizer, sequence_length or 2048),
                                      num_devices, strategy)
        return plan_memory(model, devices, device_memory=device_memory, target_batch_size=target_batch_size,
                           precision_reason=reason)

    @staticmethod
    def measure(model: Any, sample: Any, *, optimizer: Any = "adamw", loss_fn: Callable[..., Any] | None = None,
                precision: str = "float32", checkpoint_modules: Sequence[str] | None = None,
                max_batch_size: int = 64) -> MemoryModel:
        """Measure a real model's memory with a few real steps (see ``mlx_train.memory.calibrate``)."""
        from mlx_train.memory.calibrate import measure

        return measure(model, sample, optimizer=optimizer, loss_fn=loss_fn, precision=precision,
                       checkpoint_modules=checkpoint_modules, max_batch_size=max_batch_size)


def for_strategy(model: MemoryModel, num_devices: int, strategy: str) -> tuple[MemoryModel, int]:
    """``(memory model per device, devices sharing the batch)`` of a run on ``num_devices`` with ``strategy``:
    data parallel keeps the whole model on each of ``num_devices`` devices; tensor parallel splits it over
    them, and they all train on the same batch (one device's share of it, as far as the plan goes).

    Example: ``for_strategy(MemoryModel.analytic(1e9), 4, "tensor_parallel")[1]`` -> ``1``
    """
    if strategy == "tensor_parallel":
        return model.over_ranks(_positive_int(num_devices, "num_devices")), 1
    if strategy == "fsdp":
        raise ConfigError("the memory plan does not model strategy 'fsdp' yet: plan for data_parallel (an upper "
                          "bound) or tensor_parallel")
    return model, num_devices


def _precision(precision: str) -> tuple[str, str]:
    from mlx_train.device import DeviceConfig

    if precision != "auto":
        if precision not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"precision must be auto, float32, bfloat16 or float16, got {precision!r}")
        return precision, "as asked; weights stay float32"
    if DeviceConfig().backend == "cpu":
        return "float32", "the CPU: bfloat16 matmuls are slow there (auto)"
    return "bfloat16", "on the GPU it halves activations and speeds up matmuls; weights stay float32 (auto)"
