"""Sampling groups of completions for reinforcement learning, batched, with a KV cache.

``generate_groups`` samples ``group_size`` completions of each prompt of a batch at once: the prompts,
left-padded to one length, are run through the model once (each prompt's prefill is computed once, not
once per completion), then each prompt's keys and values are repeated along the batch axis for its group
and every completion is decoded one token at a time together. The key/value caches are allocated once
for the whole rollout (``_FixedCache``: written at an array index, the rest masked), so every decoding
step has the same shapes and runs as one compiled function (``_Decoder``: the model's step, the
sampling and the end-of-sequence check), traced once per model and cache length. A completion ends at
its first end-of-sequence token (kept: it is part of what the policy chose) or after ``max_tokens`` tokens.

Sampling is reproducible: every token draws from a key split off one ``key`` (``rollout_key``: from the
run's seed, the step and the prompts' rows), never from MLX's global random state, so a resumed run
samples exactly what the uninterrupted run sampled, and the training step's own randomness (dropout)
is untouched. The filters keep the tokens and odds of mlx-lm's (``apply_top_p``, then ``apply_top_k``,
on the log-probabilities before the temperature, as its ``make_sampler``); with top-k the draw runs over
the ``top_k`` candidates, not the whole vocabulary.

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

    def sample(self, logits: mx.array, key: mx.array) -> mx.array:
        """One token per row of ``logits`` (``[rows, vocabulary]``, log-probabilities or unnormalised), drawn
        with ``key``."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        index, kept = self.candidates(logits)
        choice = mx.random.categorical(kept * (1 / self.temperature), key=key)
        return choice if index is None else mx.take_along_axis(index, choice[..., None], axis=-1)[..., 0]

    def candidates(self, logits: mx.array) -> tuple[mx.array | None, mx.array]:
        """``(index, kept)``: the tokens a draw chooses among and their logits, ``-inf`` where top-p drops one
        (``index`` None: the whole vocabulary, ``kept`` in its order). The tokens and their odds are those
        of mlx-lm's ``apply_top_p`` then ``apply_top_k``; with top-k the draw runs over the ``top_k``
        candidates only (the whole vocabulary is neither sorted nor drawn over: most of a decoding step's
        sampling time at 49k tokens)."""
        from mlx_lm.sample_utils import apply_top_p

        logits = logits.astype(mx.float32)
        nucleus = 0 < self.top_p < 1
        if not 0 < self.top_k < logits.shape[-1]:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return None, apply_top_p(logprobs, self.top_p) if nucleus else logprobs
        index = mx.argpartition(-logits, self.top_k - 1, axis=-1)[..., :self.top_k]
        kept = mx.take_along_axis(logits, index, axis=-1)
        if nucleus:  # the probability mass above each candidate, summed from the most likely down
            top = mx.sort(kept, axis=-1)
            probs = mx.exp(top - mx.logsumexp(logits, axis=-1, keepdims=True))
            above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
            dropped = (above >= self.top_p).sum(axis=-1, keepdims=True)  # (the whole vocabulary's mass is 1)
            kept = mx.where(kept < mx.take_along_axis(top, dropped, axis=-1), -mx.inf, kept)
        return index, kept


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


#: The key/value caches of a rollout hold the prompts' width plus the completion length, rounded up to a
#: multiple of this many positions: few shapes for the compiled decoding step to trace.
CACHE_MULTIPLE = 32


class _FixedCache:
    """A layer's keys and values for a whole rollout, ``[rows, heads, length, dim]``, allocated once; each call
    writes its tokens at ``index`` (an array, so that every decoding step has the same shapes and compiles
    once) and attends over all ``length`` positions, those before a row's ``left_padding`` or after the
    written ones masked. mlx-lm's models call ``update_and_fetch``, read ``offset`` (each row's position, for
    the rotary embedding) and ``make_mask`` (through ``create_attention_mask``)."""

    def __init__(self, keys: mx.array | None, values: mx.array | None, left_padding: mx.array, index: mx.array,
                 length: int = 0) -> None:
        self.keys, self.values, self.left_padding, self.index = keys, values, left_padding, index
        self.length = length  # positions to allocate on the first call (when ``keys`` is None)

    @property
    def offset(self) -> mx.array:
        return self.index - self.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:  # the prefill: allocated for the whole rollout
            rows, heads, _, dim = keys.shape
            self.keys = mx.zeros((rows, heads, self.length, dim), keys.dtype)
            self.values = mx.zeros((rows, heads, self.length, values.shape[3]), values.dtype)
        at = self.index.reshape(1)
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), at, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, **_: Any) -> mx.array:
        """``[rows, 1, n, length]``: query ``i`` (at ``index + i``) sees its row's positions from
        ``left_padding`` to itself."""
        columns = mx.arange(self.length if self.keys is None else self.keys.shape[2])
        queries = self.index + mx.arange(n)
        mask = (columns[None, :] <= queries[:, None])[None, None]
        return mask & (columns >= self.left_padding[:, None, None, None])


def _check_plain_cache(model: nn.Module) -> None:
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {KVCache.__name__}:
        raise ConfigError(f"GRPO samples completions with a plain key/value cache per layer; "
                          f"{type(model).__module__}.{type(model).__name__} uses {', '.join(sorted(kinds))} (sliding "
                          "windows or recurrent state), which this sampling does not handle yet; fine-tune a model "
                          "with full attention in every layer (llama, qwen2, qwen3, mistral, ...)")


def _last_logits(model: nn.Module, tokens: mx.array, caches: list[Any]) -> mx.array:
    """Float32 logits of the last position only: the prompt's other positions are never projected."""
    from mlx_train.llm.loss import output_head

    found = output_head(model)
    if found is None:
        logits: mx.array = model(tokens, cache=caches)
        return logits[:, -1, :].astype(mx.float32)
    hidden = model["model"](tokens, caches)
    return found[1](hidden[:, -1, :]).astype(mx.float32)


class _Decoder:
    """One model's compiled decoding step: ``(token, key, done, index, left_padding, keys, values) -> (next token,
    done, keys, values)``: the model runs the previous tokens at ``index`` with the caches, the next ones are
    sampled (0 for rows already done) and ``done`` marks rows that drew an end-of-sequence token. The model's
    parameters are an input of the trace (the adapters change every step); it is traced once per shape."""

    def __init__(self, model: nn.Module, sampling: Sampling, eos_ids: tuple[int, ...]) -> None:
        self.model, self.sampling, self.ends = model, sampling, mx.array(eos_ids)

        def step(token: mx.array, key: mx.array, done: mx.array, index: mx.array, left_padding: mx.array,
                 keys: list[mx.array], values: list[mx.array]) -> tuple[Any, ...]:
            caches = [_FixedCache(k, v, left_padding, index) for k, v in zip(keys, values, strict=True)]
            logits = _last_logits(self.model, token[:, None], caches)
            drawn = self.sampling.sample(logits, key).astype(mx.int32)
            drawn = mx.where(done, 0, drawn)
            done = done | (drawn[:, None] == self.ends).any(axis=-1)
            return drawn, done, [c.keys for c in caches], [c.values for c in caches]

        self.step = mx.compile(step, inputs=[model.state])


#: The last decoder made, ``((model id, sampling, end ids), decoder)``: one at a time, so that a model no longer
#: sampled from is not kept alive by its compiled step (a run samples from one model with one setting).
_LAST_DECODER: list[tuple[tuple[int, Sampling, tuple[int, ...]], _Decoder]] = []


def _decoder(model: nn.Module, sampling: Sampling, eos_ids: tuple[int, ...]) -> _Decoder:
    """The compiled decoding step of ``model`` with these settings (the last one's, when it is the same)."""
    key = (id(model), sampling, eos_ids)
    if _LAST_DECODER and _LAST_DECODER[0][0] == key and _LAST_DECODER[0][1].model is model:
        return _LAST_DECODER[0][1]
    _LAST_DECODER[:] = [(key, _Decoder(model, sampling, eos_ids))]
    return _LAST_DECODER[0][1]


def generate_groups(model: nn.Module, prompts: Sequence[np.ndarray], group_size: int, sampling: Sampling,
                    key: mx.array, eos_ids: Iterable[int]) -> Completions:
    """``group_size`` completions of each prompt (token arrays), sampled together (see the module
    docstring); rows ``i * group_size ...`` are prompt ``i``'s. The model runs as it is (the caller picks
    evaluation mode and the adapters); nothing here is differentiated.

    Example: ``generate_groups(model, [np.array([1, 5, 9])], 2, Sampling(temperature=0), key, {2})``.
    """
    _check_plain_cache(model)
    ends = tuple(sorted({int(e) for e in eos_ids}))
    width = max(len(p) for p in prompts)
    padded = np.zeros((len(prompts), width), dtype=np.int32)
    for i, prompt in enumerate(prompts):
        padded[i, width - len(prompt):] = prompt
    length = -(-(width + sampling.max_tokens) // CACHE_MULTIPLE) * CACHE_MULTIPLE
    left_padding = mx.array([width - len(p) for p in prompts], dtype=mx.int32)
    zero = mx.array(0, dtype=mx.int32)
    caches = [_FixedCache(None, None, left_padding, zero, length) for _ in model.layers]
    logits = _last_logits(model, mx.array(padded), caches)  # the prefill: each prompt once
    repeat = mx.array(np.repeat(np.arange(len(prompts)), group_size))
    keys_ = [c.keys[repeat] for c in caches if c.keys is not None]
    values_ = [c.values[repeat] for c in caches if c.values is not None]
    left_padding, logits = left_padding[repeat], logits[repeat]
    keys = mx.random.split(key, sampling.max_tokens)
    token = sampling.sample(logits, keys[0]).astype(mx.int32)
    done = (token[:, None] == mx.array(ends)).any(axis=-1)
    steps = [token]
    step = _decoder(model, sampling, ends).step
    all_done: mx.array | None = None
    for t in range(1, sampling.max_tokens):
        token, done, keys_, values_ = step(token, keys[t], done, mx.array(width + t - 1, dtype=mx.int32), left_padding,
                                           keys_, values_)
        steps.append(token)
        mx.async_eval(token, done)
        # one step behind: the host waits for the previous token only, while this one computes
        if all_done is not None and all_done.item():
            break
        all_done = done.all()
    tokens = np.array(mx.stack(steps, axis=1))
    del caches, keys_, values_, logits
    mx.clear_cache()  # the caches' buffers, which the training step's shapes would not reuse
    hits = np.isin(tokens, np.array(ends))  # the first is the end (after it a row holds padding)
    ended = np.asarray(hits.any(axis=1))
    lengths = np.where(ended, hits.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int32)
    out = np.where(np.arange(tokens.shape[1]) < lengths[:, None], tokens, 0).astype(np.int32)
    return Completions(out, lengths, ended)
