"""Causal attention in blocks of queries: on the CPU, no scores for keys that no query of a block sees.

MLX's CPU backend computes ``mx.fast.scaled_dot_product_attention`` as its unfused fallback: the
whole ``queries x keys`` score matrix, the causal mask applied to it, a softmax over every row. The
exponentials of that softmax cost more there than the matrix products (SmolLM2-135M at 2048 tokens:
about half of a LoRA step), and half of the scores are masked out. :func:`causal_blocks` splits the
queries into blocks (``block_size``: at most ``MAX_BLOCKS``, at least ``MIN_BLOCK`` tokens) and gives
each block only the keys up to its own last position, with the causal mask inside (MLX aligns a causal
mask to the last key); the scores computed fall to ``(n + 1) / 2n`` of the whole matrix for ``n``
blocks. Each row's softmax has the same terms (a masked score's exponential is exactly 0), so values
and gradients are those of one call to float rounding.

:func:`use_block_attention` switches one model's attention modules to it where their ``__call__``
calls mlx-lm's ``scaled_dot_product_attention`` (llama, qwen2/3, mistral and most other mlx-lm
architectures): those instances get a subclass of their own class whose ``__call__`` is the same code
calling :func:`blocked_sdpa`, which takes the blocks only for a causal mask without a KV cache on the
CPU, and otherwise calls mlx-lm's function unchanged (a GPU's fused kernel already skips masked
blocks; an array mask, a cache or attention sinks go through as before). Parameter names and
checkpoints are unchanged. ``mlx-train finetune`` does it for every model it trains.

Example::

    from mlx_train.llm.attention import use_block_attention
    use_block_attention(model)          # ["model.layers.0.self_attn", ...]
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["MAX_BLOCKS", "MIN_BLOCK", "block_size", "blocked_sdpa", "causal_blocks", "is_blocked",
           "use_block_attention"]

MIN_BLOCK = 64  # tokens: smaller blocks save little and add operations
MAX_BLOCKS = 8  # blocks per call: the scores computed fall to 56% of the matrix; more add operations to trace
_NAME = "scaled_dot_product_attention"
_MARK = "_mlx_train_block_attention"


def block_size(length: int) -> int:
    """Queries per block for ``length`` tokens.

    Example: ``block_size(256)`` -> ``64``; ``block_size(2048)`` -> ``256``.
    """
    return max(MIN_BLOCK, -(-length // MAX_BLOCKS))


def causal_blocks(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal self-attention (``queries [B, Hq, L, D]``, ``keys``/``values [B, Hkv, L, D]``) one block of
    queries at a time, each over the keys up to its last position.

    Example: ``causal_blocks(q, k, v, scale=64 ** -0.5)`` equals ``mx.fast.scaled_dot_product_attention(q, k, v,
    scale=64 ** -0.5, mask="causal")`` to float rounding.
    """
    length = queries.shape[2]
    block = block_size(length)
    outputs = [mx.fast.scaled_dot_product_attention(queries[:, :, start:start + block],
                                                    keys[:, :, :start + block], values[:, :, :start + block],
                                                    scale=scale, mask="causal")
               for start in range(0, length, block)]
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


def blocked_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask, ...)``, in blocks
    (:func:`causal_blocks`) for a causal mask without a cache on the CPU, else ``original`` as it is.

    Example: ``sdpa = blocked_sdpa(mlx_lm.models.base.scaled_dot_product_attention)``.
    """
    def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any = None,
                                     scale: float = 1.0, mask: Any = None, **options: Any) -> mx.array:
        length = queries.shape[2]
        if (cache is None and isinstance(mask, str) and mask == "causal" and options.get("sinks") is None
                and keys.shape[2] == length and length > MIN_BLOCK and mx.default_device().type == mx.cpu):
            return causal_blocks(queries, keys, values, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **options)

    return scaled_dot_product_attention


def _calls_mlx_lm_sdpa(cls: type) -> bool:
    call = cls.__call__
    base = sys.modules.get("mlx_lm.models.base")  # loaded wherever an mlx-lm model's module is
    return (base is not None and isinstance(call, types.FunctionType) and _NAME in call.__code__.co_names
            and call.__globals__.get(_NAME) is getattr(base, _NAME, None))


def _blocked_call(cls: type) -> Callable[..., Any]:
    """``cls.__call__``'s code, run with the module's names but :func:`blocked_sdpa` for the attention function."""
    call = cls.__call__
    names = dict(call.__globals__)
    names[_NAME] = blocked_sdpa(names[_NAME])
    blocked = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__, call.__closure__)
    blocked.__kwdefaults__ = call.__kwdefaults__
    blocked.__qualname__, blocked.__doc__ = call.__qualname__, call.__doc__
    return blocked


def is_blocked(module: nn.Module) -> bool:
    """True when ``module`` is an attention module switched to :func:`blocked_sdpa`."""
    return bool(getattr(type(module), _MARK, False))


def use_block_attention(model: nn.Module) -> list[str]:
    """Switch ``model``'s attention modules that call mlx-lm's ``scaled_dot_product_attention`` to
    :func:`blocked_sdpa`; returns their paths. Calling it again changes nothing. Call it before gradient
    checkpointing is turned on (``enable_gradient_checkpointing``), which then recomputes the blocked call.

    Example: ``use_block_attention(model)`` -> ``["model.layers.0.self_attn", ...]`` for an mlx-lm llama.
    """
    from mlx_train.llm.models import switch_classes

    return switch_classes(model, _MARK, _calls_mlx_lm_sdpa, _blocked_call)
