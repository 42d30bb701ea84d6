"""Sampling groups of completions for reinforcement learning, batched, with a KV cache.

``generate_groups`` samples ``group_size`` completions of each prompt of a batch at once: the prompts,
left-padded to one length, are run through the model once (each prompt's prefill is computed once, not
once per completion), then each prompt's KV cache is repeated along the batch axis for its group
(``BatchKVCache.filter`` with repeated rows) and every completion is decoded one token at a time
together. A completion ends at its first end-of-sequence token (kept: it is part of what the policy
chose) or after ``max_tokens`` tokens.

Sampling is reproducible: every token draws from a key split off one ``key`` (``rollout_key``: from the
run's seed, the step and the prompts' rows), never from MLX's global random state, so a resumed run
samples exactly what the uninterrupted run sampled, and the training step's own randomness (dropout)
is untouched. The filters are mlx-lm's (``apply_top_p``, then ``apply_top_k``, on the log-probabilities
before the temperature, as its ``make_sampler``).

Example::

    key = rollout_key(seed=0, rows=[3, 7], step=12)
    out = generate_groups(model, [prompt_a, prompt_b], 4, Sampling(temperature=0.8), key, eos_ids={2})
    out.tokens[:4], out.lengths[:4]      # the 4 completions of prompt_a
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_train.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: ``temperature`` (0: greedy), ``top_p`` (1: off), ``top_k`` (0: off),
    at most ``max_tokens`` tokens each.

    Example: ``Sampling(temperature=0.8, top_p=0.95, top_k=20, max_tokens=256)``.
    """

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int = 512

    def sample(self, logprobs: mx.array, key: mx.array) -> mx.array:
        """One token per row of ``logprobs`` (``[rows, vocabulary]``, normalised), drawn with ``key``."""
        from mlx_lm.sample_utils import apply_top_k, apply_top_p

        if self.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        top_k = 0 < self.top_k < logprobs.shape[-1]
        if 0 < self.top_p < 1:
            logprobs = _top_p_among(logprobs, self.top_p, self.top_k) if top_k else apply_top_p(logprobs, self.top_p)
        if top_k:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.random.categorical(logprobs * (1 / self.temperature), key=key)


def _top_p_among(logprobs: mx.array, top_p: float, top_k: int) -> mx.array:
    """mlx-lm's ``apply_top_p`` where ``apply_top_k`` follows: the nucleus is looked for among the ``top_k``
    most likely tokens only (a larger one is cut to them anyway), so the vocabulary is never sorted (a sort
    of 49k tokens per row was most of a decoding step's sampling time). The same tokens are kept: the
    probability mass above each candidate is summed from the most likely down, as there."""
    top = mx.sort(mx.topk(logprobs, top_k, axis=-1), axis=-1)
    probs = mx.exp(top.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mx.exp(logprobs.astype(mx.float32)).sum(axis=-1, keepdims=True)
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.where(dropped > 0, mx.take_along_axis(top, mx.minimum(dropped, top_k - 1), axis=-1), -mx.inf)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def rollout_key(seed: int, rows: Iterable[int], step: int | None) -> mx.array:
    """The key a batch's completions are drawn with: from the run's ``seed``, the dataset ``rows`` of its
    prompts (so that the ranks of a data-parallel run, which hold other rows, draw differently) and the
    optimizer ``step`` it trains (None: an evaluation, whose key is the same at every validation).

    Example: ``rollout_key(0, [3, 7], 12)`` is the same array in every run and on every resume.
    """
    spawn = (1,) if step is None else (0, int(step))
    sequence = np.random.SeedSequence([int(seed), *(int(r) for r in rows)], spawn_key=spawn)
    return mx.random.key(int(sequence.generate_state(1, dtype=np.uint64)[0]))


@dataclass
class Completions:
    """Sampled completions, ``group_size`` consecutive rows per prompt: ``tokens`` ``int32 [rows, T]``
    (0 after a completion's end), ``lengths`` (tokens, the end-of-sequence token included) and
    ``ended`` (whether it ended with an end-of-sequence token, rather than at ``max_tokens``)."""

    tokens: np.ndarray
    lengths: np.ndarray
    ended: np.ndarray

    def row(self, i: int, with_end: bool = True) -> list[int]:
        """Completion ``i``'s tokens; ``with_end=False`` leaves out its end-of-sequence token (reward text)."""
        n = int(self.lengths[i]) - (0 if with_end or not self.ended[i] else 1)
        return [int(t) for t in self.tokens[i, :n]]


def _caches(model: nn.Module, left_padding: list[int], length: int) -> list[Any]:
    """One ``BatchKVCache`` per layer, its keys and values allocated once for ``length`` positions (the prompts'
    width and the most tokens a completion has) instead of mlx-lm's 256 at a time: a rollout of 8 short
    completions of SmolLM2-135M held 94 MB of cache for 20 MB of keys and values."""
    from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {KVCache.__name__}:
        raise ConfigError(f"GRPO samples completions with a plain key/value cache per layer (mlx-lm's BatchKVCache); "
                          f"{type(model).__module__}.{type(model).__name__} uses {', '.join(sorted(kinds))} (sliding "
                          "windows or recurrent state), which this sampling does not handle yet; fine-tune a model "
                          "with full attention in every layer (llama, qwen2, qwen3, mistral, ...)")
    caches = [BatchKVCache(left_padding) for _ in model.layers]
    for cache in caches:
        cache.step = length  # the allocation granularity (a class attribute, 256, in mlx-lm)
    return caches


def _last_logits(model: nn.Module, tokens: mx.array, cache: list[Any]) -> mx.array:
    """Float32 logits of the last position only: the prompt's other positions are never projected."""
    from mlx_train.llm.loss import output_head

    found = output_head(model)
    if found is None:
        logits: mx.array = model(tokens, cache=cache)
        return logits[:, -1, :].astype(mx.float32)
    hidden = model["model"](tokens, cache)
    return found[1](hidden[:, -1, :]).astype(mx.float32)


def generate_groups(model: nn.Module, prompts: Sequence[np.ndarray], group_size: int, sampling: Sampling,
                    key: mx.array, eos_ids: Iterable[int]) -> Completions:
    """``group_size`` completions of each prompt (token arrays), sampled together (see the module
    docstring); rows ``i * group_size ...`` are prompt ``i``'s. The model runs as it is (the caller picks
    evaluation mode and the adapters); nothing here is differentiated.

    Example: ``generate_groups(model, [np.array([1, 5, 9])], 2, Sampling(temperature=0), key, {2})``.
    """
    width = max(len(p) for p in prompts)
    padded = np.zeros((len(prompts), width), dtype=np.int32)
    for i, prompt in enumerate(prompts):
        padded[i, width - len(prompt):] = prompt
    cache = _caches(model, [width - len(p) for p in prompts], width + sampling.max_tokens)
    logits = _last_logits(model, mx.array(padded), cache)
    repeat = mx.array(np.repeat(np.arange(len(prompts)), group_size))
    for layer in cache:  # each prompt's keys and values, once per completion of its group
        layer.filter(repeat)
    logits = logits[repeat]
    ends = mx.array(sorted({int(e) for e in eos_ids}))
    keys = mx.random.split(key, sampling.max_tokens)
    done = mx.zeros((logits.shape[0],), dtype=mx.bool_)
    steps: list[mx.array] = []
    all_done: mx.array | None = None
    for t in range(sampling.max_tokens):
        token = sampling.sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True), keys[t]).astype(mx.int32)
        token = mx.where(done, 0, token)
        steps.append(token)
        done = done | (token[:, None] == ends).any(axis=-1)
        if t + 1 == sampling.max_tokens:
            break
        logits = _last_logits(model, token[:, None], cache)
        mx.async_eval(logits, done)
        # one step behind: the host waits for the previous token only, while this one computes
        if all_done is not None and all_done.item():
            break
        all_done = done.all()
    tokens = np.array(mx.stack(steps, axis=1))
    hits = np.isin(tokens, np.array(ends))  # the first is the end (after it a row holds padding)
    ended = np.asarray(hits.any(axis=1))
    lengths = np.where(ended, hits.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int32)
    out = np.where(np.arange(tokens.shape[1]) < lengths[:, None], tokens, 0).astype(np.int32)
    return Completions(out, lengths, ended)

