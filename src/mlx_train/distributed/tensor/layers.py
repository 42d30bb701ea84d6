"""The layers of a tensor-parallel model and the function that splits a model into them.

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

Attention whose heads do not divide by the group size (SmolLM2's 9 query and 3 key/value heads over 2
ranks) is split unevenly by key/value groups, for mlx-lm's llama-style attention (``n_heads``,
``n_kv_heads``, unquantized ``q_proj``/``k_proj``/``v_proj``/``o_proj``): rank r keeps a contiguous run of
whole groups, the lower ranks one more (3 groups over 2 ranks: 2 + 1), with their query heads
(``linears.UnevenAllToShardedLinear`` for q/k/v, ``linears.UnevenShardedToAllLinear`` for o); their layout
entries are ``layout.Split`` values. MLX's sharded linears become ``linears.Tracked*`` layers, which make their
collectives through ``distributed.collectives``. Attention with fewer key/value heads than ranks is refused.

The vocabulary (``shard_vocabulary``): given the model's output head (``shard_model(..., head=...)``; the
language-model side passes mlx-lm's, ``llm.tensor_parallel``), a token embedding and an untied head whose
vocabulary divides by the group size keep the rows of their slice (``VocabParallelEmbedding``,
``VocabParallelHead``; axis 0 in the layout). A tied embedding stays tied. Both are ``VocabularySlice``\\ s:
the declared type by which ``llm.loss`` runs its log-softmax over the group on each rank's slice of the
logits, never gathering them; calling the head gathers the whole logits.

Example::

    group = mx.distributed.init()
    layout = shard_model(model, group)       # {"model.layers.0.self_attn.q_proj.weight": 0, ...}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_train.distributed import collectives
from mlx_train.distributed.tensor.layout import Layout, is_sharded, shard_layout
from mlx_train.distributed.tensor.linears import UnevenAllToShardedLinear, UnevenShardedToAllLinear, track_collectives
from mlx_train.errors import ConfigError
from mlx_train.snapshot import rng_key, set_rng_key

__all__ = ["Shardable", "shard_model", "materialize", "VocabularySlice", "VocabParallelEmbedding",
           "VocabParallelHead", "shard_vocabulary", "group_counts", "HEAD_COUNTS", "split_problem", "process_counts",
           "describe_counts"]


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


def shard_model(model: nn.Module, group: Any, head: Callable[[nn.Module], nn.Module | None] | None = None) -> Layout:
    """Split ``model`` over ``group`` with its ``shard(group)`` method (in place), then its vocabulary
    (``shard_vocabulary``, when ``head(model)`` names the module that gives the logits), and return its layout.

    A model already sharded keeps its split layers (its vocabulary is split if it is not yet). Raises
    ``ConfigError`` for a model without ``shard``, or one whose sizes do not divide by the group size.

    Example: ``layout = shard_model(model, mx.distributed.init())``
    """
    if group.size() == 1:
        return shard_layout(model)
    if is_sharded(model):
        shard_vocabulary(model, group, head(model) if head else None)
        track_collectives(model)
        return shard_layout(model)
    if not isinstance(model, Shardable):
        raise ConfigError(
            f"strategy 'tensor_parallel' needs a model that can split itself: {type(model).__name__} has no "
            "shard(group) method. mlx-lm models have one; for your own model, write shard(group) that replaces "
            "its large linear layers with mlx.nn.layers.distributed.shard_linear(layer, 'all-to-sharded' | "
            "'sharded-to-all', group=group) (see mlx_train.distributed.tensor.layers), or train with "
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
    shard_vocabulary(model, group, head(model) if head else None)
    track_collectives(model)
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
    joined = collectives.all_gather(mx.moveaxis(local, -1, 0), group=group)
    return mx.moveaxis(joined, 0, -1)


class VocabularySlice(nn.Module, collectives.Tracked):
    """Rows ``[vocab_offset, vocab_offset + rows)`` of a ``[vocabulary, dims]`` matrix split over ``group``:
    the type of a head split by vocabulary, which ``llm.loss`` recognises (``isinstance``) to normalise the
    log-softmax over the group.

    ``local_logits(x)`` is ``x @ weight.T`` for this rank's slice of the vocabulary, with the gradient of ``x``
    summed over the group in the backward pass (as ``AllToShardedLinear`` does).

    Example: ``isinstance(model.lm_head, VocabularySlice) and model.lm_head.local_logits(hidden)``
    """

    sharded_axes: dict[str, int | None] = {"weight": 0}
    vocab_offset: int  #: the first vocabulary row this rank holds
    group: Any  #: the group the vocabulary is split over

    def __init__(self, weight: mx.array, group: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        size, rank = group.size(), group.rank()
        rows = weight.shape[0] // size
        self.weight = mx.contiguous(weight[rank * rows:(rank + 1) * rows])
        self.group = group
        self.vocab_offset = rank * rows

    def local_logits(self, x: mx.array) -> mx.array:
        """``[..., rows]``: the logits of this rank's slice of the vocabulary."""
        x = collectives.sum_gradients(self.group)(x)
        return x @ self.weight.T

    @classmethod
    def of(cls, module: nn.Module, group: Any) -> Any:
        """This rank's rows of ``module``'s ``weight`` (an ``nn.Embedding`` or a bias-free ``nn.Linear``),
        frozen if ``module`` was."""
        split = cls(module.weight, group)
        if not tree_flatten(module.trainable_parameters()):
            split.freeze()
        return split


class VocabParallelEmbedding(VocabularySlice):
    """``nn.Embedding`` split by vocabulary rows over a group: a lookup gives each id's row from the rank that
    holds it (zeros elsewhere, summed over the group; the gradient lands in that rank's rows only), and
    ``as_linear`` (a tied head) the whole logits, gathered. Parameter name and layout: ``weight``, axis 0.

    Example: ``model.model.embed_tokens = VocabParallelEmbedding.of(model.model.embed_tokens, group)``
    """

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.vocab_offset
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[mx.where(inside, local, 0)]
        return collectives.all_sum(mx.where(inside[..., None], rows, mx.zeros_like(rows)), group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        """The whole logits of a tied head (each rank's slice, gathered)."""
        return _gather_vocabulary(self.local_logits(x), self.group)


class VocabParallelHead(VocabularySlice):
    """An output ``nn.Linear`` (no bias) split by vocabulary rows over a group: called, it gives the whole
    logits (gathered); ``local_logits`` this rank's slice. Parameter name and layout: ``weight``, axis 0.

    Example: ``model.lm_head = VocabParallelHead.of(model.lm_head, group)``
    """

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_vocabulary(self.local_logits(x), self.group)


def shard_vocabulary(model: nn.Module, group: Any, head: nn.Module | None) -> bool:
    """Split ``model``'s token embedding (``model.model.embed_tokens``) and its output ``head`` (``lm_head``, or
    the embedding itself when tied) by vocabulary rows over ``group``, in place; True when split (or already
    split). Left replicated (False): no ``head``, a vocabulary that does not divide by ``group.size()``, a
    quantized embedding or a head with a bias.

    Example: ``shard_vocabulary(model, group, model.lm_head)  # model.model.embed_tokens is split``
    """
    if head is None or group.size() == 1:
        return False
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


def split_problem(size: int, heads: int | None, kv_heads: int | None = None, mlp: Sequence[int] = (),
                  uneven: bool = True) -> str | None:
    """Why attention with ``heads`` query heads in ``kv_heads`` key/value groups (None: as many as ``heads``) and
    MLPs of ``mlp`` hidden units cannot be split over ``size`` processes, or None when they can: evenly, or
    unevenly by whole key/value groups where ``uneven`` (llama-style unquantized attention, see the module
    docstring). The one rule for the check before launching and the ranks' own.

    Example: ``split_problem(4, 9, 3)`` -> ``"its 3 key/value heads cannot go to 4 processes: each needs one"``
    """
    if size <= 1:
        return None
    kv = kv_heads or heads
    if heads is not None and kv is not None and (heads % size or kv % size):
        if kv < size:
            return f"its {kv} key/value head{'s' if kv != 1 else ''} cannot go to {size} processes: each needs one"
        if not uneven or heads % kv:
            return (f"its {heads} attention heads in {kv} key/value groups do not divide by {size}, and this "
                    "attention is split only evenly (unequal runs of whole groups need llama-style unquantized "
                    "q/k/v/o projections)")
    for width in mlp:
        if width % size:
            return f"its MLP's {width} hidden units do not divide by {size}"
    return None


def process_counts(most: int, heads: int | None, kv_heads: int | None = None, mlp: Sequence[int] = (),
                   uneven: bool = True) -> list[int]:
    """The numbers of processes from 2 to ``most`` that ``split_problem`` allows.

    Example: ``process_counts(8, 9, 3)`` -> ``[2, 3]``
    """
    return [size for size in range(2, most + 1) if split_problem(size, heads, kv_heads, mlp, uneven) is None]


def describe_counts(counts: list[int]) -> str:
    """``"2 or 3"``, ``"2, 4 or 8"`` (past twelve: ``"2, 3, ... 13, ..."``); empty for none."""
    words = [str(n) for n in counts]
    if len(words) > 12:
        return f"{', '.join(words[:12])}, ..."
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}" if words else ""


def _llama_attention(module: nn.Module) -> bool:
    """mlx-lm's llama-style attention, unquantized: what ``_uneven_attention`` can split by whole groups."""
    return _count(module, "n_heads") is not None and _count(module, "n_kv_heads") is not None and \
        all(type(module.get(n)) is nn.Linear for n in ATTENTION_LINEARS)


def _check_heads(model: nn.Module, size: int, skip: list[nn.Module] | None = None) -> None:
    """Attention heads must split over the ranks (mlx-lm's ``shard`` divides them without checking, and the
    model then fails at its first forward pass), evenly or, for the attention in ``skip``, by key/value groups;
    the error names the numbers of processes that split it."""
    skipped = {id(m) for m in skip or []}
    for path, module in model.named_modules():
        heads = _count(module, "n_heads") or _count(module, "num_heads")
        kv = _count(module, "n_kv_heads") or _count(module, "num_key_value_heads")
        if id(module) in skipped or (heads is None and kv is None):
            continue
        uneven = _llama_attention(module)
        why = split_problem(size, heads or kv, kv, uneven=uneven)
        if why:
            counts = describe_counts(process_counts(max(size, kv or heads or 1), heads or kv, kv, uneven=uneven))
            fits = f"this attention splits over {counts} processes: launch that many" if counts else \
                "no number of processes splits it: train with strategy 'data_parallel'"
            raise ConfigError(
                f"{path} cannot be split over {size} processes: {why}; {fits}, or split only the MLPs (a "
                "shard(group) that leaves attention whole; see mlx_train.distributed.tensor.layers)")


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
