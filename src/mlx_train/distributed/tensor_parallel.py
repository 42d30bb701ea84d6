"""Tensor parallelism on MLX's own sharded layers: every rank holds a slice of each large matrix.

A model is split over a group by its own ``shard(group)`` method -- the protocol mlx-lm's models
follow (``Model.shard(group)``, built on ``mlx.nn.layers.distributed.shard_linear``):

- ``shard(group)`` replaces, in place, the linear layers to split with MLX's sharded layers:
  ``shard_linear(layer, "all-to-sharded", group=group)`` for a layer whose *output* is split
  (attention q/k/v, the MLP's up/gate projections; weight rows, axis 0) and
  ``shard_linear(layer, "sharded-to-all", group=group)`` for the layer that joins the slices
  back (attention output, MLP down projection; weight columns, axis -1, then an ``all_sum``),
  and divides what depends on the split (the number of heads) by ``group.size()``.
- A module that holds sharded parameters of another kind declares them with an attribute (or
  property) ``sharded_axes: dict[str, int | None]`` (parameter name -> the axis split over the
  group, None: replicated), as the sharded LoRA/DoRA layers of ``mlx_train.llm.adapters`` do.
- Every rank builds the same whole model (same weights file, or same seed) and takes its own
  slices; the replicated parameters are then made rank 0's (``DistributedTrainer`` broadcasts
  them). A split cuts each matrix into contiguous slices, equal ones unless the layout says otherwise:
  ``shard_linear(..., segments=k)`` (fused QKV) is not described by the layout, so checkpoints of such
  a model resume only on the same number of ranks.

Attention whose heads do not divide by the group size (SmolLM2's 9 query and 3 key/value heads over 2
ranks) is split unevenly by key/value groups, for mlx-lm's llama-style attention (``n_heads``,
``n_kv_heads``, unquantized ``q_proj``/``k_proj``/``v_proj``/``o_proj``): rank r keeps a contiguous run of
whole groups, the lower ranks one more (3 groups over 2 ranks: 2 + 1), with their query heads
(``UnevenAllToShardedLinear`` for q/k/v, ``UnevenShardedToAllLinear`` for o). Their layout entries are
``Split`` values: the axis (an ``int``) carrying each rank's size on it (``Split.sizes``); checkpoints
record the sizes beside the plain ``{path: axis}`` layout (``"sizes"``), and a layout without them is
one of equal slices. Attention with fewer key/value heads than ranks is refused as before.

The vocabulary is split too (``shard_vocabulary``, which ``shard_model`` calls after ``shard``): for an
mlx-lm model whose logits are its head applied to ``model.model``'s output (``llm.loss.output_head``) and
whose vocabulary divides by the group size, the token embedding (``VocabParallelEmbedding``) and an untied
``lm_head`` (``VocabParallelHead``) keep the rows of their slice of the vocabulary (axis 0 in the layout).
A tied embedding stays tied: the same slice serves the input lookup and the head. The lookup gives zeros
for the ids another rank holds and sums over the group; the head gives each rank its slice of the logits,
which ``llm.loss.target_logprobs`` turns into log-probabilities with a logsumexp over the group, chunk by
chunk, never gathering them; calling the model (``model(tokens)``) gathers the whole logits. A vocabulary
that does not divide by the group size, a quantized embedding, or a model with another head stays
replicated.

Everything else (norms, attention that ``shard`` leaves whole, an unsplit embedding or head) is
replicated: every rank computes it on the same batch from the same inputs, and the all-reduces inside
the sharded layers leave bit-identical values on every rank, so its gradients agree across ranks
without communication (``replicated_agree`` checks it). The sharded layers' gradients are each
rank's slice of the full gradient (``AllToShardedLinear`` and the split head all-reduce their input's
gradient in the backward pass), so no gradient is all-reduced; the optimizer state, made from the
sharded parameters, is sharded too.

Checkpoints hold each rank's slices and the layout (see the checkpoint section below); adapters
are written whole (``save_gathered_adapters``). Tensor x data parallelism is not supported: the
whole group is one tensor-parallel group.

Example::

    group = mx.distributed.init()
    layout = shard_model(model, group)       # {"model.layers.0.self_attn.q_proj.weight": 0, ...}
    full = gather_parameters(dict(tree_flatten(model.parameters())), layout, group)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any, Protocol, cast, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mlx_distributed
from mlx.utils import tree_flatten, tree_map_with_path

from mlx_train.checkpointing.format import STEP_DIR, step_name
from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.distributed.reduction import Reduction
from mlx_train.errors import CheckpointError, ConfigError
from mlx_train.snapshot import rng_key, set_rng_key

__all__ = ["Shardable", "shard_model", "shard_layout", "is_sharded", "gather_parameters", "take_shard",
           "tensor_parallel_reduction", "replicated_agree", "ShardedCheckpoints", "write_shard", "read_shard",
           "reshard", "prune_shards", "shard_vocabulary", "replicated_vocabulary", "VocabParallelEmbedding",
           "VocabParallelHead", "Split", "split_sizes", "UnevenAllToShardedLinear", "UnevenShardedToAllLinear",
           "group_counts", "layout_record", "layout_from_record"]

#: The axis of each parameter that MLX's sharded layers split over the group (None: replicated).
MLX_SHARDED_AXES: dict[type, dict[str, int | None]] = {
    mlx_distributed.AllToShardedLinear: {"weight": 0, "bias": 0},
    mlx_distributed.ShardedToAllLinear: {"weight": -1, "bias": None},
    mlx_distributed.QuantizedAllToShardedLinear: {"weight": 0, "scales": 0, "biases": 0, "bias": 0},
    mlx_distributed.QuantizedShardedToAllLinear: {"weight": -1, "scales": -1, "biases": -1, "bias": None},
}


@runtime_checkable
class Shardable(Protocol):
    """A model that splits itself over a group for tensor parallelism (see the module docstring).

    Example (mlx-lm's llama, abridged)::

        def shard(self, group=None):
            group = group or mx.distributed.init()
            for layer in self.model.layers:
                layer.self_attn.q_proj = shard_linear(layer.self_attn.q_proj, "all-to-sharded", group=group)
                layer.self_attn.o_proj = shard_linear(layer.self_attn.o_proj, "sharded-to-all", group=group)
                layer.self_attn.n_heads //= group.size()
    """

    def shard(self, group: Any = None) -> None: ...


class Split(int):
    """A layout entry of unequal slices: the split axis (the ``int`` itself) and each rank's size on it.

    Example: ``Split(0, (384, 192))`` -- axis 0, rank 0 keeps 384 rows, rank 1 the next 192.
    """

    sizes: tuple[int, ...]

    def __new__(cls, axis: int, sizes: tuple[int, ...] | list[int]) -> Split:
        split = super().__new__(cls, axis)
        split.sizes = tuple(int(n) for n in sizes)
        return split

    def __repr__(self) -> str:
        return f"Split({int(self)}, {self.sizes})"


def split_sizes(entry: int, length: int, size: int, key: str = "parameter") -> tuple[int, ...]:
    """Each rank's size on the split axis of a parameter ``length`` long there: ``entry``'s own sizes (a
    ``Split``), else equal slices (``ConfigError`` when ``length`` does not divide by ``size``).

    Example: ``split_sizes(Split(0, (4, 2)), 6, 2)  # (4, 2)``; ``split_sizes(0, 6, 2)  # (3, 3)``
    """
    sizes = getattr(entry, "sizes", None)
    if sizes is not None and len(sizes) == size:
        if sum(sizes) != length:
            raise ConfigError(f"{key} has {length} entries on axis {int(entry)}, but its recorded slices "
                              f"{list(sizes)} add up to {sum(sizes)}")
        return tuple(sizes)
    if sizes is not None:  # recorded for another rank count: the same groups cannot be cut otherwise
        raise ConfigError(f"{key} is split unevenly in {len(sizes)} slices {list(sizes)}; it cannot be cut into "
                          f"{size} by that record")
    if length % size:
        raise ConfigError(f"{key} has {length} entries on axis {int(entry)}, which do not split into {size} "
                          "equal slices")
    return (length // size,) * size


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def layout_record(layout: dict[str, int]) -> dict[str, Any]:
    """What a checkpoint stores of ``layout`` (JSON): ``{"layout": {path: axis}, "sizes": {path: [sizes]}}``,
    the sizes only for unequal slices.

    Example: ``layout_record({"w": Split(0, (4, 2))})  # {"layout": {"w": 0}, "sizes": {"w": [4, 2]}}``
    """
    sizes = {k: list(v.sizes) for k, v in layout.items() if isinstance(v, Split)}
    return {"layout": {k: int(v) for k, v in layout.items()}, **({"sizes": sizes} if sizes else {})}


def layout_from_record(record: dict[str, Any]) -> dict[str, int]:
    """The layout a checkpoint stored (``layout_record``); a plain ``{path: axis}`` one is of equal slices."""
    sizes = record.get("sizes") or {}
    return {k: Split(axis, sizes[k]) if k in sizes else int(axis) for k, axis in record.get("layout", {}).items()}


def _same_layout(a: dict[str, int], b: dict[str, int]) -> bool:
    return a == b and all(getattr(a[k], "sizes", None) == getattr(b[k], "sizes", None) for k in a)


def _axes_of(module: nn.Module) -> dict[str, int | None] | None:
    declared = getattr(module, "sharded_axes", None)
    if isinstance(declared, dict):
        return declared
    return MLX_SHARDED_AXES.get(type(module))


def shard_layout(model: nn.Module) -> dict[str, int]:
    """``{parameter path: split axis (>= 0)}`` of every sharded parameter of ``model``; parameters
    not named are replicated. Empty for a model that is not sharded. A module split in unequal slices
    says so with ``split_sizes`` (each rank's size on its split axis): its entries are ``Split`` values.

    Example: ``shard_layout(model)["model.layers.0.mlp.down_proj.weight"]  # 1``
    """
    layout: dict[str, int] = {}
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


def shard_model(model: nn.Module, group: Any) -> dict[str, int]:
    """Split ``model`` over ``group`` with its ``shard(group)`` method (in place), then its vocabulary
    (``shard_vocabulary``), and return its layout.

    A model already sharded keeps its split layers (its vocabulary is split if it is not yet). Raises
    ``ConfigError`` for a model without ``shard``, or one whose sizes do not divide by the group size.

    Example: ``layout = shard_model(model, mx.distributed.init())``
    """
    if group.size() == 1:
        return shard_layout(model)
    if is_sharded(model):
        shard_vocabulary(model, group)
        return shard_layout(model)
    if not isinstance(model, Shardable):
        raise ConfigError(
            f"strategy 'tensor_parallel' needs a model that can split itself: {type(model).__name__} has no "
            "shard(group) method. mlx-lm models have one; for your own model, write shard(group) that replaces "
            "its large linear layers with mlx.nn.layers.distributed.shard_linear(layer, 'all-to-sharded' | "
            "'sharded-to-all', group=group) (see mlx_train.distributed.tensor_parallel), or train with "
            "strategy='data_parallel'")
    uneven = _uneven_attention(model, group.size())
    _check_heads(model, group.size(), skip=uneven)
    key = rng_key()  # MLX's sharded layers draw initial weights that shard() then replaces
    try:
        whole = [_stand_in(attention, group.size()) for attention in uneven]
        model.shard(group)
        for attention, linears in zip(uneven, whole, strict=True):
            _split_attention_unevenly(attention, linears, group)
    except ValueError as error:  # shard_linear: "Cannot shard the output of size 6 across 4 devices"
        raise ConfigError(
            f"{type(model).__name__}.shard could not split the model over {group.size()} processes: {error}. "
            "Tensor parallelism splits each layer over the whole group (tensor x data parallelism is not "
            "supported): launch a number of processes that divides the number of heads and the hidden sizes"
        ) from error
    finally:  # what follows (adapters, dropout) draws the same numbers as without sharding
        set_rng_key(key)
    shard_vocabulary(model, group)
    layout = shard_layout(model)
    if not layout:
        raise ConfigError(f"{type(model).__name__}.shard(group) left no layer sharded: it must replace layers "
                          "with mlx.nn.layers.distributed.shard_linear (or declare sharded_axes)")
    return layout


def materialize(model: nn.Module) -> None:
    """Evaluate the parameters of a lazily loaded model one at a time (``load_model(path, lazy=True)``, then
    ``shard_model``): each tensor is read whole from its file, its slice kept and the rest freed, so the peak
    is this rank's slices plus one whole tensor. Evaluating them all at once would read every tensor first.

    Example: ``model, _, _ = load_model("base", lazy=True); shard_model(model, group); materialize(model)``
    """
    for _, value in tree_flatten(model.parameters()):
        mx.eval(value)


# -- the vocabulary ---------------------------------------------------------------------------


def _gather_vocabulary(local: mx.array, group: Any) -> mx.array:
    """The whole logits from each rank's slice of the vocabulary (the last axis); the backward pass gives
    each rank its slice of the cotangent (``all_gather``'s own gradient)."""
    joined = mx.distributed.all_gather(mx.moveaxis(local, -1, 0), group=group)
    return mx.moveaxis(joined, 0, -1)


class _VocabularySlice(nn.Module):
    """Rows ``[vocab_offset, vocab_offset + rows)`` of a ``[vocabulary, dims]`` matrix split over ``group``.

    ``local_logits(x)`` is ``x @ weight.T`` for this rank's slice of the vocabulary, with the gradient of ``x``
    summed over the group in the backward pass (as ``AllToShardedLinear`` does); ``llm.loss`` finds a split
    head by it. Calling the module as a head gathers the whole logits.
    """

    sharded_axes: dict[str, int | None] = {"weight": 0}

    def __init__(self, weight: mx.array, group: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        size, rank = group.size(), group.rank()
        rows = weight.shape[0] // size
        self.weight = mx.contiguous(weight[rank * rows:(rank + 1) * rows])
        self.group = group
        self.vocab_offset = rank * rows

    def local_logits(self, x: mx.array) -> mx.array:
        """``[..., rows]``: the logits of this rank's slice of the vocabulary."""
        x = mlx_distributed.sum_gradients(self.group)(x)
        return x @ self.weight.T

    @classmethod
    def of(cls, module: nn.Module, group: Any) -> Any:
        """This rank's rows of ``module``'s ``weight`` (an ``nn.Embedding`` or a bias-free ``nn.Linear``),
        frozen if ``module`` was."""
        split = cls(module.weight, group)
        if not tree_flatten(module.trainable_parameters()):
            split.freeze()
        return split


class VocabParallelEmbedding(_VocabularySlice):
    """``nn.Embedding`` split by vocabulary rows over a group: a lookup gives each id's row from the rank that
    holds it (zeros elsewhere, summed over the group; the gradient lands in that rank's rows only), and
    ``as_linear`` (a tied head) the whole logits, gathered. Parameter name and layout: ``weight``, axis 0.

    Example: ``model.model.embed_tokens = VocabParallelEmbedding.of(model.model.embed_tokens, group)``
    """

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.vocab_offset
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[mx.where(inside, local, 0)]
        return mx.distributed.all_sum(mx.where(inside[..., None], rows, mx.zeros_like(rows)), group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        """The whole logits of a tied head (each rank's slice, gathered)."""
        return _gather_vocabulary(self.local_logits(x), self.group)


class VocabParallelHead(_VocabularySlice):
    """An output ``nn.Linear`` (no bias) split by vocabulary rows over a group: called, it gives the whole
    logits (gathered); ``local_logits`` this rank's slice. Parameter name and layout: ``weight``, axis 0.

    Example: ``model.lm_head = VocabParallelHead.of(model.lm_head, group)``
    """

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_vocabulary(self.local_logits(x), self.group)


def shard_vocabulary(model: nn.Module, group: Any) -> bool:
    """Split ``model``'s token embedding (and an untied ``lm_head``) by vocabulary rows over ``group``, in
    place; True when split (or already split). Left replicated (False): a model whose head
    ``llm.loss.output_head`` does not find, a vocabulary that does not divide by ``group.size()``, a
    quantized embedding or a head with a bias.

    Example: ``shard_vocabulary(model, group)  # model.model.embed_tokens is a VocabParallelEmbedding``
    """
    from mlx_train.llm.loss import output_head

    found = output_head(model) if group.size() > 1 else None
    if found is None:
        return False
    head, _ = found
    body = model["model"]
    embedding = body.get("embed_tokens")
    if isinstance(embedding, VocabParallelEmbedding):
        return True
    tied = head is embedding
    if type(embedding) is not nn.Embedding or embedding.weight.shape[0] % group.size():
        return False
    if not tied and (type(head) is not nn.Linear or "bias" in head or head.weight.shape[0] % group.size()):
        return False
    body.embed_tokens = VocabParallelEmbedding.of(embedding, group)
    if not tied:
        model.lm_head = VocabParallelHead.of(cast(nn.Linear, head), group)
    return True


HEAD_COUNTS = ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads")


def _check_heads(model: nn.Module, size: int, skip: list[nn.Module] | None = None) -> None:
    """Attention heads must divide over the ranks (mlx-lm's ``shard`` divides them without checking, and
    the model then fails at its first forward pass), unless the attention is split unevenly (``skip``)."""
    skipped = {id(m) for m in skip or []}
    for path, module in model.named_modules():
        if id(module) in skipped:
            continue
        for name in HEAD_COUNTS:
            count = getattr(module, name, None)
            if isinstance(count, int) and not isinstance(count, bool) and count % size:
                raise ConfigError(
                    f"{path}.{name} is {count}: {count} attention heads do not split over {size} processes. "
                    f"Launch a number of processes that divides it, or split only the MLPs (a shard(group) that "
                    "leaves attention whole; see mlx_train.distributed.tensor_parallel)")


# -- attention split unevenly by key/value groups --------------------------------------------------

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _count(module: nn.Module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _uneven_attention(model: nn.Module, size: int) -> list[nn.Module]:
    """The llama-style attention modules of ``model`` whose heads do not divide by ``size`` but whose
    key/value groups are at least ``size``: those split unevenly by groups."""
    found = []
    for _, module in model.named_modules():
        heads, groups = _count(module, "n_heads"), _count(module, "n_kv_heads")
        if heads is None or groups is None or (heads % size == 0 and groups % size == 0):
            continue
        if groups < size or heads % groups or not all(type(module.get(n)) is nn.Linear for n in ATTENTION_LINEARS):
            continue
        found.append(module)
    return found


def group_counts(groups: int, size: int) -> list[int]:
    """How many key/value groups each rank keeps: contiguous runs, the lower ranks one more.

    Example: ``group_counts(3, 2)  # [2, 1]``
    """
    base, extra = divmod(groups, size)
    return [base + (1 if rank < extra else 0) for rank in range(size)]


def _stand_in(attention: nn.Module, size: int) -> tuple[Any, ...]:
    """Take ``attention``'s projections and head counts out of the way of the model's ``shard`` (which
    divides them evenly), leaving small stand-ins it can split; returns what was taken."""
    taken = (*(attention[n] for n in ATTENTION_LINEARS), attention.n_heads, attention.n_kv_heads)
    for name in ATTENTION_LINEARS:
        setattr(attention, name, nn.Linear(size, size, bias=False))
    attention.n_heads = attention.n_kv_heads = size
    return taken


def _split_attention_unevenly(attention: nn.Module, taken: tuple[Any, ...], group: Any) -> None:
    """Give ``attention`` this rank's key/value groups (``group_counts``) and their query heads."""
    q, k, v, o, heads, groups = taken
    counts = group_counts(groups, group.size())
    per_group = heads // groups

    def sizes(rows: int, per_head: int) -> tuple[int, ...]:
        return tuple(c * per_head * (rows // (groups * per_head)) for c in counts)

    attention.q_proj = UnevenAllToShardedLinear(q, sizes(q.weight.shape[0], per_group), group)
    attention.k_proj = UnevenAllToShardedLinear(k, sizes(k.weight.shape[0], 1), group)
    attention.v_proj = UnevenAllToShardedLinear(v, sizes(v.weight.shape[0], 1), group)
    attention.o_proj = UnevenShardedToAllLinear(o, sizes(o.weight.shape[1], per_group), group)
    attention.n_heads = counts[group.rank()] * per_group
    attention.n_kv_heads = counts[group.rank()]


def _own_slice(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


class UnevenAllToShardedLinear(mlx_distributed.AllToShardedLinear):
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


class UnevenShardedToAllLinear(mlx_distributed.ShardedToAllLinear):
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


def gather_parameters(flat: dict[str, mx.array], layout: dict[str, int], group: Any) -> dict[str, mx.array]:
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
        axis = layout.get(key)
        if axis is None:
            out[key] = value
            continue
        moved = mx.moveaxis(value, axis, 0)
        sizes = getattr(axis, "sizes", None)
        longest = max(sizes) if sizes else moved.shape[0]
        if longest > moved.shape[0]:
            moved = mx.concatenate([moved, mx.zeros((longest - moved.shape[0], *moved.shape[1:]), moved.dtype)])
        joined = mx.distributed.all_gather(moved, group=group, stream=mx.cpu)
        if sizes and len(set(sizes)) > 1:
            joined = mx.concatenate([joined[r * longest:r * longest + n] for r, n in enumerate(sizes)])
        out[key] = mx.moveaxis(joined, 0, axis)
        mx.eval(out[key])  # one at a time: never every gathered matrix pending at once
    return out


def take_shard(flat: dict[str, mx.array], layout: dict[str, int], rank: int, size: int) -> dict[str, mx.array]:
    """This rank's slices of whole parameters (the inverse of ``gather_parameters``): equal ones, or each
    rank's size of a ``Split`` entry.

    Example: ``mine = take_shard(full, layout, group.rank(), group.size())``
    """
    out = {}
    for key, value in flat.items():
        axis = layout.get(key)
        if axis is None:
            out[key] = value
            continue
        sizes = split_sizes(axis, value.shape[axis], size, key)
        out[key] = mx.contiguous(mx.split(value, _offsets(sizes)[1:-1], axis=axis)[rank])
    return out


def tensor_parallel_reduction(group: Any, layout: dict[str, int],
                              before_update: Callable[[], None] | None = None) -> Reduction:
    """The step's reduction for tensor parallelism: no gradient is all-reduced (each rank's slice is its
    shard's exact gradient, replicated parameters agree by construction); the ranks' stop vote is summed
    (one scalar), and clipping uses the norm of the whole gradient: the sharded parameters' squares
    summed over ranks plus the replicated ones' counted once.
    """
    votes = {"stop": mx.array(0.0)}

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        votes["stop"] = mx.distributed.all_sum(votes["stop"], group=group)
        return grads, n_items

    def clip(grads: Any, max_norm: float | None) -> tuple[Any, mx.array | None]:
        if max_norm is None:
            return grads, None
        flat = tree_flatten(grads)
        sharded = [mx.sum(mx.square(g)) for k, g in flat if k in layout]
        replicated = [mx.sum(mx.square(g)) for k, g in flat if k not in layout]
        squares = mx.array(0.0)
        if sharded:
            squares = mx.distributed.all_sum(sum(sharded[1:], sharded[0]), group=group)
        if replicated:
            squares = squares + sum(replicated[1:], replicated[0])
        norm = mx.sqrt(squares)
        normalizer = mx.minimum(max_norm / (norm + 1e-6), 1.0)  # as optim.clip_grad_norm
        return tree_map_with_path(lambda _, g: g * normalizer, grads), norm

    return Reduction(reduce, clip, before_update, state=votes)


def replicated_agree(model: nn.Module, layout: dict[str, int], group: Any) -> list[str]:
    """The replicated parameters whose values differ between ranks (empty when all agree bit for bit).

    Example: ``assert not replicated_agree(model, layout, group)``
    """
    if group.size() == 1:
        return []
    differing = []
    for key, value in tree_flatten(model.parameters()):
        if key in layout:
            continue
        stacked = mx.distributed.all_gather(value.reshape(1, -1), group=group, stream=mx.cpu)
        if not bool(mx.all(stacked == stacked[0:1]).item()):
            differing.append(key)
    return differing


# -- checkpoints ------------------------------------------------------------------------------
#
# Rank 0's checkpoint (``step-N``, written by the CheckpointManager as in any run) holds the loop
# state, rank 0's slices and, under ``"tensor_parallel"`` in its JSON, the world size and the layout.
# Every other rank writes its slices to ``<checkpoint_dir>/tp-shards/step-N/rank-<r>.safetensors``
# (``model.*`` and ``optimizer.*``) before rank 0 starts its save, so a complete ``step-N`` always
# has its shards. A checkpoint with another layout or world size (or a whole one) is re-sharded.

SHARDS_DIR = "tp-shards"


class ShardedCheckpoints(CheckpointManager):
    """A CheckpointManager whose checkpoints record the tensor-parallel layout (``record``)."""

    def __init__(self, directory: str, record: dict[str, Any], **options: Any) -> None:
        super().__init__(directory, **options)
        self.record = record

    def save(self, step: int, arrays: dict[str, dict[str, mx.array]], state: dict[str, Any],
             metrics: dict[str, Any] | None = None) -> str:
        record = {**self.record, **layout_record(self.record.get("layout", {}))}  # the sizes of uneven splits
        return super().save(step, arrays, {**state, "tensor_parallel": record}, metrics)


def shard_path(directory: str, step: int, rank: int) -> str:
    """Where rank ``rank`` (>= 1) keeps its slices of the checkpoint of ``step``."""
    return os.path.join(directory, SHARDS_DIR, step_name(step), f"rank-{rank}.safetensors")


def write_shard(directory: str, step: int, rank: int, model: dict[str, mx.array],
                optimizer: dict[str, mx.array]) -> str:
    """Write one rank's slices atomically (a temporary file renamed into place); returns the path."""
    path = shard_path(directory, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.safetensors"
    flat = {**{"model." + k: v for k, v in model.items()}, **{"optimizer." + k: v for k, v in optimizer.items()}}
    mx.save_safetensors(tmp, flat, metadata={"step": str(step), "rank": str(rank)})
    os.replace(tmp, path)
    return path


def read_shard(checkpoint: str, step: int, rank: int) -> dict[str, dict[str, mx.array]]:
    """``{"model": ..., "optimizer": ...}`` of rank ``rank`` for the checkpoint at ``checkpoint``."""
    path = shard_path(os.path.dirname(checkpoint.rstrip("/")), step, rank)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint {checkpoint} belongs to a tensor-parallel run, but rank {rank}'s slices ({path}) are "
            "missing: restore that file, or resume from an earlier checkpoint of the run")
    flat = mx.load(path)
    return {group: {k[len(group) + 1:]: v for k, v in flat.items() if k.startswith(group + ".")}  # type: ignore[union-attr]
            for group in ("model", "optimizer")}


def prune_shards(directory: str) -> None:
    """Delete the shard directories whose checkpoint is gone (older than the newest checkpoint only: a
    newer one may still be being written)."""
    root = os.path.join(directory, SHARDS_DIR)
    if not os.path.isdir(root):
        return
    kept = {name for name in os.listdir(directory) if STEP_DIR.match(name)}
    newest = max(kept, default="")
    for name in os.listdir(root):
        if STEP_DIR.match(name) and name not in kept and name < newest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def optimizer_layout(optimizer_state: dict[str, mx.array], layout: dict[str, int]) -> dict[str, int]:
    """The split axis of each optimizer state entry that mirrors a split parameter (Adam's ``<param>.m``)."""
    out = {}
    for key in optimizer_state:
        parameter = key.rsplit(".", 1)[0]
        if parameter in layout:
            out[key] = layout[parameter]
    return out


def reshard(checkpoint: str, arrays: dict[str, dict[str, mx.array]], saved: dict[str, Any],
            layout: dict[str, int], rank: int, size: int) -> dict[str, dict[str, mx.array]]:
    """This rank's ``model``/``optimizer`` arrays from a checkpoint of any layout: its own file when the
    checkpoint was written by ``size`` ranks with the same layout; otherwise the whole arrays (joined
    from every rank's slices, or a whole checkpoint as is) cut into this run's slices. A record without
    ``"sizes"`` (older checkpoints) is of equal slices.
    """
    record = saved.get("tensor_parallel") or {"world_size": 1, "layout": {}}
    world, old_layout = record["world_size"], layout_from_record(record)
    if world == size and _same_layout(old_layout, layout):
        return arrays if rank == 0 else {**arrays, **read_shard(checkpoint, saved["step"], rank)}
    parts = [arrays] + [read_shard(checkpoint, saved["step"], r) for r in range(1, world)]
    out = dict(arrays)
    for group in ("model", "optimizer"):
        old_axes = old_layout if group == "model" else optimizer_layout(arrays[group], old_layout)
        new_axes = layout if group == "model" else optimizer_layout(arrays[group], layout)
        whole = {k: mx.concatenate([p[group][k] for p in parts], axis=old_axes[k]) if k in old_axes else v
                 for k, v in arrays[group].items()}
        out[group] = take_shard(whole, new_axes, rank, size)
    return out


# -- fine-tuning ------------------------------------------------------------------------------


def shard_for_finetune(model: nn.Module, spec: Any, group: Any) -> dict[str, int]:
    """Split an (mlx-lm) model over ``group`` and add ``spec``'s adapters (an ``llm.adapters.AdapterConfig``),
    split with their layers; returns the layout. Call it on every rank before making the trainer.

    Example: ``shard_for_finetune(model, AdapterConfig("lora", num_layers=8), mx.distributed.init())``
    """
    from mlx_train.llm.adapters import apply_adapters

    shard_model(model, group)
    note = replicated_vocabulary(model, group)
    if note and group.rank() == 0:
        print(note, flush=True)
    materialize(model)
    apply_adapters(model, spec)
    return shard_layout(model)


def replicated_vocabulary(model: nn.Module, group: Any) -> str | None:
    """A line saying why the token embedding of a split ``model`` stays whole on every rank, None when it is
    split by vocabulary (or the model has no ``model.embed_tokens``).

    Example: ``replicated_vocabulary(model, group)`` -> ``"the vocabulary (49153 rows) does not divide ..."``
    """
    body = model.get("model") if isinstance(model, nn.Module) else None
    embedding = body.get("embed_tokens") if isinstance(body, nn.Module) else None
    if embedding is None or isinstance(embedding, VocabParallelEmbedding) or group.size() == 1:
        return None
    rows = embedding.weight.shape[0]
    why = (f"the vocabulary ({rows} rows) does not divide by {group.size()} ranks" if rows % group.size() else
           f"{type(embedding).__name__} (or the model's head) is not one that splits by vocabulary")
    return f"{why}: the token embedding and output head stay whole on every rank"


def save_gathered_adapters(model: nn.Module, spec: Any, directory: str, group: Any,
                           extra: dict[str, Any] | None = None) -> str | None:
    """Write the trained parameters whole, in mlx-lm's adapter format (``mlx_lm.load(base,
    adapter_path=directory)`` reads them on one machine). Every rank must call it (the slices are
    gathered); rank 0 writes and returns the directory, the others return None.

    Example: ``save_gathered_adapters(model, spec, "adapters", group, extra={"model": "base-dir"})``
    """
    from mlx_train.llm.adapters import save_adapters

    trained = dict(tree_flatten(model.trainable_parameters()))
    whole = gather_parameters(trained, shard_layout(model), group)
    if group is not None and group.rank() != 0:
        return None
    return save_adapters(model, spec, directory, extra=extra, weights=whole)


class TensorParallelAdapters:
    """The ``llm.finetune.AdapterSplit`` of a tensor-parallel run: the model is split over ``group`` with
    its ``shard(group)`` and the adapters added to the split layers (``shard_for_finetune``); they are
    written whole, gathered from the ranks (``save_gathered_adapters``).

    Example: ``finetune(config, trainer_class=DistributedTrainer, split=TensorParallelAdapters(group))``
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def add(self, model: Any, spec: Any) -> None:
        shard_for_finetune(model, spec, self.group)

    def save(self, model: Any, spec: Any, directory: str, extra: dict[str, Any]) -> None:
        save_gathered_adapters(model, spec, directory, self.group, extra=extra)

    def whole_at_checkpoint(self, model: Any, path: str, step: int) -> dict[str, Any]:
        """Rank 0's slices joined with those the other ranks wrote beside the checkpoint (at a checkpoint only
        rank 0 runs the callbacks, so nothing can be gathered), along the layout's axes."""
        mine = dict(tree_flatten(model.trainable_parameters()))
        layout = shard_layout(model)
        parts = [mine] + [read_shard(path, step, rank)["model"] for rank in range(1, self.group.size())]
        return {key: mx.concatenate([part[key] for part in parts], axis=layout[key]) if key in layout else value
                for key, value in mine.items()}


def finetune_split(config: Any, group: Any) -> TensorParallelAdapters | None:
    """The split of a ``distributed_strategy: tensor_parallel`` fine-tune over ``group`` (None for a group of
    one). ``llm.finetune.prepare`` then loads an mlx-lm base lazily and ``shard_for_finetune`` evaluates it
    after splitting, so each rank reads only its slices into memory.

    Example: ``finetune(config, trainer_class=DistributedTrainer, split=finetune_split(config, group))``
    """
    from mlx_train.llm.finetune import check_tensor_parallel

    check_tensor_parallel(config)
    if group.size() > 1 and str(config.model).endswith(".gguf") and group.rank() == 0:
        print(f"{config.model}: a GGUF base is dequantized as it loads, so every rank loads it whole before "
              "splitting it (an mlx-lm directory loads lazily: each rank keeps only its slices)", flush=True)
    return TensorParallelAdapters(group) if group.size() > 1 else None
