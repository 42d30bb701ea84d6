"""Built-in models: a small MLP, a small CNN and a character-level Transformer.

They exist so that ``mlx-train train`` works out of the box on the built-in
datasets and so that tests have real models to train. Any ``mlx.nn.Module``
works with the Trainer; these are nothing special.

Example::

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model

    data = load_dataset("digits")
    model = build_model("mlp", data["info"], hidden_dims=[256])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_train.builtin import check_options
from mlx_train.errors import ConfigError, DataError, did_you_mean

__all__ = [
    "MLP",
    "SmallCNN",
    "CharTransformerLM",
    "build_model",
    "available_models",
    "check_options",
]


def _dropout(p: float) -> nn.Module:
    # A zero-probability Dropout would still draw random numbers every step.
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {p}")
    return nn.Dropout(p) if p > 0 else nn.Identity()


class MLP(nn.Module):
    """A multi-layer perceptron with ReLU activations for classification.

    Inputs of any shape ``[B, ...]`` are flattened to ``[B, in_dims]``.

    Example::

        model = MLP(in_dims=64, hidden_dims=(128,), num_classes=10)
        logits = model(mx.zeros((32, 64)))     # [32, 10]
    """

    def __init__(
        self,
        in_dims: int,
        hidden_dims: Sequence[int] = (128,),
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        sizes = [in_dims, *hidden_dims, num_classes]
        if any(int(s) <= 0 for s in sizes):
            raise ConfigError(f"MLP layer sizes must be positive, got {sizes}")
        self.layers = [nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=False)]
        self.dropout = _dropout(dropout)

    def __call__(self, x: mx.array) -> mx.array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = self.dropout(nn.relu(layer(x)))
        return self.layers[-1](x)


class SmallCNN(nn.Module):
    """A small convolutional classifier for channels-last (NHWC) images.

    Each entry of ``channels`` adds a 3x3 convolution, a ReLU and a 2x2 max-pool;
    a hidden dense layer follows. Flat inputs ``[B, H*W*C]`` are reshaped to
    ``image_shape`` first, so the same dataset arrays feed the MLP and the CNN.

    Example::

        model = SmallCNN(image_shape=(8, 8, 1), num_classes=10)
        logits = model(mx.zeros((32, 8, 8, 1)))    # [32, 10]
    """

    def __init__(
        self,
        image_shape: Sequence[int] = (8, 8, 1),
        num_classes: int = 10,
        channels: Sequence[int] = (32, 64),
        hidden_dims: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        height, width, in_channels = (int(s) for s in image_shape)
        shrink = 2 ** len(channels)
        if height < shrink or width < shrink:
            raise ConfigError(
                f"SmallCNN with {len(channels)} conv blocks halves the image {len(channels)} "
                f"times, too often for image_shape {tuple(image_shape)}: use fewer channels entries"
            )
        self.image_shape = (height, width, in_channels)
        sizes = [in_channels, *channels]
        self.convs = [nn.Conv2d(a, b, kernel_size=3, padding=1) for a, b in zip(sizes[:-1], sizes[1:], strict=False)]
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        flat = (height // shrink) * (width // shrink) * sizes[-1]
        self.hidden = nn.Linear(flat, hidden_dims)
        self.head = nn.Linear(hidden_dims, num_classes)
        self.dropout = _dropout(dropout)

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 2:
            x = x.reshape(x.shape[0], *self.image_shape)
        for conv in self.convs:
            x = self.pool(nn.relu(conv(x)))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nn.relu(self.hidden(x)))
        return self.head(x)


class TransformerBlock(nn.Module):
    """A pre-norm Transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dims: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        self.attention_norm = nn.LayerNorm(dims)
        self.attention = nn.MultiHeadAttention(dims, num_heads, bias=True)
        self.mlp_norm = nn.LayerNorm(dims)
        self.mlp = nn.Sequential(nn.Linear(dims, 4 * dims), nn.GELU(), nn.Linear(4 * dims, dims))
        self.dropout = _dropout(dropout)

    def shard(self, group: Any = None) -> None:
        """Split the block over ``group`` (tensor parallelism): each rank keeps ``num_heads / N`` heads and
        ``4 dims / N`` hidden units; the output projections sum the ranks' parts. The norms stay whole."""
        from mlx.nn.layers.distributed import shard_linear

        group = group or mx.distributed.init()
        size = group.size()
        attention = self.attention
        if attention.num_heads % size:
            raise ConfigError(f"{attention.num_heads} attention heads do not split over {size} processes: "
                              "launch a number of processes that divides num_heads")
        for name in ("query_proj", "key_proj", "value_proj"):
            setattr(attention, name, shard_linear(getattr(attention, name), "all-to-sharded", group=group))
        attention.out_proj = shard_linear(attention.out_proj, "sharded-to-all", group=group)
        attention.num_heads //= size
        self.mlp.layers[0] = shard_linear(self.mlp.layers[0], "all-to-sharded", group=group)
        self.mlp.layers[2] = shard_linear(self.mlp.layers[2], "sharded-to-all", group=group)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.attention_norm(x)
        x = x + self.dropout(self.attention(h, h, h, mask="causal"))
        update: mx.array = self.dropout(self.mlp(self.mlp_norm(x)))  # nn layers are unannotated
        return x + update


class CharTransformerLM(nn.Module):
    """A small GPT-style character language model.

    Takes token ids ``[B, T]`` (``T <= block_size``) and returns next-token
    logits ``[B, T, vocab_size]``. The repeated blocks are in ``self.layers``.

    Example::

        model = CharTransformerLM(vocab_size=100, dims=128, num_layers=2)
        logits = model(mx.zeros((4, 64), dtype=mx.int32))    # [4, 64, 100]
    """

    def __init__(
        self,
        vocab_size: int,
        dims: int = 128,
        num_heads: int = 4,
        num_layers: int = 2,
        block_size: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        if dims % num_heads:
            raise ConfigError(
                f"CharTransformerLM: dims ({dims}) must be a multiple of num_heads ({num_heads}); "
                "change one of the two model options"
            )
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, dims)
        self.position_embedding = nn.Embedding(block_size, dims)
        self.dropout = _dropout(dropout)
        self.layers = [TransformerBlock(dims, num_heads, dropout) for _ in range(num_layers)]
        self.norm = nn.LayerNorm(dims)
        self.head = nn.Linear(dims, vocab_size, bias=False)

    def shard(self, group: Any = None) -> None:
        """Split every block over ``group`` for tensor parallelism (the protocol of
        ``mlx_train.distributed.tensor``, as mlx-lm's ``Model.shard``); the embeddings, the
        final norm and the output head stay whole on every rank.

        Example: ``model.shard(mx.distributed.init())`` in each of the launched processes.
        """
        group = group or mx.distributed.init()
        for layer in self.layers:
            layer.shard(group)

    def __call__(self, tokens: mx.array) -> mx.array:
        if tokens.ndim != 2 or tokens.shape[1] > self.block_size:
            raise DataError(
                f"CharTransformerLM expects token ids shaped [batch, length] with length <= "
                f"block_size={self.block_size}, got shape {tuple(tokens.shape)}; feed "
                f"tokens[:, :-1] of the dataset's [N, block_size + 1] chunks"
            )
        positions = mx.arange(tokens.shape[1])
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class _ModelSpec:
    builder: Callable[..., nn.Module]
    from_info: tuple[str, ...]  # constructor arguments that come from the dataset's info
    task: str
    tuned: dict[str, Any] = field(default_factory=dict)  # registry defaults, overridable by options


# The "tuned" options are what `mlx-train train` uses when the user gives none.
_MODELS: dict[str, _ModelSpec] = {
    "mlp": _ModelSpec(MLP, ("in_dims", "num_classes"), "classification", {"hidden_dims": (256,)}),
    "cnn": _ModelSpec(SmallCNN, ("image_shape", "num_classes"), "classification"),
    "transformer": _ModelSpec(CharTransformerLM, ("vocab_size", "block_size"), "language_modeling"),
}


def available_models() -> list[str]:
    """Names accepted by :func:`build_model`, e.g. ``["cnn", "mlp", "transformer"]``."""
    return sorted(_MODELS)


def _constructor_defaults(builder: Callable[..., Any]) -> dict[str, Any]:
    params = inspect.signature(builder).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def build_model(name: str, info: Mapping[str, Any], **options: Any) -> nn.Module:
    """Build the built-in model ``name`` sized for a dataset's ``info``.

    ``info`` is ``load_dataset(...)["info"]``: it supplies the sizes that depend
    on the data (``in_dims``, ``num_classes``, ``image_shape``, ``vocab_size``,
    ``block_size``); ``options`` set the rest (``hidden_dims``, ``dropout``...).

    Example::

        model = build_model("transformer", {"vocab_size": 96, "block_size": 64}, num_layers=4)
    """
    spec = _MODELS.get(name)
    if spec is None:
        raise ConfigError(
            f"unknown model '{name}'{did_you_mean(name, _MODELS)}; "
            f"built-in models: {', '.join(available_models())}"
        )
    for key in spec.from_info:
        if key in options:
            where = "dataset_options" if key == "block_size" else "the dataset"
            raise ConfigError(
                f"option '{key}' of model '{name}' is set from the dataset "
                f"({info.get(key)!r} here); remove it from model_options (change it through {where})"
            )
    missing = [key for key in spec.from_info if key not in info]
    if missing:
        fitting = [n for n, s in sorted(_MODELS.items()) if s.task == info.get("task")]
        raise ConfigError(
            f"model '{name}' is for {spec.task} and needs {', '.join(missing)} from the dataset, "
            f"which does not provide it (its task is {info.get('task', 'unknown')!r}); "
            f"models for this dataset: {', '.join(fitting) or 'none'}"
        )
    defaults = {
        k: v for k, v in _constructor_defaults(spec.builder).items() if k not in spec.from_info
    }
    check_options("model", name, options, defaults)
    arguments = {key: info[key] for key in spec.from_info}
    return spec.builder(**arguments, **{**spec.tuned, **options})
