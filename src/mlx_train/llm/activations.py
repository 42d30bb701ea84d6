"""A SwiGLU whose backward pass keeps only its two inputs.

mlx-lm's gated MLPs compute ``down_proj(silu(gate) * up)``. Differentiated as written, a trained
block keeps ``sigmoid(gate)`` and ``silu(gate)`` for the backward pass beside ``gate`` and ``up``:
two more ``tokens x intermediate`` arrays per block (SmolLM2-135M: 2 x 1536 floats a token, 50 MB
at 4 x 256 tokens over 8 trained blocks). :func:`swiglu` has its own gradient, which forms the
sigmoid again from ``gate`` (elementwise: no matrix product is recomputed), so the block keeps
only ``gate`` and ``up``. Its values and gradients are those of mlx-lm's ``swiglu`` to float
rounding.

:func:`use_lean_swiglu` switches one model's MLPs to it, where the MLP's ``__call__`` is mlx-lm's
plain ``self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))`` (llama, qwen2/3, mistral and
most other mlx-lm architectures). As gradient checkpointing does, it gives those instances a
subclass of their own class: the class itself, other instances, parameter names and checkpoints
are unchanged. ``mlx-train finetune`` does it for every model it trains.

Example::

    from mlx_train.llm.activations import use_lean_swiglu
    use_lean_swiglu(model)          # ["model.layers.0.mlp", "model.layers.1.mlp", ...]
"""

from __future__ import annotations

import inspect
import sys
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["swiglu", "use_lean_swiglu", "is_lean"]

_MARK = "_mlx_train_lean_swiglu"
_PLAIN_BODY = "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"
_PLAIN: dict[type, bool] = {}  # MLP class -> whether its call is the plain one


@partial(mx.compile, shapeless=True)
def _forward(gate: mx.array, up: mx.array) -> mx.array:
    out: mx.array = nn.silu(gate) * up  # one fused kernel, as mlx-lm's swiglu
    return out


@mx.custom_function
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``, whose backward pass needs only ``gate`` and ``up``.

    Example: ``swiglu(mx.array([1.0]), mx.array([2.0]))`` -> ``[1.4621]``.
    """
    out: mx.array = _forward(gate, up)
    return out


@swiglu.vjp
def _swiglu_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, mx.array]:
    gate, up = primals
    sigmoid = mx.sigmoid(gate)
    # d silu(g)/dg = s + g s (1 - s) = s (1 + g (1 - s))
    return cotangent * up * sigmoid * (1 + gate * (1 - sigmoid)), cotangent * gate * sigmoid


def _is_plain(cls: type) -> bool:
    """Whether ``cls.__call__`` is mlx-lm's plain gated MLP over mlx-lm's own ``swiglu``."""
    if cls not in _PLAIN:
        from mlx_train.llm.models import call_source

        mlx_lm_activations = sys.modules.get("mlx_lm.models.activations")  # loaded wherever an mlx-lm model's module is
        _PLAIN[cls] = (call_source(cls) == (["self", "x"], _PLAIN_BODY) and mlx_lm_activations is not None
                       and getattr(inspect.getmodule(cls), "swiglu", None) is mlx_lm_activations.swiglu)
    return _PLAIN[cls]


def _lean_call(self: Any, x: mx.array) -> mx.array:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]


def is_lean(module: nn.Module) -> bool:
    """True when ``module`` is an MLP switched to the lean :func:`swiglu`."""
    return bool(getattr(type(module), _MARK, False))


def use_lean_swiglu(model: nn.Module) -> list[str]:
    """Switch ``model``'s plain gated MLPs to :func:`swiglu`; returns their paths (none for a model that has
    none, e.g. one that is not an mlx-lm model). Calling it again changes nothing.

    Example: ``use_lean_swiglu(model)`` -> ``["model.layers.0.mlp", ...]`` for an mlx-lm llama.
    """
    from mlx_train.llm.models import switch_classes

    return switch_classes(model, _MARK, _is_plain, lambda cls: _lean_call)
