"""LoRA, DoRA and full fine-tuning, in mlx-lm's adapter format.

Adapters are written as mlx-lm writes them -- ``adapters.safetensors`` (the trainable parameters)
and ``adapter_config.json`` (``fine_tune_type``, ``num_layers``, ``lora_parameters``) -- so
``mlx_lm.load(model, adapter_path=...)`` and ``mlx_lm.generate --adapter-path`` use them, and
adapters written by ``mlx_lm.lora`` load here to continue from.

On mlx-lm models the layers are mlx-lm's own (``linear_to_lora_layers``); on any other model the
same ``LoRALinear``/``DoRALinear`` classes replace the ``nn.Linear``/``nn.QuantizedLinear``
modules named by ``keys`` in the last ``num_layers`` blocks of ``model.layers`` (or anywhere in
the model when it has no ``layers``).

Example::

    spec = AdapterConfig(fine_tune_type="lora", num_layers=8, rank=8, scale=20.0)
    apply_adapters(model, spec)              # freezes the base, adds trainable adapters
    ...train...
    save_adapters(model, spec, "adapters")   # mlx_lm.load(base, adapter_path="adapters")
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.distributed import collectives
from mlx_train.errors import ConfigError

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
FINE_TUNE_TYPES = ("lora", "dora", "full")


@dataclass
class AdapterConfig:
    """What to train: ``fine_tune_type`` (lora, dora or full), the last ``num_layers`` blocks
    (-1: all), and for LoRA/DoRA ``rank``, ``scale``, ``dropout`` and ``keys`` (module paths
    inside a block, e.g. ``["self_attn.q_proj", "self_attn.v_proj"]``; None: every linear).

    Example: ``AdapterConfig("dora", num_layers=4, rank=16, keys=["self_attn.q_proj"])``.
    """

    fine_tune_type: str = "lora"
    num_layers: int = 16
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    keys: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.fine_tune_type not in FINE_TUNE_TYPES:
            raise ConfigError(f"fine_tune_type is {self.fine_tune_type!r}; choose one of {', '.join(FINE_TUNE_TYPES)}")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")

    def lora_parameters(self) -> dict[str, Any]:
        """mlx-lm's ``lora_parameters`` dict."""
        return {"rank": self.rank, "scale": float(self.scale), "dropout": float(self.dropout), "keys": self.keys}

    def to_mlx_lm(self) -> dict[str, Any]:
        """The keys of mlx-lm's ``adapter_config.json`` that describe the adapters."""
        return {"fine_tune_type": self.fine_tune_type, "num_layers": self.num_layers,
                "lora_parameters": self.lora_parameters()}

    @classmethod
    def from_mlx_lm(cls, config: dict[str, Any], where: str = "adapter config") -> AdapterConfig:
        """Read mlx-lm's ``adapter_config.json`` (or an mlx_lm.lora YAML) dict."""
        lora = dict(config.get("lora_parameters") or {})
        if "alpha" in lora and "scale" not in lora:
            raise ConfigError(f"{where}: lora_parameters has 'alpha' but mlx-lm LoRA uses 'scale' "
                              "(the multiplier of the low-rank update); rename it to scale")
        unknown = set(lora) - {"rank", "scale", "dropout", "keys"}
        if unknown:
            raise ConfigError(f"{where}: unknown lora_parameters {sorted(unknown)}; known: rank, scale, dropout, keys")
        defaults = cls()
        return cls(fine_tune_type=config.get("fine_tune_type", "lora"),
                   num_layers=int(config.get("num_layers", defaults.num_layers)),
                   rank=int(lora.get("rank", defaults.rank)), scale=float(lora.get("scale", defaults.scale)),
                   dropout=float(lora.get("dropout", defaults.dropout)), keys=lora.get("keys"))


def _blocks(model: nn.Module, num_layers: int) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        return [model]
    if num_layers > len(layers):
        raise ConfigError(f"num_layers={num_layers} but the model has {len(layers)} layers; use at most "
                          f"{len(layers)} (or -1 for all)")
    return layers[-num_layers:] if num_layers >= 0 else layers


def _matches(path: str, keys: list[str] | None) -> bool:
    return keys is None or path in keys or path.rsplit(".", 1)[-1] in keys


def _generic_lora(model: nn.Module, spec: AdapterConfig) -> int:
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    layer_class = DoRALinear if spec.fine_tune_type == "dora" else LoRALinear
    converted = 0
    for block in _blocks(model, spec.num_layers):
        # from_base takes an nn.QuantizedLinear too (it reads its bits), though mlx-lm annotates nn.Linear
        swaps = [(path, layer_class.from_base(cast(nn.Linear, m), r=spec.rank, scale=spec.scale,
                                              dropout=spec.dropout))
                 for path, m in block.named_modules()
                 if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and _matches(path, spec.keys)]
        if swaps:
            block.update_modules(tree_unflatten(swaps))
        converted += len(swaps)
    return converted


class _ShardedAdapter(nn.Module, collectives.Tracked):
    """LoRA (and the base of DoRA) on a linear layer split over a group by tensor parallelism.

    The low-rank factors are split with their base: for a layer whose output is split
    ("all-to-sharded") ``lora_b``'s columns are, and ``lora_a`` is whole on every rank; for a layer
    whose input is split ("sharded-to-all") ``lora_a``'s rows are, and ``lora_b`` is whole. The
    rank-``r`` activation ``x @ lora_a`` is all-reduced (its gradient, or its value) so that every
    rank computes the unsplit layer's result and gradients. A base split in unequal slices (attention
    split by key/value groups, ``split_sizes``) has its factor split in the same slices. Parameter names are mlx-lm's
    (``linear``, ``lora_a``, ``lora_b``, DoRA's ``m``): gathered, they are an mlx-lm adapter file.
    """

    def __init__(self, linear: nn.Module, template: nn.Module, dropout: float, scale: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module; untyped_calls_exclude misses super()
        from mlx.nn.layers import distributed as dist

        self.linear = linear
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        self.group = linear.group
        self.output_sharded = isinstance(linear, (dist.AllToShardedLinear, dist.QuantizedAllToShardedLinear))
        a, b = template.lora_a, template.lora_b  # drawn at the unsplit size: the same numbers as one process
        self.lora_a = a if self.output_sharded else self._own_part(a, 0)
        self.lora_b = self._own_part(b, 1) if self.output_sharded else b

    def _own_part(self, factor: mx.array, axis: int) -> mx.array:
        """This rank's slice of ``factor`` on ``axis``: equal slices, or the base layer's ``split_sizes``."""
        size, rank = self.group.size(), self.group.rank()
        sizes = self.split_sizes
        if sizes is None:
            return mx.contiguous(mx.split(factor, size, axis=axis)[rank])
        start = sum(sizes[:rank])
        return mx.contiguous(mx.take(factor, mx.arange(start, start + sizes[rank]), axis=axis))

    @property
    def split_sizes(self) -> tuple[int, ...] | None:
        """Each rank's size on the split axis when the base layer's slices are unequal (``distributed.tensor``'s
        uneven attention), else None."""
        sizes: tuple[int, ...] | None = getattr(self.linear, "split_sizes", None)
        return sizes

    @property
    def sharded_axes(self) -> dict[str, int | None]:
        """The axis of each own parameter split over the group (``distributed.tensor.shard_layout`` reads it)."""
        return {"lora_a": None, "lora_b": 1, "m": 0} if self.output_sharded else {"lora_a": 0, "lora_b": None,
                                                                                  "m": None}

    @staticmethod
    def _full_dims(linear: nn.Module) -> tuple[int, int]:
        from mlx.nn.layers import distributed as dist

        out_dims, in_dims = linear.weight.shape
        if "scales" in linear:
            in_dims = in_dims * 32 // linear.bits
        size = linear.group.size()
        sizes = getattr(linear, "split_sizes", None)  # unequal slices: their sum is the unsplit size
        if isinstance(linear, (dist.AllToShardedLinear, dist.QuantizedAllToShardedLinear)):
            return in_dims, sum(sizes) if sizes else out_dims * size
        return sum(sizes) if sizes else in_dims * size, out_dims

    def _low_rank(self, x: mx.array) -> mx.array:
        h = self.dropout(x) @ self.lora_a
        if self.output_sharded:  # every rank's slice of the output adds to the gradient of h
            h = collectives.sum_gradients(self.group)(h)
        else:  # every rank holds part of the input: h is the sum of the parts
            h = collectives.all_sum(h, group=self.group)
        return h @ self.lora_b


class ShardedLoRALinear(_ShardedAdapter):
    """mlx-lm's ``LoRALinear`` on a tensor-parallel linear layer (see ``_ShardedAdapter``).

    Example: ``layer = ShardedLoRALinear.from_base(model.layers[0].self_attn.q_proj, r=8)``
    """

    @classmethod
    def from_base(cls, linear: nn.Module, r: int = 8, dropout: float = 0.0, scale: float = 20.0) -> ShardedLoRALinear:
        from mlx_lm.tuner.lora import LoRALinear

        in_dims, out_dims = cls._full_dims(linear)
        return cls(linear, LoRALinear(in_dims, out_dims, r=r, dropout=dropout, scale=scale), dropout, scale)

    def __call__(self, x: mx.array) -> mx.array:
        base: mx.array = self.linear(x)
        return base + (self.scale * self._low_rank(x)).astype(x.dtype)


class ShardedDoRALinear(_ShardedAdapter):
    """mlx-lm's ``DoRALinear`` on a tensor-parallel (unquantized) linear layer: the magnitude ``m`` is
    split with the output rows; the row norms of a layer whose input is split are summed over ranks.

    Example: ``layer = ShardedDoRALinear.from_base(model.layers[0].mlp.down_proj, r=8)``
    """

    m: mx.array  # the magnitude: this rank's rows of the unsplit layer's row norms

    @classmethod
    def from_base(cls, linear: nn.Module, r: int = 8, dropout: float = 0.0, scale: float = 20.0) -> ShardedDoRALinear:
        from mlx_lm.tuner.dora import DoRALinear

        if "scales" in linear:
            raise ConfigError("DoRA on a quantized tensor-parallel layer is not supported: use LoRA, or a "
                              "model that is not quantized")
        in_dims, out_dims = cls._full_dims(linear)
        layer = cls(linear, DoRALinear(in_dims, out_dims, r=r, dropout=dropout, scale=scale), dropout, scale)
        layer.m = layer._row_norm(linear.weight.astype(mx.float32))
        mx.eval(layer.m)  # now, on every rank: a collective left in a lazy graph would pair up with another
        return layer

    def _row_norm(self, weight: mx.array) -> mx.array:
        squares = mx.sum(mx.square(weight), axis=1)
        if not self.output_sharded:
            squares = collectives.all_sum(squares, group=self.group)
        return mx.sqrt(squares)

    def __call__(self, x: mx.array) -> mx.array:
        w: mx.array = self.linear.weight
        if self.output_sharded:
            y: mx.array = collectives.sum_gradients(self.group)(x) @ w.T
        else:
            y = collectives.all_sum(x @ w.T, group=self.group)
        out = y + (self.scale * self._low_rank(x)).astype(x.dtype)
        adapted = w + (self.scale * self.lora_b.T) @ self.lora_a.T
        denom = mx.stop_gradient(self._row_norm(adapted))
        out = (self.m / denom).astype(x.dtype) * out
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out


def _sharded_lora(model: nn.Module, spec: AdapterConfig) -> int:
    """LoRA/DoRA on a tensor-parallel model: its split layers get the sharded adapters, other linear
    layers mlx-lm's; the same layers, in the same order, as on the unsplit model."""
    from mlx.nn.layers import distributed as dist
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    split = (dist.AllToShardedLinear, dist.ShardedToAllLinear, dist.QuantizedAllToShardedLinear,
             dist.QuantizedShardedToAllLinear)
    dora = spec.fine_tune_type == "dora"
    converted = 0
    for block in _blocks(model, spec.num_layers):
        swaps = []
        for path, m in block.named_modules():
            if not _matches(path, spec.keys):
                continue
            if isinstance(m, split):
                layer_class: Any = ShardedDoRALinear if dora else ShardedLoRALinear
            elif isinstance(m, (nn.Linear, nn.QuantizedLinear)):
                layer_class = DoRALinear if dora else LoRALinear
            else:
                continue
            swaps.append((path, layer_class.from_base(m, r=spec.rank, scale=spec.scale, dropout=spec.dropout)))
        if swaps:
            block.update_modules(tree_unflatten(swaps))
        converted += len(swaps)
    return converted


def _is_tensor_parallel(model: nn.Module) -> bool:
    from mlx.nn.layers import distributed as dist

    return any(isinstance(m, (dist.AllToShardedLinear, dist.ShardedToAllLinear, dist.QuantizedAllToShardedLinear,
                              dist.QuantizedShardedToAllLinear)) for _, m in model.named_modules())


def apply_adapters(model: nn.Module, spec: AdapterConfig) -> nn.Module:
    """Freeze ``model`` and make the parts ``spec`` names trainable (in place; returns ``model``).

    Example: ``apply_adapters(model, AdapterConfig("lora", num_layers=2))``.
    """
    from mlx_train.llm.models import is_mlx_lm_model

    model.freeze()
    if spec.fine_tune_type == "full":
        for block in _blocks(model, spec.num_layers):
            block.unfreeze()
        return model
    if _is_tensor_parallel(model):  # split by tensor parallelism: the adapters are split with their layers
        if _sharded_lora(model, spec) == 0:
            raise ConfigError(f"no linear layer matches keys={spec.keys} in the last {spec.num_layers} blocks")
    elif is_mlx_lm_model(model):
        from mlx_lm.tuner.utils import linear_to_lora_layers

        _blocks(model, spec.num_layers)  # the clear error for too many layers
        linear_to_lora_layers(model, spec.num_layers, spec.lora_parameters(), use_dora=spec.fine_tune_type == "dora")
    elif _generic_lora(model, spec) == 0:
        raise ConfigError(
            f"no nn.Linear/nn.QuantizedLinear module matches keys={spec.keys} in the last {spec.num_layers} "
            "blocks; check the module names (model.named_modules()) or use fine_tune_type='full'")
    if not tree_flatten(model.trainable_parameters()):
        raise ConfigError(f"{spec.fine_tune_type} left nothing to train: no layer matched keys={spec.keys}")
    return model


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter values of ``model``."""
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return trainable, sum(v.size for _, v in tree_flatten(model.parameters()))


def save_adapters(model: nn.Module, spec: AdapterConfig, directory: str, extra: dict[str, Any] | None = None,
                  weights: dict[str, mx.array] | None = None) -> str:
    """Write the trainable parameters and ``adapter_config.json`` in mlx-lm's format.

    ``extra`` adds keys to the config (mlx-lm stores the run's arguments there: model, data, ...);
    ``weights`` replaces the model's trainable parameters (a tensor-parallel run's, gathered).
    Example: ``save_adapters(model, spec, "adapters", extra={"model": "base-dir"})``.
    """
    os.makedirs(directory, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters())) if weights is None else weights
    mx.save_safetensors(os.path.join(directory, ADAPTER_FILE), weights, metadata={"format": "mlx"})
    config = {**(extra or {}), **spec.to_mlx_lm()}
    if spec.fine_tune_type == "full":
        config["lora_parameters"] = None  # as mlx_lm.lora writes it
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=4, default=str)
    return directory


def read_adapter_config(directory: str) -> AdapterConfig:
    """The :class:`AdapterConfig` of an adapter directory written here or by ``mlx_lm.lora``."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{directory} has no {CONFIG_FILE}; give a directory written by mlx-train "
                          "finetune or mlx_lm.lora (adapters.safetensors + adapter_config.json)")
    with open(path) as f:
        return AdapterConfig.from_mlx_lm(json.load(f), where=path)


def load_adapters(model: nn.Module, directory: str) -> AdapterConfig:
    """Add the adapters of ``directory`` to ``model`` and load their weights, ready to train on.

    Example: ``spec = load_adapters(model, "adapters")``.
    """
    spec = read_adapter_config(directory)
    apply_adapters(model, spec)
    weights = cast("dict[str, mx.array]", mx.load(os.path.join(directory, ADAPTER_FILE)))
    expected = dict(tree_flatten(model.trainable_parameters()))
    wrong = sorted(k for k, v in weights.items() if k not in expected or expected[k].shape != v.shape)
    if wrong:
        raise ConfigError(f"adapters in {directory} do not fit this model: {len(wrong)} tensors (e.g. {wrong[0]}) "
                          "are not trainable parameters of the same shape; was it trained on a different base?")
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return spec


def fuse_adapters(model: nn.Module, dequantize: bool = False) -> nn.Module:
    """Fold LoRA/DoRA layers into plain linears (in place; returns ``model``).

    Example: ``save_model(fuse_adapters(model), tokenizer, config, "fused")``.
    """
    fused = [(name, m.fuse(dequantize=dequantize)) for name, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


def describe(spec: AdapterConfig) -> dict[str, Any]:
    """A flat dict of the adapter settings, for logs."""
    return asdict(spec)
