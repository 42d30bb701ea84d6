"""Which parameters a tensor-parallel model splits, on which axis, in which slices -- and moving whole
parameters to slices and back.

A layout is ``{parameter path: entry}``; a parameter not named is replicated. An entry is an ``int`` (the split
axis, equal slices) or a ``Split`` (the axis and each rank's size on it: attention split unevenly by key/value
groups). Checkpoints record a layout as JSON (``layout_record``): ``{"layout": {path: axis}, "sizes": {path:
[sizes]}}``, the sizes only for unequal slices, so a record written before unequal slices existed (no
``"sizes"``) is read as equal slices.

Example::

    layout = shard_layout(model)                     # {"model.layers.0.mlp.down_proj.weight": 1, ...}
    mine = take_shard(whole, layout, group.rank(), group.size())
    whole = gather_parameters(mine, layout, group)   # every rank gets the whole parameters
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mlx_distributed
from mlx.utils import tree_flatten

from mlx_train.distributed import collectives
from mlx_train.errors import ConfigError

__all__ = ["Split", "Entry", "Layout", "axis_of", "sizes_of", "split_sizes", "layout_record", "layout_from_record",
           "same_layout", "shard_layout", "is_sharded", "take_shard", "gather_parameters", "optimizer_layout",
           "MLX_SHARDED_AXES"]


@dataclass(frozen=True)
class Split:
    """A layout entry of unequal slices: the split ``axis`` and each rank's size on it.

    Example: ``Split(0, (384, 192))`` -- axis 0, rank 0 keeps 384 rows, rank 1 the next 192.
    """

    axis: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", int(self.axis))
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))


#: A layout entry: the split axis (equal slices) or a ``Split`` (unequal ones).
Entry: TypeAlias = "int | Split"
#: ``{parameter path: entry}`` of the split parameters.
Layout: TypeAlias = "dict[str, int | Split]"

#: The axis of each parameter that MLX's sharded layers split over the group (None: replicated).
MLX_SHARDED_AXES: dict[type, dict[str, int | None]] = {
    mlx_distributed.AllToShardedLinear: {"weight": 0, "bias": 0},
    mlx_distributed.ShardedToAllLinear: {"weight": -1, "bias": None},
    mlx_distributed.QuantizedAllToShardedLinear: {"weight": 0, "scales": 0, "biases": 0, "bias": 0},
    mlx_distributed.QuantizedShardedToAllLinear: {"weight": -1, "scales": -1, "biases": -1, "bias": None},
}


def axis_of(entry: int | Split) -> int:
    """The split axis of a layout entry. Example: ``axis_of(Split(1, (4, 2)))  # 1``"""
    return entry.axis if isinstance(entry, Split) else int(entry)


def sizes_of(entry: int | Split) -> tuple[int, ...] | None:
    """Each rank's size of an unequal split, None for equal slices. Example: ``sizes_of(0)  # None``"""
    return entry.sizes if isinstance(entry, Split) else None


def split_sizes(entry: int | Split, length: int, size: int, key: str = "parameter") -> tuple[int, ...]:
    """Each rank's size on the split axis of a parameter ``length`` long there: ``entry``'s own sizes (a
    ``Split``), else equal slices (``ConfigError`` when ``length`` does not divide by ``size``).

    Example: ``split_sizes(Split(0, (4, 2)), 6, 2)  # (4, 2)``; ``split_sizes(0, 6, 2)  # (3, 3)``
    """
    axis, sizes = axis_of(entry), sizes_of(entry)
    if sizes is not None and len(sizes) == size:
        if sum(sizes) != length:
            raise ConfigError(f"{key} has {length} entries on axis {axis}, but its recorded slices "
                              f"{list(sizes)} add up to {sum(sizes)}")
        return sizes
    if sizes is not None:  # recorded for another rank count: the same groups cannot be cut otherwise
        raise ConfigError(f"{key} is split unevenly in {len(sizes)} slices {list(sizes)}; it cannot be cut into "
                          f"{size} by that record")
    if length % size:
        raise ConfigError(f"{key} has {length} entries on axis {axis}, which do not split into {size} "
                          "equal slices")
    return (length // size,) * size


def offsets(sizes: tuple[int, ...]) -> list[int]:
    """Where each slice starts, and the end. Example: ``offsets((4, 2))  # [0, 4, 6]``"""
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def layout_record(layout: Layout) -> dict[str, Any]:
    """What a checkpoint stores of ``layout`` (JSON): ``{"layout": {path: axis}, "sizes": {path: [sizes]}}``,
    the sizes only for unequal slices.

    Example: ``layout_record({"w": Split(0, (4, 2))})  # {"layout": {"w": 0}, "sizes": {"w": [4, 2]}}``
    """
    sizes = {k: list(v.sizes) for k, v in layout.items() if isinstance(v, Split)}
    return {"layout": {k: axis_of(v) for k, v in layout.items()}, **({"sizes": sizes} if sizes else {})}


def layout_from_record(record: dict[str, Any]) -> Layout:
    """The layout a checkpoint stored (``layout_record``); a plain ``{path: axis}`` one is of equal slices.

    Example: ``layout_from_record({"layout": {"w": 0}, "sizes": {"w": [4, 2]}})  # {"w": Split(0, (4, 2))}``
    """
    sizes = record.get("sizes") or {}
    return {k: Split(axis, sizes[k]) if k in sizes else int(axis) for k, axis in record.get("layout", {}).items()}


def same_layout(a: Layout, b: Layout) -> bool:
    """True when two layouts split the same parameters on the same axes in the same slices (an equal split
    and a ``Split`` of equal sizes differ: the record says which it is)."""
    return a == b


def _axes_of(module: nn.Module) -> dict[str, int | None] | None:
    declared = getattr(module, "sharded_axes", None)
    if isinstance(declared, dict):
        return declared
    return MLX_SHARDED_AXES.get(type(module))


def shard_layout(model: nn.Module) -> Layout:
    """``{parameter path: split axis (>= 0)}`` of every sharded parameter of ``model``; parameters
    not named are replicated. Empty for a model that is not sharded. A module split in unequal slices
    says so with ``split_sizes`` (each rank's size on its split axis): its entries are ``Split`` values.

    Example: ``shard_layout(model)["model.layers.0.mlp.down_proj.weight"]  # 1``
    """
    layout: Layout = {}
    for path, module in model.named_modules():
        axes = _axes_of(module)
        if not axes:
            continue
        sizes = getattr(module, "split_sizes", None)
        for name, value in tree_flatten(module.parameters()):
            axis = axes.get(name)
            if axis is not None:
                axis %= value.ndim
                layout[f"{path}.{name}" if path else name] = Split(axis, sizes) if sizes else axis
    return layout


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` holds MLX sharded layers (or modules declaring ``sharded_axes``)."""
    return any(_axes_of(m) for _, m in model.named_modules())


def take_shard(flat: dict[str, mx.array], layout: Layout, rank: int, size: int) -> dict[str, mx.array]:
    """This rank's slices of whole parameters (the inverse of ``gather_parameters``): equal ones, or each
    rank's size of a ``Split`` entry.

    Example: ``mine = take_shard(full, layout, group.rank(), group.size())``
    """
    out = {}
    for key, value in flat.items():
        entry = layout.get(key)
        if entry is None:
            out[key] = value
            continue
        axis = axis_of(entry)
        sizes = split_sizes(entry, value.shape[axis], size, key)
        out[key] = mx.contiguous(mx.split(value, offsets(sizes)[1:-1], axis=axis)[rank])
    return out


def gather_parameters(flat: dict[str, mx.array], layout: Layout, group: Any) -> dict[str, mx.array]:
    """The whole parameters from every rank's slices (every rank must call it; each gets all of them).

    ``flat`` maps parameter paths to this rank's arrays; those in ``layout`` are joined along their
    axis with ``all_gather``, the others returned as they are. Unequal slices (``Split``) are padded to
    the longest for ``all_gather`` and trimmed after.

    Example: ``full = gather_parameters(dict(tree_flatten(model.trainable_parameters())), layout, group)``
    """
    if group is None or group.size() == 1:
        return dict(flat)
    out = {}
    for key, value in flat.items():
        entry = layout.get(key)
        if entry is None:
            out[key] = value
            continue
        axis, sizes = axis_of(entry), sizes_of(entry)
        moved = mx.moveaxis(value, axis, 0)
        longest = max(sizes) if sizes else moved.shape[0]
        if longest > moved.shape[0]:
            moved = mx.concatenate([moved, mx.zeros((longest - moved.shape[0], *moved.shape[1:]), moved.dtype)])
        joined = collectives.all_gather(moved, group=group, stream=mx.cpu)
        if sizes and len(set(sizes)) > 1:
            joined = mx.concatenate([joined[r * longest:r * longest + n] for r, n in enumerate(sizes)])
        out[key] = mx.moveaxis(joined, 0, axis)
        mx.eval(out[key])  # one at a time: never every gathered matrix pending at once
    return out


def optimizer_layout(optimizer_state: dict[str, mx.array], layout: Layout) -> Layout:
    """The split of each optimizer state entry that mirrors a split parameter (Adam's ``<param>.m``)."""
    out = {}
    for key in optimizer_state:
        parameter = key.rsplit(".", 1)[0]
        if parameter in layout:
            out[key] = layout[parameter]
    return out
