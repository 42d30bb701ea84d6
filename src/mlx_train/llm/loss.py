"""The language-model loss, and attention that stays inside each packed document.

``lm_loss(model, batch) -> (mean loss, trained tokens)`` is an mlx-lm style loss (its first
parameter is named ``model``, so the Trainer calls it with the whole batch and weights
gradient accumulation by the token count it returns).

mlx-lm models take no ``mask=`` argument, but every attention layer asks its KV cache for the
mask (``cache.make_mask``) and applies RoPE at ``cache.offset``. A packed batch therefore passes a
stand-in cache per layer that stores nothing, has offset 0 and returns a block-diagonal causal
mask built from ``segments``. RoPE positions then run on across the documents of a row; attention
scores depend only on relative positions, so each document's logits equal those of the document
alone (up to float rounding). Models that are not mlx-lm models get plain causal attention over
the whole row: their loss still never crosses a document boundary, but a token can attend to
earlier documents of its row.

Example::

    trainer = Trainer(model, optimizer, loss_fn=lm_loss)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class DocumentMask:
    """A stand-in KV cache for one layer: no caching, offset 0, a block-diagonal causal mask."""

    offset = 0

    def __init__(self, mask: mx.array) -> None:
        self.mask = mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values

    def make_mask(self, length: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self.mask


def document_attention_mask(segments: mx.array) -> mx.array:
    """``bool[B, 1, L, L]``: position i may attend to j when j <= i and both are in the same
    document (padding, segment 0, attends only to padding).

    Example: ``document_attention_mask(mx.array([[1, 1, 2]]))[0, 0].tolist()``
    -> ``[[True, False, False], [True, True, False], [False, False, True]]``.
    """
    length = segments.shape[1]
    causal = mx.tril(mx.ones((length, length), dtype=mx.bool_))
    same = segments[:, :, None] == segments[:, None, :]
    return mx.logical_and(same, causal)[:, None]


def supports_document_mask(model: nn.Module) -> bool:
    """True when ``model`` takes its attention mask from the cache protocol (mlx-lm models)."""
    from mlx_train.llm.models import is_mlx_lm_model

    return is_mlx_lm_model(model)


def model_logits(model: nn.Module, batch: dict[str, Any]) -> mx.array:
    """The model's logits for ``batch["inputs"]``, inside-document attention when packed."""
    if "segments" in batch:
        mask = DocumentMask(document_attention_mask(batch["segments"]))
        return model(batch["inputs"], cache=[mask] * len(model.layers))
    return model(batch["inputs"])


def lm_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy over the targets where ``loss_mask`` is 1, and how many there are.

    Example: ``loss, tokens = lm_loss(model, batch)``.
    """
    logits = model_logits(model, batch)
    weights = batch["loss_mask"].astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, batch["targets"]) * weights
    tokens = weights.sum()
    return losses.astype(mx.float32).sum() / mx.maximum(tokens, 1.0), tokens
