"""The language-model loss, attention that stays inside each packed document, and per-token
log-probabilities that never hold the full ``[tokens, vocabulary]`` logits.

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

The output projection in chunks. For an mlx-lm model whose ``Model.__call__`` is the plain
"``self.model`` then ``lm_head`` (or the tied embedding's ``as_linear``)" (the architectures declared so in
``mlx_train.transforms.ARCHITECTURES``, on the mlx-lm releases validated there), ``target_logprobs``
runs the transformer body once and then the projection and the log-softmax a chunk of tokens at
a time (``CHUNK_LOGITS`` logits, 64 tokens of SmolLM2's 49152-token vocabulary), so the loss
layer's memory does not grow with tokens x vocabulary (the full logits of one 2048-token row of
SmolLM2 are 400 MB, and the plain loss holds a few such arrays). When the head has no trainable
parameters (LoRA, DoRA, a frozen head) each chunk also computes the gradient of its
log-probabilities with respect to its hidden states in the forward pass (``(onehot - softmax) @
W``, ``[tokens, hidden]``; ``W[t] - softmax @ W`` for a plain embedding or bias-free linear head),
which the backward pass only scales: the same two matrix products as the plain loss, no
recomputation, and one pass of exponentials over the logits (the normaliser is read off the
softmax), where the plain loss makes two: on the CPU they cost more than the projection. A
trainable head (full fine-tuning, an adapter on ``lm_head``) recomputes each chunk in the
backward pass instead (``mx.checkpoint``). Given ``positions`` (the trained targets of each row,
see ``trained_positions``) only those rows of the hidden states are projected: padding and masked
prompt tokens cost nothing in the head. Other models get the full logits, as before.
``CHUNK_LOGITS = 0`` turns chunking off everywhere (``lm_loss(..., chunk=0)``, the ``loss_chunk``
option of ``mlx-train finetune``, for one loss).

A head split by vocabulary over a tensor-parallel group (a ``distributed.tensor.VocabularySlice``, which
``shard_vocabulary`` puts in: ``local_logits``, ``vocab_offset`` and ``group``) is run the same way on each
rank's slice of the vocabulary: the log-softmax normaliser is a logsumexp over the group (the maximum
all-reduced with ``all_max``, the sum of exponentials with ``all_sum``) and the target's logit comes from the rank that
holds it (``all_sum`` of the masked slices); the hidden states' gradient is summed over the group.
Without chunking the model's own call gathers the whole logits. A pass that is never
differentiated can say so (``grad=False``: reference passes do); ``lm_loss`` on a model in
evaluation mode (``model.eval()``, as the Trainer's evaluation sets it) leaves out the gradient
term of the chunks' forward pass (one matrix product per chunk), staying differentiable.

Example::

    trainer = Trainer(model, optimizer, loss_fn=lm_loss)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_train.config import finetune as config_finetune
from mlx_train.distributed import collectives
from mlx_train.distributed.tensor.layers import VocabularySlice

#: Logits per chunk of the output projection, and the fewest tokens a chunk has (declared with the
#: loss_chunk setting, whose help they write; module attributes here, so a check can change them).
CHUNK_LOGITS = config_finetune.CHUNK_LOGITS
MIN_CHUNK_TOKENS = config_finetune.MIN_CHUNK_TOKENS



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


def _cache(model: nn.Module, batch: dict[str, Any]) -> list[DocumentMask] | None:
    if "segments" not in batch:
        return None
    return [DocumentMask(document_attention_mask(batch["segments"]))] * len(model.layers)


def model_logits(model: nn.Module, batch: dict[str, Any]) -> mx.array:
    """The model's logits for ``batch["inputs"]``, inside-document attention when packed."""
    cache = _cache(model, batch)
    logits: mx.array = model(batch["inputs"]) if cache is None else model(batch["inputs"], cache=cache)
    return logits


def output_head(model: nn.Module) -> tuple[nn.Module, Callable[[mx.array], mx.array]] | None:
    """``(head module, projection)`` of an mlx-lm model whose logits are ``projection(model.model(...))``:
    ``lm_head`` and its call, or the tied embedding and its ``as_linear``; None for other models.

    Example: ``module, project = output_head(model); logits = project(model.model(tokens))``.
    """
    from mlx_train.llm.models import is_mlx_lm_model
    from mlx_train.transforms import logits_head

    module = logits_head(model) if is_mlx_lm_model(model) else None
    if module is None:
        return None
    tied = module is not model.get("lm_head")
    project: Callable[[mx.array], mx.array] = module.as_linear if tied else module
    return module, project


def chunk_tokens(vocabulary: int) -> int:
    """Tokens per chunk of the output projection for this vocabulary size (see ``CHUNK_LOGITS``).

    Example: ``chunk_tokens(49152)`` -> ``64``.
    """
    return config_finetune.chunk_tokens(vocabulary, CHUNK_LOGITS, MIN_CHUNK_TOKENS)


def trained_positions(loss_mask: np.ndarray, multiple: int = 32) -> np.ndarray:
    """``int32 [rows, K]``: the positions where ``loss_mask`` is non-zero, row by row, padded with
    -1 to ``K`` = the most any row has, rounded up to ``multiple`` (few distinct shapes to compile).
    A batch that carries them as ``positions`` has only these targets projected and scored.

    Example: ``trained_positions(np.array([[0, 1, 1], [1, 0, 0]]), multiple=2)`` ->
    ``[[1, 2], [0, -1]]``.
    """
    mask = np.asarray(loss_mask) != 0
    count = int(mask.sum(axis=1).max(initial=0))
    width = max(multiple, -(-count // multiple) * multiple)
    out = np.full((mask.shape[0], width), -1, dtype=np.int32)
    for row, where in enumerate(mask):
        found = np.flatnonzero(where)
        out[row, :len(found)] = found
    return out


def _log_probs(logits: mx.array, targets: mx.array) -> mx.array:
    # _target_logits is an mx.custom_function, whose call the stubs type as object
    score, log_norm = cast(tuple[mx.array, mx.array], _target_logits(logits.astype(mx.float32), targets))
    return score - log_norm


@mx.custom_function
def _target_logits(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """Each target's logit and the log of the softmax normaliser (``logsumexp``): their difference
    is the target's log-probability, taken without a log-softmax copy of the logits."""
    shifted = logits - mx.max(logits, axis=-1, keepdims=True)  # as nn.losses.cross_entropy, same rounding
    return mx.take_along_axis(shifted, targets[..., None], axis=-1).squeeze(-1), mx.logsumexp(shifted, axis=-1)


@_target_logits.vjp
def _target_logits_vjp(primals: list[mx.array], cotangents: list[mx.array],
                       outputs: list[mx.array]) -> tuple[mx.array, mx.array]:
    # the gradients autodiff gives (a scatter for the gather, softmax for logsumexp) as one
    # elementwise expression, fused when compiled: the backward holds one logits-sized array, not three
    logits, targets = primals
    d_score, d_log_norm = (c[..., None] for c in cotangents)
    hit = mx.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    return mx.where(hit, d_score, 0.0) + d_log_norm * mx.softmax(logits, axis=-1), mx.zeros_like(targets)


def vocab_split(head: nn.Module) -> tuple[int, Any] | None:
    """``(first vocabulary row, group)`` of a head split by vocabulary over a tensor-parallel group (a
    ``distributed.tensor.VocabularySlice``), None for a whole head.

    Example: ``vocab_split(model.model.embed_tokens)`` -> ``(24576, group)`` on rank 1 of 2 for SmolLM2.
    """
    if not isinstance(head, VocabularySlice):
        return None
    return head.vocab_offset, head.group


def split_target_and_norm(logits: mx.array, targets: mx.array, offset: int, group: Any) -> tuple[mx.array, mx.array]:
    """``(target logit, logsumexp)`` of each row of logits split by vocabulary over ``group``: ``logits
    [..., rows]`` are this rank's columns ``[offset, offset + rows)``; every rank gets the whole-vocabulary
    values (differentiable; the maximum is a constant, as in ``mx.logsumexp``). Every rank must call it.

    Example: ``score, norm = split_target_and_norm(local, targets, rank * rows, group); logp = score - norm``
    """
    peak = mx.stop_gradient(collectives.all_max(mx.max(logits, axis=-1), group=group))
    total = collectives.all_sum(mx.sum(mx.exp(logits - peak[..., None]), axis=-1), group=group)
    local = targets - offset
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = mx.take_along_axis(logits, mx.where(inside, local, 0)[..., None], axis=-1).squeeze(-1)
    score = collectives.all_sum(mx.where(inside, picked, mx.zeros_like(picked)), group=group)
    return score, peak + mx.log(total)


def _split_log_probs(split: tuple[int, Any]) -> Callable[[mx.array, mx.array], mx.array]:
    def log_probs(logits: mx.array, targets: mx.array) -> mx.array:
        score, log_norm = split_target_and_norm(logits.astype(mx.float32), targets, *split)
        return score - log_norm

    return log_probs


def target_rows(head: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """``rows(targets) -> W[targets]``: the rows of a bias-free output projection ``W`` (a plain
    ``nn.Embedding`` used as the tied head, or an ``nn.Linear`` without bias), None for other heads.
    ``onehot(t) @ W`` is ``W[t]``: the gradient of a target's logit with respect to the hidden state.

    Example: ``target_rows(model.model.embed_tokens)(mx.array([5, 7]))`` -> rows 5 and 7 of the embedding.
    """
    if type(head) is nn.Embedding or (type(head) is nn.Linear and "bias" not in head):
        weight = head.weight
        return lambda targets: weight[targets]
    return None


def _frozen_head_logprobs(project: Callable[[mx.array], mx.array], chunk: int,
                          split: tuple[int, Any] | None = None,
                          rows: Callable[[mx.array], mx.array] | None = None) -> Any:
    """``f(hidden [N, D], targets [N]) -> (log-probs [N], their gradients [N, D])`` in chunks; its
    backward pass scales the stored gradients, so no chunk of logits outlives its forward pass.
    ``split``: ``project`` gives this rank's slice of the vocabulary (see ``vocab_split``); ``rows``:
    the projection's target rows (``target_rows``), which spare each chunk a one-hot of its logits."""
    offset = 0 if split is None else split[0]

    @mx.custom_function
    def logprobs(hidden: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
        values: list[mx.array] = []
        grads: list[mx.array] = []
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            if values:  # one chunk after the other: MLX would otherwise compute them side by side
                h = mx.depends(h, [values[-1], grads[-1]])
            logits = project(h).astype(mx.float32)
            if split is None:
                # One pass of exponentials over the logits, not two (on the CPU they cost more than the
                # projection): the softmax, which the gradient needs, is exp(logit - max) / sum, so at a
                # row's largest logit it is 1 / sum, and the normaliser max + log(sum) follows from it.
                softmax = mx.softmax(logits, axis=-1)
                log_norm = mx.max(logits, axis=-1) - mx.log(mx.max(softmax, axis=-1))
                values.append(mx.take_along_axis(logits, t[:, None], axis=-1).squeeze(-1) - log_norm)
            else:
                score, log_norm = split_target_and_norm(logits, t, *split)
                values.append(score - log_norm)
                softmax = mx.exp(logits - log_norm[:, None])
            # d log p(t) / dh = (onehot(t) - softmax) @ W = W[t] - softmax @ W
            if rows is not None:
                spread = mx.vjp(project, [h], [softmax.astype(h.dtype)])[1][0]
                grads.append(rows(t).astype(spread.dtype) - spread)
                continue
            # Without the rows: the one-hot waits for this chunk's logits (else MLX builds every chunk's
            # one-hot first, all at once). A split head: this rank's columns of both, and project's backward
            # sums the rows of the result over the group
            hit = mx.arange(offset, offset + logits.shape[-1], dtype=t.dtype) == mx.depends(t, log_norm)[:, None]
            d_logits = hit.astype(mx.float32) - softmax
            grads.append(mx.vjp(project, [h], [d_logits.astype(h.dtype)])[1][0])
        return mx.concatenate(values), mx.concatenate(grads)

    @logprobs.vjp
    def logprobs_vjp(primals: list[mx.array], cotangents: list[mx.array],
                     outputs: list[mx.array]) -> tuple[mx.array, mx.array]:
        d_values = cotangents[0].astype(outputs[1].dtype)
        return d_values[:, None] * outputs[1], mx.zeros_like(primals[1])

    return logprobs


def _recomputed_logprobs(head: nn.Module, project: Callable[[mx.array], mx.array], hidden: mx.array,
                         targets: mx.array, chunk: int,
                         log_probs: Callable[[mx.array, mx.array], mx.array] = _log_probs) -> mx.array:
    """Log-probabilities chunk by chunk through a head with trainable parameters; each chunk's
    logits are computed again in the backward pass."""
    def piece(params: Any, h: mx.array, t: mx.array) -> mx.array:
        saved = head.trainable_parameters()
        head.update(params)
        out = log_probs(project(h), mx.stop_gradient(t))
        head.update(saved)
        return out

    step = mx.checkpoint(piece)
    params = head.trainable_parameters()
    return mx.concatenate([step(params, hidden[s:s + chunk], targets[s:s + chunk])
                           for s in range(0, hidden.shape[0], chunk)])


def chunked_logprobs(head: nn.Module, project: Callable[[mx.array], mx.array], hidden: mx.array,
                     targets: mx.array, chunk: int | None = None, grad: bool = True,
                     precompute: bool = True) -> mx.array:
    """``log softmax(project(hidden))[target]`` for ``hidden [N, D]`` and ``targets [N]``, ``chunk``
    tokens at a time (all at once when None), differentiable with respect to ``hidden`` and
    ``head``'s trainable parameters; ``grad=False`` for values that are never differentiated
    (less work, no gradients); ``precompute=False`` for values that are seldom differentiated
    (an evaluation): no gradient work in the forward pass, plain autodiff (holding every chunk's
    logits) if they are differentiated all the same.

    A head split by vocabulary (``vocab_split``) projects onto this rank's slice (its ``local_logits``,
    whatever ``project`` is) and normalises over the group: every rank of the group must call it.

    Example: ``chunked_logprobs(model.lm_head, model.lm_head, hidden, targets, chunk=128)``.
    """
    chunk = chunk or hidden.shape[0]
    split = vocab_split(head)
    log_probs = _log_probs if split is None else _split_log_probs(split)
    if split is not None:
        project = head.local_logits
    if not grad or not precompute:
        values: list[mx.array] = []
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk] if grad else mx.stop_gradient(hidden[s:s + chunk])
            values.append(log_probs(project(mx.depends(h, values[-1:])), targets[s:s + chunk]))
        return mx.concatenate(values)
    if tree_flatten(head.trainable_parameters()):
        return _recomputed_logprobs(head, project, hidden, targets, chunk, log_probs)
    rows = target_rows(head) if split is None else None
    frozen: mx.array = _frozen_head_logprobs(project, chunk, split, rows)(hidden, targets)[0]
    return frozen


def target_logprobs(model: nn.Module, batch: dict[str, Any], chunk: int | None = None,
                    grad: bool = True, precompute: bool = True) -> tuple[mx.array, mx.array | None]:
    """``(log-probabilities, positions)``: ``log p(targets | inputs)`` per target of ``batch``
    (``inputs``, ``targets``; ``segments`` for in-document attention), ``[B, L]``, or ``[B, K]`` at
    ``batch["positions"]`` (then also returned; -1 where a row has fewer). Chunked (see the module
    docstring) when the model's head allows it and ``chunk`` (tokens per chunk; by default from
    ``CHUNK_LOGITS``) is not 0; otherwise from the full logits. ``grad=False``: the result is never
    differentiated; ``precompute=False``: seldom (see :func:`chunked_logprobs`).

    Example: ``logps, _ = target_logprobs(model, batch); loss = -(logps * batch["loss_mask"]).sum()``.
    """
    inputs, targets, positions = batch["inputs"], batch["targets"], batch.get("positions")
    found = output_head(model) if chunk != 0 and CHUNK_LOGITS else None
    cache = _cache(model, batch)
    if found is None:
        logps = _log_probs(model(inputs) if cache is None else model(inputs, cache=cache), targets)
        if positions is not None:
            logps = mx.take_along_axis(logps, mx.maximum(positions, 0), axis=1)
        return logps, positions
    head, project = found
    if chunk is None:
        chunk = chunk_tokens(int(getattr(getattr(model, "args", None), "vocab_size", 0) or 32768))
    hidden = model["model"](inputs, cache)
    if positions is not None:
        where = mx.maximum(positions, 0)
        hidden = mx.take_along_axis(hidden, where[..., None], axis=1)
        targets = mx.take_along_axis(targets, where, axis=1)
    rows, width = targets.shape
    logps = chunked_logprobs(head, project, hidden.reshape(rows * width, -1), targets.reshape(-1), chunk, grad,
                             precompute)
    return logps.reshape(rows, width), positions


def target_weights(mask: mx.array, positions: mx.array | None) -> mx.array:
    """``mask`` (float32) at the positions ``target_logprobs`` scored: all, or ``positions`` (0 at -1).

    Example: ``weights = target_weights(batch["loss_mask"], positions)``.
    """
    weights = mask.astype(mx.float32)
    if positions is None:
        return weights
    return mx.take_along_axis(weights, mx.maximum(positions, 0), axis=1) * (positions >= 0)


def lm_loss(model: nn.Module, batch: dict[str, Any], chunk: int | None = None) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy over the targets where ``loss_mask`` is 1, and how many there are; ``chunk``:
    tokens per chunk of the output projection (None: from ``CHUNK_LOGITS``; 0: the full logits). A
    model in evaluation mode (``model.eval()``; ``mlx_lm.load`` leaves a model so: call ``model.train()``
    before training with this loss) gets no gradient work in the forward pass.

    Example: ``loss, tokens = lm_loss(model, batch)``.
    """
    logps, positions = target_logprobs(model, batch, chunk, precompute=model.training)
    weights = target_weights(batch["loss_mask"], positions)
    tokens = weights.sum()
    return -(logps * weights).sum() / mx.maximum(tokens, 1.0), tokens
