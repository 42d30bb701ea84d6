"""The memory model: peak memory of one training step as a function of the micro-batch.

A training step has two memory peaks, and the larger one counts:

- the **forward/backward** peak: weights, optimizer state, gradients, and the activations kept for
  the backward pass, which grow with the micro-batch: ``fixed + per_sample * batch``;
- the **update** peak: MLX keeps the old weights and optimizer state until the compiled update has
  produced the new ones, so for a moment both exist (measured: 28 bytes per parameter with AdamW
  in float32 = weights 4 + gradients 4 + moments 8, plus 4 + 8 for the new copies).

With gradient accumulation a running gradient sum (4 bytes per parameter) is added to both.
The two lines come from measurement (``calibrate``) or, for a model known only by its size, from
the shape of a typical decoder-only transformer (``MemoryModel.analytic``).

Tensor parallelism (``MemoryModel.over_ranks``): a ``TensorSplit`` says which parameters the
model's ``shard(group)`` splits; each of N ranks holds 1/N of those, and of their gradients and
optimizer state, and all of the replicated ones (norms, layers ``shard`` leaves whole, and the token
embedding and output head when the vocabulary does not divide by N: otherwise they are split by rows).
The activations are counted whole on every rank: the split layers' own outputs shrink too, but the
blocks' inputs and outputs, the logits and their gradients do not, so the estimate errs high.

Example::

    model = MemoryModel.analytic(1e9, precision="bfloat16", optimizer="adamw", sequence_length=2048)
    model.estimate(batch_size=4).total        # bytes per device
    model.max_batch_size(budget=70e9)         # largest micro-batch that fits
    model.over_ranks(2).estimate(4).total     # per rank, split over 2 ranks by tensor parallelism
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mlx_train.device import format_bytes
from mlx_train.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from mlx_train.memory.calibrate import Measurement

#: float32 optimizer-state arrays per parameter (SGD has one with momentum, none without).
OPTIMIZER_SLOTS: dict[str, float] = {
    "sgd": 0.0, "adam": 2.0, "adamw": 2.0, "adamax": 2.0, "lion": 1.0, "rmsprop": 1.0,
    "adagrad": 1.0, "adadelta": 2.0, "adafactor": 0.05, "muon": 1.0,
}
_COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MAX_BATCH = 1 << 20  # "unbounded" when the activations do not grow with the batch

# The analytic transformer. Per token, MLX keeps about 14 * dims + 2 * heads * tokens values per
# block for the backward pass, and 60 * dims outside the blocks (embeddings, final norm, head input),
# plus the float32 logits, their softmax and gradient: fitted to measured peaks of
# mlx_train.builtin.models.CharTransformerLM on MLX 0.32 (2-4 layers, 128-256 wide, 64-256 tokens; within 3%).
_PER_DIM, _PER_SCORE, _OUTSIDE = 14, 2, 60
_VOCAB, _HEAD_DIM, _ASPECT = 32_000, 128, 86_700  # vocabulary, dims per head, params ~ 86,700 * layers^3


@dataclass(frozen=True)
class MemoryBreakdown:
    """Estimated peak bytes per device, by what they hold. ``total`` is their sum."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.workspace

    def items(self) -> list[tuple[str, int]]:
        """``[("parameters", bytes), ...]`` in display order."""
        return [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("activations", self.activations),
                ("workspace", self.workspace)]

    def __str__(self) -> str:
        return ", ".join(f"{name} {format_bytes(value)}" for name, value in self.items()) + \
            f" = {format_bytes(self.total)}"


@dataclass(frozen=True)
class TensorSplit:
    """What tensor parallelism splits: the parameters (a count, and their bytes as stored) in the
    tensors the model's ``shard(group)`` cuts over the ranks, how many of them are trained, and the
    rank counts the model can be split over (its heads and widths divide by them; empty: any).

    Example: ``TensorSplit(parameters=18_432, parameter_bytes=73_728, trainable=18_432, ranks=(1, 2))``
    """

    parameters: int
    parameter_bytes: int
    trainable: int
    ranks: tuple[int, ...] = ()

    def allows(self, ranks: int) -> bool:
        """Whether the model splits over ``ranks`` processes."""
        return ranks == 1 or not self.ranks or ranks in self.ranks


@dataclass(frozen=True)
class Curve:
    """Peak bytes of a step at micro-batch ``b``: ``max(update, fixed + per_sample * b)``."""

    fixed: float
    per_sample: float
    update: float

    def peak(self, batch_size: int, extra: float = 0.0) -> float:
        return max(self.update, self.fixed + self.per_sample * batch_size) + extra


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of a training step for one model, optimizer and precision.

    ``curves[False]`` is without gradient checkpointing, ``curves[True]`` with it (absent when the
    model has no blocks to recompute). Build one with ``MemoryModel.analytic`` or
    ``MemoryOptimizer.measure``.
    """

    parameter_count: int
    precision: str
    optimizer: str
    optimizer_state_bytes: int
    curves: dict[bool, Curve] = field(default_factory=dict)
    source: str = "analytic"  #: "analytic" or "measured"
    description: str = ""
    sequence_length: int | None = None
    notes: tuple[str, ...] = ()
    parameter_bytes: int = 0  #: the weights as stored (0: float32, 4 bytes per parameter)
    trainable_count: int = 0  #: parameters that get gradients (0: all)
    input_bytes: float = 0.0  #: bytes of one sample of the batch (the Trainer holds the whole step batch)
    measurements: tuple[Measurement, ...] = ()  #: the calibration's Measurement records (measured models)
    split: TensorSplit | None = None  #: what tensor parallelism splits (None: unknown, nothing is split)
    tensor_parallel: int = 1  #: the ranks the model is split over (this model's numbers are per rank)
    whole: MemoryModel | None = field(default=None, repr=False, compare=False)  #: before over_ranks split it

    def __post_init__(self) -> None:
        if not self.parameter_bytes:
            object.__setattr__(self, "parameter_bytes", 4 * self.parameter_count)
        if not self.trainable_count:
            object.__setattr__(self, "trainable_count", self.parameter_count)

    @property
    def can_checkpoint(self) -> bool:
        return True in self.curves

    def gradient_bytes(self, accumulation: int = 1) -> int:
        """float32 gradients, plus the running sum when micro-batches accumulate."""
        return 4 * self.trainable_count * (2 if accumulation > 1 else 1)

    def estimate(self, batch_size: int, accumulation: int = 1, checkpointing: bool = False) -> MemoryBreakdown:
        """The peak of one step at this micro-batch, split by what it holds."""
        curve = self._curve(checkpointing)
        extra = self._accumulation_bytes(batch_size, accumulation)
        total = curve.peak(batch_size, extra)
        held = self.parameter_bytes + self.gradient_bytes(accumulation) + self.optimizer_state_bytes
        batch_data = self.input_bytes * batch_size * (accumulation - 1)
        activations = min(max(curve.per_sample * batch_size + batch_data, 0.0), max(total - held, 0.0))
        workspace = max(total - held - activations, 0.0)
        return MemoryBreakdown(self.parameter_bytes, self.gradient_bytes(accumulation),
                               self.optimizer_state_bytes, int(activations), int(workspace))

    def max_batch_size(self, budget: float, accumulation: int = 1, checkpointing: bool = False) -> int:
        """The largest micro-batch whose peak stays within ``budget`` bytes (0: not even one sample)."""
        curve = self._curve(checkpointing)
        if curve.peak(1, self._accumulation_bytes(1, accumulation)) > budget:
            return 0
        grads = self.gradient_bytes(accumulation) - self.gradient_bytes(1)
        per_sample = curve.per_sample + self.input_bytes * (accumulation - 1)
        if per_sample <= 0:
            return _MAX_BATCH
        return int(min(_MAX_BATCH, max(1, math.floor((budget - grads - curve.fixed) / per_sample))))

    def over_ranks(self, ranks: int) -> MemoryModel:
        """This model split over ``ranks`` processes by tensor parallelism, its numbers per rank: the split
        parameters, their gradients and optimizer state divide by ``ranks``; the rest does not (see the
        module docstring). Raises ``ConfigError`` when the model cannot be split so.

        Example: ``MemoryModel.analytic(7e9).over_ranks(4).estimate(1).parameters``  # about 7e9 bytes
        """
        if self.tensor_parallel != 1:
            raise ConfigError("over_ranks takes a whole model's memory model, not one already split")
        if ranks < 1:
            raise ConfigError(f"ranks must be at least 1, got {ranks}")
        if ranks == 1:
            return self
        split = self.split
        if split is None:
            raise ConfigError("this memory model does not know what tensor parallelism splits: measure a model "
                              "with a shard(group) method, or plan from --model-size")
        if not split.allows(ranks):
            raise ConfigError(f"the model does not split over {ranks} ranks (its heads and widths divide by "
                              f"{', '.join(map(str, split.ranks))})")
        cut = 1 - 1 / ranks
        weights = split.parameter_bytes * cut
        gradients = 4 * split.trainable * cut  # also the new copy of the trained weights at the update
        state = self.optimizer_state_bytes * (split.trainable / self.trainable_count) * cut
        curves = {k: Curve(max(c.fixed - weights - gradients - state, 0.0), c.per_sample,
                           max(c.update - weights - 2 * gradients - 2 * state, 0.0)) for k, c in self.curves.items()}
        note = (f"tensor parallel over {ranks} ranks: each holds 1/{ranks} of the split weights, gradients and "
                "optimizer state and all of the replicated ones; activations counted whole (an upper bound)")
        return replace(self, parameter_count=round(self.parameter_count - split.parameters * cut),
                       parameter_bytes=round(self.parameter_bytes - weights),
                       trainable_count=max(1, round(self.trainable_count - split.trainable * cut)),
                       optimizer_state_bytes=round(self.optimizer_state_bytes - state), curves=curves,
                       tensor_parallel=ranks, notes=(*self.notes, note), measurements=(), whole=self)

    def ranks_to_fit(self, budget: float, batch_size: int = 1, accumulation: int = 1,
                     checkpointing: bool = False, most: int = 64) -> int | None:
        """The fewest tensor-parallel ranks (1, 2, 4, ... up to ``most``, those the model splits over) whose
        per-rank peak at this micro-batch fits ``budget`` bytes; None when none does.

        Example: ``MemoryModel.analytic(7e9).ranks_to_fit(20e9)``  # 4
        """
        if self.whole is not None:
            return self.whole.ranks_to_fit(budget, batch_size, accumulation, checkpointing, most)
        ranks = 1
        while ranks <= most:
            if ranks == 1 or (self.split is not None and self.split.allows(ranks)):
                per_rank = self.over_ranks(ranks)
                if not (checkpointing and not per_rank.can_checkpoint) and \
                        per_rank.estimate(batch_size, accumulation, checkpointing).total <= budget:
                    return ranks
            if self.split is None:
                return None
            ranks *= 2
        return None

    def _accumulation_bytes(self, batch_size: int, accumulation: int) -> float:
        """What accumulation adds: the running gradient sum, and the rest of the step batch's data."""
        grads = self.gradient_bytes(accumulation) - self.gradient_bytes(1)
        return grads + self.input_bytes * batch_size * (accumulation - 1)

    def _curve(self, checkpointing: bool) -> Curve:
        if checkpointing and not self.can_checkpoint:
            raise ConfigError("this memory model has no estimate with gradient checkpointing (the model has "
                              "no blocks to recompute); name them with checkpoint_modules")
        return self.curves[bool(checkpointing)]

    @classmethod
    def analytic(cls, model_size: float, precision: str = "float32", optimizer: str = "adamw",
                 sequence_length: int = 2048) -> MemoryModel:
        """Estimate from the size alone, assuming a decoder-only transformer of typical shape.

        Example::

            MemoryModel.analytic(1e9, "bfloat16", "adamw", 2048).estimate(4)
        """
        params = int(model_size)
        if params < 1:
            raise ConfigError(f"model_size must be a positive number of parameters, got {model_size!r}")
        if precision not in _COMPUTE_BYTES:
            raise ConfigError(f"precision must be one of {', '.join(_COMPUTE_BYTES)}, got {precision!r}"
                              f"{did_you_mean(str(precision), _COMPUTE_BYTES)}")
        tokens = int(sequence_length)
        if tokens < 1:
            raise ConfigError(f"sequence_length must be at least 1, got {sequence_length!r}")
        layers = max(1, round((params / _ASPECT) ** (1 / 3)))
        dims = max(64, int(math.sqrt(params / (12 * layers))))
        heads = max(1, dims // _HEAD_DIM)
        compute = _COMPUTE_BYTES[precision]
        state = int(optimizer_slots(optimizer) * 4 * params)
        per_layer = (_PER_DIM * dims + _PER_SCORE * heads * tokens) * compute  # bytes per token
        outside = 3 * 4 * _VOCAB + _OUTSIDE * dims * compute
        casts = compute * params if compute != 4 else 0  # low-precision weight copies for the step
        held = 4 * params + 4 * params + state + casts
        update = 4 * params + 4 * params + state + 4 * params + state
        plain = Curve(held, tokens * (layers * per_layer + outside), update)
        recomputed = Curve(held, tokens * (layers * dims * compute + per_layer + outside), update)
        description = (f"{_count(params)}-parameter transformer (assumed {layers} layers x {dims} wide, "
                       f"{heads} heads, {tokens} tokens per sample)")
        notes = ("estimated from the model size alone; MemoryOptimizer.measure(model, data) measures the "
                 "real model",)
        replicated = min(params, (2 * layers + 1) * dims)  # the norms; the embedding splits by vocabulary rows
        split = TensorSplit(params - replicated, 4 * (params - replicated), params - replicated,
                            tuple(n for n in (2, 4, 8, 16, 32, 64) if heads % n == 0 and _VOCAB % n == 0))
        return cls(params, precision, optimizer, state, {False: plain, True: recomputed}, "analytic",
                   description, tokens, notes, input_bytes=4 * (tokens + 1), split=split)


def optimizer_slots(name: str, momentum: float = 0.0) -> float:
    """float32 state arrays per parameter kept by the optimizer ``name`` (``sgd`` -> 0, ``adamw`` -> 2)."""
    key = str(name).lower()
    if key not in OPTIMIZER_SLOTS:
        raise ConfigError(f"unknown optimizer {name!r}{did_you_mean(key, OPTIMIZER_SLOTS)}; "
                          f"known: {', '.join(OPTIMIZER_SLOTS)}")
    return 1.0 if key == "sgd" and momentum else OPTIMIZER_SLOTS[key]


def _count(params: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= size:
            return f"{params / size:.2f}{unit}"
    return str(int(params))
