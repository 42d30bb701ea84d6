"""The split linear layers of a tensor-parallel model: MLX's sharded linears with their collectives made through
``distributed.collectives`` (``Tracked*``), and the linears of attention split unevenly by key/value groups.

``track_collectives(model)`` puts a tracked layer in place of each MLX sharded linear (the same arrays, frozen
parameters and results: only the route of its ``all_sum`` differs), so that a step's collectives can be
listed (``distributed.comm.StepCommunication``); ``untracked_modules(model)`` names split layers whose
collectives cannot be.

Example::

    model.shard(group)
    track_collectives(model)
    assert untracked_modules(model) == []
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mlx_distributed
from mlx.utils import tree_flatten

from mlx_train.distributed import collectives
from mlx_train.distributed.tensor.layout import MLX_SHARDED_AXES

__all__ = ["TrackedAllToShardedLinear", "TrackedShardedToAllLinear", "TrackedQuantizedAllToShardedLinear",
           "TrackedQuantizedShardedToAllLinear", "TRACKED", "track_collectives", "untracked_modules",
           "UnevenAllToShardedLinear", "UnevenShardedToAllLinear"]


class TrackedAllToShardedLinear(mlx_distributed.AllToShardedLinear, collectives.Tracked):
    """MLX's ``AllToShardedLinear`` (the same parameters and values) whose input's gradient is summed over the
    group through ``collectives``, so a step's collectives can be listed.

    Example: ``layer = TrackedAllToShardedLinear.of(shard_linear(linear, "all-to-sharded", group=group))``
    """

    sharded_axes: dict[str, int | None] = MLX_SHARDED_AXES[mlx_distributed.AllToShardedLinear]

    @classmethod
    def of(cls, layer: nn.Module) -> Any:
        """The same layer (its arrays, group, frozen parameters and mode), tracked."""
        return _tracked(cls, layer)

    def __call__(self, x: mx.array) -> mx.array:
        x = collectives.sum_gradients(self.group)(x)
        weight: mx.array = self["weight"]
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight.T)
        return x @ weight.T


class TrackedShardedToAllLinear(mlx_distributed.ShardedToAllLinear, collectives.Tracked):
    """MLX's ``ShardedToAllLinear`` whose partial outputs are summed over the group through ``collectives``.

    Example: ``layer = TrackedShardedToAllLinear.of(shard_linear(linear, "sharded-to-all", group=group))``
    """

    sharded_axes: dict[str, int | None] = MLX_SHARDED_AXES[mlx_distributed.ShardedToAllLinear]

    @classmethod
    def of(cls, layer: nn.Module) -> Any:
        """The same layer (its arrays, group, frozen parameters and mode), tracked."""
        return _tracked(cls, layer)

    def __call__(self, x: mx.array) -> mx.array:
        x = collectives.all_sum(x @ self["weight"].T, group=self.group)
        if "bias" in self:
            x = x + self["bias"]
        return x


def _quantized_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    return mx.quantized_matmul(x, layer["weight"], scales=layer["scales"], biases=layer.get("biases"), transpose=True,
                               group_size=layer.group_size, bits=layer.bits, mode=layer.mode)


class TrackedQuantizedAllToShardedLinear(mlx_distributed.QuantizedAllToShardedLinear, collectives.Tracked):
    """MLX's ``QuantizedAllToShardedLinear``, its input's gradient summed through ``collectives``."""

    sharded_axes: dict[str, int | None] = MLX_SHARDED_AXES[mlx_distributed.QuantizedAllToShardedLinear]

    @classmethod
    def of(cls, layer: nn.Module) -> Any:
        """The same layer (its arrays, quantization, group, frozen parameters and mode), tracked."""
        return _tracked(cls, layer)

    def __call__(self, x: mx.array) -> mx.array:
        x = _quantized_matmul(self, collectives.sum_gradients(self.group)(x))
        if "bias" in self:
            x = x + self["bias"]
        return x


class TrackedQuantizedShardedToAllLinear(mlx_distributed.QuantizedShardedToAllLinear, collectives.Tracked):
    """MLX's ``QuantizedShardedToAllLinear``, its partial outputs summed through ``collectives``."""

    sharded_axes: dict[str, int | None] = MLX_SHARDED_AXES[mlx_distributed.QuantizedShardedToAllLinear]

    @classmethod
    def of(cls, layer: nn.Module) -> Any:
        """The same layer (its arrays, quantization, group, frozen parameters and mode), tracked."""
        return _tracked(cls, layer)

    def __call__(self, x: mx.array) -> mx.array:
        x = collectives.all_sum(_quantized_matmul(self, x), group=self.group)
        if "bias" in self:
            x = x + self["bias"]
        return x


#: MLX's sharded linears and the tracked layer each becomes.
TRACKED: dict[type, Any] = {
    mlx_distributed.AllToShardedLinear: TrackedAllToShardedLinear,
    mlx_distributed.ShardedToAllLinear: TrackedShardedToAllLinear,
    mlx_distributed.QuantizedAllToShardedLinear: TrackedQuantizedAllToShardedLinear,
    mlx_distributed.QuantizedShardedToAllLinear: TrackedQuantizedShardedToAllLinear,
}
_QUANTIZATION = ("group_size", "bits", "mode")


def _tracked(cls: type[nn.Module], layer: nn.Module) -> Any:
    """A ``cls`` holding ``layer``'s arrays (the same ones, nothing copied or drawn), group and quantization,
    with the same parameters frozen and the same training mode."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.group = layer.group
    for name in _QUANTIZATION:
        if hasattr(layer, name):
            setattr(new, name, getattr(layer, name))
    for name, value in layer.items():
        setattr(new, name, value)
    trainable = {key for key, _ in tree_flatten(layer.trainable_parameters())}
    frozen = [key for key, _ in tree_flatten(layer.parameters()) if key not in trainable]
    if frozen:
        new.freeze(keys=frozen)
    new.train(layer.training)
    return new


def track_collectives(model: nn.Module) -> int:
    """Replace, in place, every MLX sharded linear of ``model`` with its tracked layer (``TRACKED``: the same
    arrays and results, the collectives made through ``collectives``); returns how many were replaced.

    Example: ``model.shard(group); track_collectives(model)``
    """
    swaps = [(holder, key) for _, module in model.named_modules() for holder, key, child in _children(module)
             if type(child) in TRACKED]
    for holder, key in swaps:
        holder[key] = TRACKED[type(holder[key])].of(holder[key])
    return len(swaps)


def _children(module: nn.Module) -> list[tuple[Any, Any, Any]]:
    """``(holder, key, child)`` of each module directly under ``module``: its attributes, and the items of its
    lists and dicts (``Sequential.layers``), so that ``holder[key] = ...`` replaces the child."""
    found: list[tuple[Any, Any, Any]] = []
    for name, value in module.items():
        if isinstance(value, nn.Module):
            found.append((module, name, value))
        elif isinstance(value, list):
            found += [(value, i, child) for i, child in enumerate(value) if isinstance(child, nn.Module)]
        elif isinstance(value, dict):
            found += [(value, k, child) for k, child in value.items() if isinstance(child, nn.Module)]
    return found


def untracked_modules(model: nn.Module) -> list[str]:
    """The paths of ``model``'s split modules whose collectives ``collectives`` does not list (not
    ``collectives.Tracked``: the tracked linears, the split vocabulary, ``llm.adapters``' sharded adapters).

    Example: ``untracked_modules(model)  # [] after shard_model``
    """
    found = []
    for path, module in model.named_modules():
        split = type(module) in MLX_SHARDED_AXES or isinstance(getattr(module, "sharded_axes", None), dict)
        if split and not isinstance(module, collectives.Tracked):
            found.append(path)
    return found


# -- unequal slices ------------------------------------------------------------------------------


def _own_slice(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


class UnevenAllToShardedLinear(TrackedAllToShardedLinear):
    """MLX's ``AllToShardedLinear`` over slices of unequal sizes: this rank's rows of ``linear``
    (``split_sizes[r]`` rows for rank r, contiguous), the input's gradient summed over the group.

    Example: ``attention.k_proj = UnevenAllToShardedLinear(attention.k_proj, (128, 64), group)``
    """

    sharded_axes: dict[str, int | None] = {"weight": 0, "bias": 0}
    split_sizes: tuple[int, ...]

    def __init__(self, linear: nn.Module, sizes: tuple[int, ...], group: Any) -> None:
        nn.Module.__init__(self)
        rows = _own_slice(sizes, group.rank())
        self.group = group
        self.weight = mx.contiguous(linear.weight[rows])
        if "bias" in linear:
            self.bias = mx.contiguous(linear.bias[rows])
        object.__setattr__(self, "split_sizes", tuple(sizes))  # not a parameter

    def _extra_repr(self) -> str:
        return f"input_dims={self.weight.shape[1]}, output_dims={sum(self.split_sizes)}, sizes={self.split_sizes}"


class UnevenShardedToAllLinear(TrackedShardedToAllLinear):
    """MLX's ``ShardedToAllLinear`` over slices of unequal sizes: this rank's columns of ``linear``
    (``split_sizes[r]`` for rank r), the partial outputs summed over the group, the bias whole.

    Example: ``attention.o_proj = UnevenShardedToAllLinear(attention.o_proj, (384, 192), group)``
    """

    sharded_axes: dict[str, int | None] = {"weight": -1, "bias": None}
    split_sizes: tuple[int, ...]

    def __init__(self, linear: nn.Module, sizes: tuple[int, ...], group: Any) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.weight = mx.contiguous(linear.weight[:, _own_slice(sizes, group.rank())])
        if "bias" in linear:
            self.bias = linear.bias
        object.__setattr__(self, "split_sizes", tuple(sizes))  # not a parameter

    def _extra_repr(self) -> str:
        return f"input_dims={sum(self.split_sizes)}, output_dims={self.weight.shape[0]}, sizes={self.split_sizes}"
