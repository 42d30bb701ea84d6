"""GRPO on the Trainer: reinforcement learning from reward functions (``--train-mode grpo``).

Rows are ``{"prompt": str, "answer": str}`` with an optional ``"system"`` message and ``"type"`` (both
given to the reward functions as they are); the prompt is rendered with the tokenizer's chat template
and its generation prompt, after the row's system message when it has one (no default system message:
mlx-lm-lora adds its own R1 one, this does not). The loader hands out batches of prompts.

Each training batch becomes its rollout batch in ``GRPOLoss.prepare``, which the Trainer calls in the
main thread right before the step (``mlx_train.training.losses.BatchPreparer``): ``group_size``
completions per prompt are sampled with the adapters on and the current weights
(``mlx_train.llm.rollouts``, drawn with a key from the seed, the step and the prompts' rows), scored by
the reward functions (``mlx_train.llm.rewards.RewardSet``) and turned into advantages ``(r - group
mean) / (group std + 1e-4)`` (``scale_rewards``). The rollout batch is a dict of arrays with one row per
completion (prompt and completion tokens, the completion's positions, its advantage and rewards), so
gradient accumulation and the out-of-memory micro-batch split cut it like any batch.

The loss, per completion token ``t`` of completion ``i`` (``m`` = 1 on its tokens, its end-of-sequence
token included): ``-min(w A_i, clip(w, 1 - clip_epsilon, 1 + epsilon_high) A_i) + beta KL``, with ``w`` the
ratio to the sampling policy (per token, or per sequence: the exp of the completion's mean log-ratio,
GSPO) and ``KL = exp(ref - logp) - (ref - logp) - 1`` against the model with its adapters off (no
reference pass when ``beta`` is 0). By default each rollout batch is used for one optimizer step, right
after it was sampled with the same weights, so the sampling policy's log-probabilities are the step's
own, detached (``w`` is 1 in value and carries the policy gradient; what mlx-lm-lora and TRL do with one
iteration): no extra forward pass. With ``num_iterations`` > 1 (TRL's) the loader hands each batch of
prompts out that many times in a row; its first step samples, its next steps train on the same rollouts,
which carry the sampling policy's log-probabilities as ``old_logps`` (``RolloutAnchor`` keeps the weights
that sampled them in checkpoints, so a resumed run samples them again). The
normalisations: ``grpo`` the mean over each completion's tokens, then over completions (items:
completions); ``bnpo`` the sum over all tokens over their count (items: tokens); ``dr_grpo`` the sum
over completions x ``max_completion_length`` (items: completions).

Metrics (means over a micro-batch's completions, averaged by the Trainer over the loss's items):
``reward_mean``/``reward_std`` and per function ``reward_<name>_mean``/``_std``/``_coverage`` (rows it
scored), ``completion_length``/``completion_length_max``, ``kl`` (with ``beta`` > 0), ``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio`` (the share of a completion's tokens clipped). Validation samples
with the run's settings and a fixed key (the same completions for the same weights at every validation).

Example::

    loss = GRPOLoss(GRPOConfig(group_size=4, beta=0.0), rewards, tokenizer, prompts)
    trainer = Trainer(model, optimizer, loss_fn=loss)      # loss.prepare samples before every step
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.errors import CheckpointError, DataError
from mlx_train.llm.rollouts import Sampling, generate_groups, rollout_key
from mlx_train.training.callbacks import Callback

#: Rollout rows are padded to a multiple of this many tokens, and their completion slots (where the output
#: projection runs, three times a step with a KL penalty) to a multiple of ``COMPLETION_MULTIPLE`` or the
#: longest completion allowed: few shapes for the compiled step to trace, little computed on padding.
PAD_MULTIPLE = 8
COMPLETION_MULTIPLE = 32
#: Tokens per chunk of the output projection when the run sets no ``loss_chunk`` (finetune's default is 64
#: for SmolLM2's vocabulary): a step that recomputes its blocks peaks in the projection. 8 completions of 16
#: tokens, SmolLM2-135M, LoRA on 8 layers: MLX's peak 0.604 GB, sampling's own 0.592 GB.
CHUNK_TOKENS = 32
#: Added to a group's standard deviation (mlx-lm-lora's and TRL's).
STD_EPSILON = 1e-4


@dataclass(frozen=True)
class GRPOConfig:
    """What GRPO samples and optimises (the GRPO settings of ``FinetuneConfig``, see its help).

    ``generation_batch``: prompts sampled together (the rest of a step's prompts after them);
    ``num_iterations``: optimizer steps on each rollout batch (TRL's name).

    Example: ``GRPOConfig.from_finetune(FinetuneConfig(train_mode="grpo", group_size=8)).group_size`` -> ``8``.
    """

    group_size: int = 4
    sampling: Sampling = field(default_factory=Sampling)
    beta: float = 0.1
    epsilon: float = 1e-4
    epsilon_high: float | None = None
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    seed: int = 0
    generation_batch: int = 4
    num_iterations: int = 1

    @classmethod
    def from_finetune(cls, cfg: Any) -> GRPOConfig:
        """The GRPO settings of a fine-tuning run's config."""
        sampling = Sampling(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k), int(cfg.max_completion_length))
        return cls(int(cfg.group_size), sampling, float(cfg.beta), float(cfg.clip_epsilon),
                   None if cfg.epsilon_high is None else float(cfg.epsilon_high), cfg.grpo_loss_type,
                   cfg.importance_sampling_level, cfg.scale_rewards, int(cfg.seed), int(cfg.batch_size),
                   int(cfg.num_iterations))

    @property
    def upper(self) -> float:
        """The upper clipping width (``epsilon_high``, else ``epsilon``)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# -- data ----------------------------------------------------------------------------------


class PromptRows:
    """Map-style dataset of GRPO prompts: a row is ``{"prompt": int32 tokens, "prompt_mask": ones,
    "row": its number}`` (``row`` counts from ``offset``, so that the rows of all splits have distinct
    numbers; 0-d, stacked as float32 by the collate: exact below 2**24 rows). ``lengths`` drive length
    bucketing; ``texts``, ``answers`` and ``types`` are what the reward functions get.

    Example: ``rows = PromptRows.from_records(records, tokenizer, where, limit=1536)``.
    """

    def __init__(self, tokens: list[np.ndarray], texts: list[str], answers: list[str], types: list[Any],
                 offset: int = 0) -> None:
        self.tokens, self.texts, self.answers, self.types = tokens, texts, answers, types
        self.offset = offset
        self.index = list(range(len(tokens)))
        self.lengths = [len(t) for t in tokens]
        self.packed = False

    @classmethod
    def from_records(cls, records: Sequence[Any], tokenizer: Any, where: Sequence[str], limit: int,
                     offset: int = 0) -> PromptRows:
        """Check and tokenize GRPO rows; ``where[i]`` names row ``i`` in errors, ``limit`` is the most tokens
        a prompt may have (``max_seq_length - max_completion_length``)."""
        from mlx_train.llm.data import _chat

        tokens, texts, answers, types = [], [], [], []
        for record, place in zip(records, where, strict=True):
            messages, answer = _row(record, place)
            try:
                ids = _chat(tokenizer, messages, add_generation_prompt=True)
            except DataError as error:
                raise DataError(f"{place}: {error}") from None
            if len(ids) > limit:
                raise DataError(f"{place}: the prompt is {len(ids)} tokens with the chat template, more than "
                                f"max_seq_length - max_completion_length = {limit}; raise --max-seq-length, lower "
                                "--max-completion-length, or shorten or drop the row")
            tokens.append(np.asarray(ids, dtype=np.int32))
            texts.append(record["prompt"] if isinstance(record["prompt"], str) else messages[-1]["content"])
            answers.append(answer)
            types.append(record.get("type"))
        return cls(tokens, texts, answers, types, offset)

    def __len__(self) -> int:
        return len(self.index)

    def head(self, count: int) -> PromptRows:
        """The first ``count`` rows (all when ``count`` < 0)."""
        if count < 0 or count >= len(self.index):
            return self
        first = copy.copy(self)
        first.index, first.lengths = self.index[:count], self.lengths[:count]
        return first

    def samples(self) -> list[dict[str, np.ndarray]]:
        return [self[i] for i in range(len(self))]

    def __getitem__(self, position: int) -> dict[str, np.ndarray]:
        i = self.index[position]
        prompt = self.tokens[i]
        return {"prompt": prompt, "prompt_mask": np.ones(len(prompt), np.int32), "row": np.int32(self.offset + i)}


def _row(record: Any, where: str) -> tuple[list[dict[str, Any]], str]:
    """``(messages, answer)`` of a GRPO row, or a DataError saying what is wrong and how to fix it."""
    shape = "a GRPO row is {\"prompt\": \"...\", \"answer\": \"...\"} (optional \"system\", \"type\")"
    if not isinstance(record, dict):
        raise DataError(f"{where}: the row is a {type(record).__name__}; {shape}")
    for key in ("prompt", "answer"):
        if key not in record:
            raise DataError(f"{where}: the row has no \"{key}\" (keys: {sorted(record)}); {shape}")
    prompt, answer, system = record["prompt"], record["answer"], record.get("system")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: the prompt is empty; give it text or drop the row")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in prompt):
        messages = list(prompt)
    else:
        raise DataError(f"{where}: \"prompt\" must be a string (or a list of {{\"role\", \"content\"}} messages), got "
                        f"{type(prompt).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: \"answer\" must be a string (a number is taken as its text), got "
                        f"{type(answer).__name__}; write the expected answer as text")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: \"system\" must be a string, got {type(system).__name__}")
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    return messages, str(answer)


def build_splits(cfg: Any, tokenizer: Any, log: Any = print) -> dict[str, PromptRows]:
    """The prompt rows of each split of ``cfg.data`` (numbered one after the other across the splits).

    Example: ``splits = build_splits(FinetuneConfig(model=..., data="gsm8k/", train_mode="grpo"), tokenizer)``.
    """
    from mlx_train.llm.preference import load_pairs

    limit = cfg.max_seq_length - cfg.max_completion_length
    splits: dict[str, PromptRows] = {}
    offset = 0
    for name, (records, where) in load_pairs(cfg.data).items():
        if records:
            splits[name] = PromptRows.from_records(records, tokenizer, where, limit, offset)
            offset += len(records)
            log(f"{name}: {len(records)} prompts, {sum(splits[name].lengths)} prompt tokens; {cfg.group_size} "
                f"completions of up to {cfg.max_completion_length} tokens each")
    return splits


# -- rollouts, rewards, advantages --------------------------------------------------------


def advantages(rewards: np.ndarray, group_size: int, scale: str = "group") -> np.ndarray:
    """``(r - group mean) / (std + 1e-4)`` per completion, groups of ``group_size`` consecutive rows; the std
    is the group's (``scale="group"``, population std as mlx-lm-lora), the whole batch's (``"batch"``) or 1
    (``"none"``).

    Example: ``advantages(np.array([1.0, 0.0, 0.0, 0.0]), 4)`` -> ``[1.732, -0.577, -0.577, -0.577]`` (rounded).
    """
    groups = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale == "group":
        centred = centred / (groups.std(axis=1, keepdims=True) + STD_EPSILON)
    elif scale == "batch":
        centred = centred / (groups.std() + STD_EPSILON)
    return np.asarray(centred.reshape(-1), dtype=np.float32)


def rollout_batch(prompts: Sequence[np.ndarray], completions: Any, group_size: int,
                  max_tokens: int | None = None) -> dict[str, np.ndarray]:
    """The model inputs of a rollout: ``inputs``/``targets`` (prompt then completion, shifted by one, padded to
    a multiple of ``PAD_MULTIPLE``), ``positions`` (where each completion's tokens are targets, -1 after it;
    a multiple of ``COMPLETION_MULTIPLE`` wide, or ``max_tokens``, the most a completion has, when that is
    less) and ``prompts`` (each row's prompt but its last token, the part a group shares, padded to a multiple
    of ``PAD_MULTIPLE``), rows as in ``completions``.

    Example: ``rollout_batch([np.array([5, 6])], generate_groups(...), 4)["positions"][0, :3]`` -> ``[1, 2, 3]``.
    """
    def up(n: int, multiple: int) -> int:
        return -(-n // multiple) * multiple

    rows = len(completions.lengths)
    prompt_lengths = np.repeat([len(p) for p in prompts], group_size)
    width = up(int((prompt_lengths + completions.lengths).max()) - 1, PAD_MULTIPLE)
    slots = up(int(completions.lengths.max()), COMPLETION_MULTIPLE)
    inputs = np.zeros((rows, width + 1), np.int32)
    heads = np.zeros((rows, up(max(int(prompt_lengths.max()) - 1, 1), PAD_MULTIPLE)), np.int32)
    positions = np.full((rows, slots if max_tokens is None else min(slots, max_tokens)), -1, np.int32)
    for r in range(rows):
        p, c = int(prompt_lengths[r]), int(completions.lengths[r])
        inputs[r, :p] = prompts[r // group_size]
        inputs[r, p:p + c] = completions.tokens[r, :c]
        heads[r, :p - 1] = prompts[r // group_size][:-1]
        positions[r, :c] = np.arange(p - 1, p - 1 + c)
    return {"inputs": inputs[:, :-1], "targets": inputs[:, 1:], "positions": positions, "prompts": heads}


class RolloutAnchor(Callback):
    """Keeps in each checkpoint what a run with ``num_iterations`` > 1 needs to resume part-way through a rollout
    batch: the trainable weights that sampled it (``GRPOLoss.anchor_state``), so that the resumed run samples
    it again, bit for bit, instead of the uninterrupted run's later steps training on other rollouts.

    Example: ``trainer.train(loader, callbacks=[RolloutAnchor(loss)])``.
    """

    def __init__(self, loss: GRPOLoss) -> None:
        self.loss = loss
        self.trainer: Any = None

    def on_fit_start(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {} if self.trainer is None else self.loss.anchor_state(self.trainer.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.load_anchor_state(state)


class Phases:
    """Where GRPO's training steps spend their time, in seconds per rollout since the last ``read``:
    ``generation`` (sampling the completions), ``rewards`` (their text, the reward functions, the advantages,
    the rollout batch) and ``update`` (the rest: the reference and policy passes, the backward pass, the
    optimizer, a report; measured from the end of one rollout to the next step's weights being ready, so a
    rollout counts the update of the step before it).

    Example: ``phases.mark("generation")`` adds the seconds since the last mark to ``generation``.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.last: float | None = None
        self.seconds: dict[str, float] = {}
        self.rollouts = 0

    def mark(self, phase: str, measured: bool = True) -> None:
        """The seconds since the last mark were ``phase``'s (not counted when ``measured`` is False, or
        when there was no last mark); ``rewards`` ends a rollout."""
        now = self.clock()
        if measured and self.last is not None:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.rollouts += measured and phase == "rewards"
        self.last = now

    def forget(self) -> None:
        """The time until the next mark belongs to no phase (an evaluation ran)."""
        self.last = None

    def read(self) -> dict[str, float]:
        """``time_<phase>``: seconds per rollout since the last read."""
        out = {f"time_{k}": v / max(self.rollouts, 1) for k, v in self.seconds.items()}
        self.seconds, self.rollouts = {}, 0
        return out


class GRPOLoss:
    """``loss(model, batch) -> (loss, items, metrics)`` on rollout batches, which ``prepare(model, batch,
    step)`` samples and scores from a loader's batch of prompts (see the module docstring).

    ``rewards``: an object with ``score(prompts, completions, answers, types) -> scores`` whose ``total``
    (one weighted total per completion) and ``per_function`` (name -> values, NaN where it does not apply)
    are arrays (``mlx_train.llm.rewards.RewardSet``); ``names``: its functions, in order; ``rows``: every
    split's ``PromptRows`` (a batch's ``row`` numbers index them).

    Example: ``loss = GRPOLoss(GRPOConfig(), rewards, ["answer_match"], tokenizer, [train, valid])``.
    """

    def __init__(self, config: GRPOConfig, rewards: Any, names: Sequence[str], tokenizer: Any,
                 rows: Sequence[PromptRows], chunk: int | None = None) -> None:
        self.config, self.rewards, self.names, self.tokenizer = config, rewards, list(names), tokenizer
        self.rows, self.chunk = list(rows), chunk
        self.__name__ = "grpo_loss"
        metrics = ["reward_mean", "reward_std", *(f"reward_{n}_{s}" for n in self.names
                                                  for s in ("mean", "std", "coverage")),
                   "completion_length", "completion_length_max", "clip_ratio_low", "clip_ratio_high", "clip_ratio"]
        self.metric_names = tuple(metrics + (["kl"] if config.beta > 0 else []))
        self.phases = Phases()
        #: With num_iterations > 1: the rollout batch of the step that sampled it (``(step, batch)``), and the
        #: trainable weights it was sampled with (``(step, {name: array})``), which a checkpoint keeps.
        self._pending: tuple[int, dict[str, mx.array]] | None = None
        self._anchor: tuple[int, dict[str, mx.array]] | None = None

    # -- the rollout batch (main thread, before the step) ---------------------------------

    def prepare(self, model: nn.Module, batch: dict[str, Any], step: int | None) -> dict[str, mx.array]:
        """Sample ``group_size`` completions of each prompt of ``batch`` with ``model`` as it is now, score
        them and return the rollout batch the step trains on (``step`` None: an evaluation batch). With
        ``num_iterations`` > 1 the loader hands each batch of prompts out that many times in a row
        (``batch_repeats``): its first step samples the rollouts and keeps them with their log-probabilities
        under the weights they were sampled with (``old_logps``), the next steps train on them again."""
        cfg = self.config
        if step is None or cfg.num_iterations == 1:
            return self._rollouts(model, batch, step)
        start = step - step % cfg.num_iterations
        if self._pending is not None and self._pending[0] == start:
            return self._pending[1]
        if step != start:  # a run resumed part-way through one: sampled again from the weights that sampled it
            self._pending = (start, self._resampled(model, batch, step, start))
            return self._pending[1]
        # a new rollout batch: these weights sample it, and are kept until its last step
        self._anchor = (start, dict(tree_flatten(model.trainable_parameters())))
        out = self._rollouts(model, batch, start, old=True)
        self._pending = (start, out)
        # its first step is num_iterations 1's: the step's own log-probabilities are the sampling policy's
        return {k: v for k, v in out.items() if k != "old_logps"}

    def _resampled(self, model: nn.Module, batch: dict[str, Any], step: int, start: int) -> dict[str, mx.array]:
        if self._anchor is None or self._anchor[0] != start:
            raise CheckpointError(f"step {step} trains on the rollouts of step {start} (num_iterations "
                                  f"{self.config.num_iterations}), but the checkpoint holds no weights of step {start} "
                                  "to sample them again: resume with the num_iterations the run was started with")
        current = model.trainable_parameters()
        model.update(tree_unflatten(list(self._anchor[1].items())))
        try:
            return self._rollouts(model, batch, start, old=True)
        finally:
            model.update(current)

    def anchor_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` optimizer steps needs to train the rest of its rollout batch: the
        weights that sampled it (none at a rollout's first step)."""
        if self._anchor is None or step % self.config.num_iterations == 0 or \
                self._anchor[0] != step - step % self.config.num_iterations:
            return {}
        return {"step": self._anchor[0], "weights": {k.replace(".", "/"): v for k, v in self._anchor[1].items()}}

    def load_anchor_state(self, state: dict[str, Any]) -> None:
        """Put back what ``anchor_state`` saved (a resumed run samples its rollout batch again from them)."""
        self._pending = None
        self._anchor = None
        if state:
            self._anchor = (int(state["step"]), {k.replace("/", "."): v for k, v in state["weights"].items()})

    def _rollouts(self, model: nn.Module, batch: dict[str, Any], step: int | None,
                  old: bool = False) -> dict[str, mx.array]:
        """Sampled, scored rollouts of ``batch`` with ``model`` now, drawn with ``step``'s key; ``old``: with
        their log-probabilities under these weights (``old_logps``)."""
        cfg, phases = self.config, self.phases
        if step is None:
            phases.forget()  # an evaluation batch: the time since the last rollout is no step's update
        else:
            mx.eval(model.trainable_parameters())  # the last step's update, which sampling waits for anyway
            phases.mark("update")
        lengths = np.array(batch["prompt_mask"]).sum(axis=1)
        tokens = np.array(batch["prompt"])
        numbers = np.array(batch["row"]).astype(np.int64)
        prompts = [tokens[i, :lengths[i]] for i in range(len(lengths))]
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            parts = [self._sample(model, prompts[s:s + cfg.generation_batch], numbers[s:s + cfg.generation_batch],
                                  step) for s in range(0, len(prompts), cfg.generation_batch)]
        finally:
            model.train(was_training)
        completions = _joined(parts)
        phases.mark("generation", measured=step is not None)
        texts = [self.tokenizer.decode(completions.row(i, with_end=False)) for i in range(len(completions.lengths))]
        records = [self._record(int(n)) for n in numbers for _ in range(cfg.group_size)]
        scores = self.rewards.score([r[0] for r in records], texts, [r[1] for r in records], [r[2] for r in records])
        total = np.asarray(scores.total, np.float64)
        out = rollout_batch(prompts, completions, cfg.group_size, cfg.sampling.max_tokens)
        out["advantages"] = advantages(total, cfg.group_size, cfg.scale_rewards)
        out["rewards"] = total.astype(np.float32)
        out["function_rewards"] = np.stack([np.asarray(scores.per_function[n], np.float32) for n in self.names],
                                           axis=1) if self.names else np.zeros((len(total), 0), np.float32)
        arrays = {k: mx.array(v) for k, v in out.items()}
        if old:
            arrays["old_logps"] = self.sampled_logprobs(model, arrays)
        phases.mark("rewards", measured=step is not None)
        if step is None:
            phases.forget()  # the evaluation's own step comes next: no training step's update
        return arrays

    def sampled_logprobs(self, model: nn.Module, batch: dict[str, mx.array]) -> mx.array:
        """The log-probabilities of a rollout batch's completion tokens under ``model`` as it is (evaluation
        mode, no gradient): the sampling policy's, which later steps on the same rollouts compare with."""
        from mlx_train.llm.loss import output_head, target_logprobs

        was_training = model.training
        model.eval()
        try:
            if "prompts" in batch and output_head(model) is not None:
                logps = Rollout(batch, self.config.group_size).logprobs(model, 0, None, self.chunk, grad=False,
                                                                        precompute=False)
            else:
                logps = target_logprobs(model, batch, self.chunk, grad=False)[0]
            logps = mx.stop_gradient(logps)
            mx.eval(logps)
        finally:
            model.train(was_training)
        return logps

    def _sample(self, model: nn.Module, prompts: list[np.ndarray], numbers: np.ndarray, step: int | None) -> Any:
        key = rollout_key(self.config.seed, numbers.tolist(), step)
        return generate_groups(model, prompts, self.config.group_size, self.config.sampling, key,
                               self.tokenizer.eos_token_ids)

    def _record(self, number: int) -> tuple[str, str, Any]:
        for rows in self.rows:
            i = number - rows.offset
            if 0 <= i < len(rows.tokens):
                return rows.texts[i], rows.answers[i], rows.types[i]
        raise DataError(f"a batch names prompt row {number}, which no split of this run has")

    # -- the loss (inside the compiled step) -----------------------------------------------

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
        from mlx_train.llm.loss import output_head

        cfg = self.config
        positions = batch["positions"]
        mask = positions >= 0
        if "prompts" not in batch or output_head(model) is None:
            logps, ref = self._whole_rows(model, batch)
        else:
            logps, ref = self._shared_prompts(model, batch)
        old = batch["old_logps"] if "old_logps" in batch else mx.stop_gradient(logps)
        return objective(cfg, logps, old, ref, mask, batch, self.names)

    def _shared_prompts(self, model: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array | None]:
        """The policy's and the reference's log-probabilities of the completions, each group's prompt run once
        (``Rollout``)."""
        from mlx_train.llm.preference import adapters_off

        rollout = Rollout(batch, self.config.group_size)
        ref, hidden, shared = None, None, 0
        if self.config.beta > 0:  # first: its activations are gone before the policy's are built
            shared = shared_layers(model)  # below the adapters the reference computes what the policy does
            if shared:
                prompts, completions = rollout.hidden_before(model, shared)
                hidden = (mx.stop_gradient(prompts), mx.stop_gradient(completions))
            with adapters_off(model):
                ref = mx.stop_gradient(rollout.logprobs(model, shared, hidden, self.chunk, grad=False))
            if hidden is None:
                rollout = rollout.after(ref)
            else:
                hidden = (mx.depends(hidden[0], ref), mx.depends(hidden[1], ref))
        return rollout.logprobs(model, shared, hidden, self.chunk, precompute=model.training), ref

    def _whole_rows(self, model: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array | None]:
        """The same from whole rows (prompt and completion), for models whose layers take no cache."""
        from mlx_train.llm.loss import target_logprobs
        from mlx_train.llm.preference import adapters_off

        ref, inputs, hidden, shared = None, batch["inputs"], None, 0
        if self.config.beta > 0:
            shared = shared_layers(model)
            if shared:
                hidden = mx.stop_gradient(hidden_before(model, inputs, shared))
            with adapters_off(model), layers_given(model, shared, hidden):
                ref = mx.stop_gradient(target_logprobs(model, batch, self.chunk, grad=False)[0])
            if hidden is None:
                inputs = mx.depends(inputs, ref)
            else:
                hidden = mx.depends(hidden, ref)
        with layers_given(model, shared, hidden):
            logps, _ = target_logprobs(model, {**batch, "inputs": inputs}, self.chunk, precompute=model.training)
        return logps, ref


# -- each group's prompt once -----------------------------------------------------------------


class _PromptCache:
    """A layer's keys and values of the prompts (right-padded, from position 0), kept for the completions."""

    def __init__(self) -> None:
        self.offset = 0
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values

    def make_mask(self, n: int, **_: Any) -> mx.array:
        return mx.arange(n)[:, None] >= mx.arange(n)[None]


class _CompletionCache:
    """A layer's view of its row's prompt for the completions: the prompt's keys and values (of its group's
    row, ``slot``) before the completion's own, the prompt's padding masked; positions from ``offset``."""

    def __init__(self, prompt: _PromptCache, slot: mx.array, lengths: mx.array, width: int) -> None:
        self.prompt, self.slot, self.offset, self.width = prompt, slot, lengths, width

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        assert self.prompt.keys is not None and self.prompt.values is not None, "the prompts ran first"
        return (mx.concatenate([self.prompt.keys[self.slot], keys], axis=2),
                mx.concatenate([self.prompt.values[self.slot], values], axis=2))

    def make_mask(self, n: int, **_: Any) -> mx.array:
        """``[rows, 1, n, width + n]``: a completion token sees its prompt and the completion up to itself."""
        prompt = mx.arange(self.width)[None, None, None, :] < self.offset[:, None, None, None]
        own = mx.arange(n)[:, None] >= mx.arange(n)[None]
        return mx.concatenate([mx.broadcast_to(prompt, (self.offset.shape[0], 1, n, self.width)),
                               mx.broadcast_to(own, (self.offset.shape[0], 1, n, n))], axis=-1)


class Rollout:
    """A rollout batch scored with each group's prompt run once: rows with the same ``prompts`` one after the
    other (a group; a micro-batch cut from it may start or end inside one) share one prompt pass, whose keys
    and values every completion of the group attends to; the completions run on their own tokens only (the
    prompt's last token, then the completion but its last). The same log-probabilities as whole rows,
    computed on far fewer positions (8 completions of 16 tokens after 24-token prompts: 2-3 prompt rows of 24
    and 8 completion rows of 16, not 8 rows of 40), the gradient reaching the prompt's positions through
    their keys and values summed over the group.

    Example: ``logps = Rollout(batch, group_size=4).logprobs(model, 0, None, chunk=64)`` -> ``[rows, slots]``.
    """

    def __init__(self, batch: dict[str, Any], group_size: int) -> None:
        prompts, positions = batch["prompts"], batch["positions"]
        rows = prompts.shape[0]
        starts = mx.concatenate([mx.array([True]), (prompts[1:] != prompts[:-1]).any(axis=1)])
        self.slot = mx.cumsum(starts.astype(mx.int32)) - 1  # each row's group within the batch
        groups = min(rows, -(-(rows - 1) // group_size) + 1)  # the most a cut of ``rows`` rows can meet
        first = mx.argmax((self.slot[None, :] == mx.arange(groups)[:, None]).astype(mx.int32), axis=1)
        self.prompts = prompts[first]
        self.lengths = positions[:, 0]  # the prompt's length but one: where the completion's inputs start
        where = mx.maximum(positions, 0)
        self.inputs = mx.take_along_axis(batch["inputs"], where, axis=1)
        self.targets = mx.take_along_axis(batch["targets"], where, axis=1)

    def after(self, done: mx.array) -> Rollout:
        """The same rollout, computed after ``done`` (the reference's activations freed before the policy's)."""
        out = copy.copy(self)
        out.prompts, out.inputs = mx.depends(self.prompts, done), mx.depends(self.inputs, done)
        return out

    def _caches(self, model: nn.Module) -> tuple[list[_PromptCache], list[_CompletionCache]]:
        prompt = [_PromptCache() for _ in model.layers]
        return prompt, [_CompletionCache(c, self.slot, self.lengths, self.prompts.shape[1]) for c in prompt]

    def hidden_before(self, model: nn.Module, count: int) -> tuple[mx.array, mx.array]:
        """The hidden states ``model.layers[count]`` receives for the prompts and the completions."""
        prompt, completion = self._caches(model)
        return (_tapped(model, count, self.prompts, prompt), _tapped(model, count, self.inputs, completion))

    def logprobs(self, model: nn.Module, count: int, hidden: tuple[mx.array, mx.array] | None, chunk: int | None,
                 grad: bool = True, precompute: bool = True) -> mx.array:
        """``[rows, slots]`` log-probabilities of the completions' tokens; ``model.layers[:count]`` pass on
        ``hidden`` (``hidden_before``'s) instead of computing it again."""
        from mlx_train.llm.loss import chunk_tokens, chunked_logprobs, output_head

        found = output_head(model)
        assert found is not None, "Rollout scores mlx-lm models (model.model and an output head)"
        prompt, completion = self._caches(model)
        with layers_given(model, count, None if hidden is None else hidden[0]):
            model["model"](self.prompts, prompt)  # lazily: only the keys and values are used
        with layers_given(model, count, None if hidden is None else hidden[1]):
            out = model["model"](self.inputs, completion)
        if chunk is None:
            vocabulary = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 32768)
            chunk = min(CHUNK_TOKENS, chunk_tokens(vocabulary))
        rows, width = self.targets.shape
        tokens = rows * width
        padding = -tokens % chunk  # every chunk as wide: a row rounds alike however the batch was cut
        last = mx.pad(out.reshape(tokens, -1), [(0, padding), (0, 0)])
        targets = mx.pad(self.targets.reshape(-1), [(0, padding)])
        logps = chunked_logprobs(found[0], found[1], last, targets, chunk, grad, precompute)
        return logps[:tokens].reshape(rows, width)


def _tapped(model: nn.Module, count: int, tokens: mx.array, caches: list[Any]) -> mx.array:
    """What ``model.layers[count]`` receives for ``tokens`` with ``caches`` (the layers from it on skipped)."""
    layers = model.layers
    taps = [_StandIn(layer) for layer in layers[count:]]
    with _standing_in(layers, count, taps):
        model["model"](tokens, caches)  # lazily: only the layers below are ever computed
    assert taps[0].seen is not None, "the model never called its layers"
    return taps[0].seen


# -- the reference pass shares the layers below the adapters -------------------------------


class _StandIn:
    """In ``model.layers`` for the duration of a pass, in place of ``layer``: returns ``hidden`` whatever it is
    given, or (``hidden`` None) its input unchanged, the first input it saw kept in ``seen``. Other attributes
    (a model's layer loop may read some, e.g. ``use_sliding``) are the layer's."""

    def __init__(self, layer: Any, hidden: mx.array | None = None) -> None:
        self.layer, self.hidden = layer, hidden
        self.seen: mx.array | None = None

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self.seen is None:
            self.seen = x
        return x if self.hidden is None else self.hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["layer"], name)


@contextmanager
def _standing_in(layers: list[Any], start: int, stand_ins: list[_StandIn]) -> Iterator[None]:
    """``layers[start:start + len(stand_ins)]`` replaced by ``stand_ins`` inside the block, put back on exit."""
    originals = layers[start:start + len(stand_ins)]
    layers[start:start + len(stand_ins)] = stand_ins
    try:
        yield
    finally:
        layers[start:start + len(stand_ins)] = originals


def shared_layers(model: nn.Module) -> int:
    """How many of ``model.layers``, from the first, are computed alike with the adapters on and off and train
    nothing: the reference pass can start from the policy's hidden state after them (0: none, or a model
    without a ``layers`` list, or with adapters or trained weights outside ``layers[n:]``).

    Example: LoRA on the last 8 of 30 layers -> ``22``.
    """
    from mlx.utils import tree_flatten

    from mlx_train.llm.preference import _base_layer

    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        return 0

    def changes(module: nn.Module) -> int:  # adapters, trained arrays
        return (sum(_base_layer(m) is not None for m in module.modules())
                + len(tree_flatten(module.trainable_parameters())))

    count = next((i for i, layer in enumerate(layers) if changes(layer)), 0)
    inside = sum(changes(layer) for layer in layers[count:])
    return count if inside == changes(model) else 0


def hidden_before(model: nn.Module, inputs: mx.array, count: int) -> mx.array:
    """The hidden state ``model.layers[count]`` receives for ``inputs`` (the layers from it on are skipped)."""
    layers = model.layers
    taps = [_StandIn(layer) for layer in layers[count:]]
    with _standing_in(layers, count, taps):
        model(inputs)  # lazily: only the layers below are ever computed
    assert taps[0].seen is not None, "the model never called its layers"
    return taps[0].seen


def layers_given(model: nn.Module, count: int, hidden: mx.array | None) -> AbstractContextManager[None]:
    """Inside the block, ``model.layers[:count]`` pass on ``hidden`` (their output, computed once by
    ``hidden_before``) instead of computing it again; nothing changes when ``count`` is 0."""
    if not count or hidden is None:
        return nullcontext()
    layers = model.layers
    return _standing_in(layers, 0, [_StandIn(layer, hidden) for layer in layers[:count]])


def objective(cfg: GRPOConfig, logps: mx.array, old: mx.array, ref: mx.array | None, mask: mx.array,
              batch: dict[str, Any], names: Sequence[str] = ()) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
    """The clipped objective, its items and metrics from the completions' log-probabilities ``[rows, K]``
    under the policy, the sampling policy (``old``) and the reference (``ref``, None when ``beta`` is 0);
    ``names``: the reward functions of ``batch["function_rewards"]``'s columns.

    Example: ``loss, items, metrics = objective(cfg, logps, mx.stop_gradient(logps), None, mask, batch)``.
    """
    weights = mask.astype(mx.float32)
    counts = weights.sum(axis=1)
    log_ratio = mx.where(mask, logps - old, 0.0)
    if cfg.importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(axis=1) / mx.maximum(counts, 1.0))[:, None]
    ratio = mx.exp(log_ratio)
    advantage = batch["advantages"].astype(mx.float32)[:, None]
    clipped = mx.clip(ratio, 1 - cfg.epsilon, 1 + cfg.upper)
    per_token = -mx.minimum(ratio * advantage, clipped * advantage)
    kl = None
    if ref is not None:
        delta = mx.where(mask, ref - logps, 0.0)
        kl = mx.expm1(delta) - delta
        per_token = per_token + cfg.beta * kl
    sums = mx.where(mask, per_token, 0.0).sum(axis=1)
    rows = sums.shape[0]
    if cfg.loss_type == "grpo":
        loss, items = (sums / mx.maximum(counts, 1.0)).mean(), mx.array(float(rows))
    elif cfg.loss_type == "bnpo":
        loss, items = sums.sum() / mx.maximum(counts.sum(), 1.0), counts.sum()
    else:  # dr_grpo
        loss, items = sums.sum() / (rows * cfg.sampling.max_tokens), mx.array(float(rows))
    return loss, items, _metrics(cfg, ratio, advantage, kl, weights, counts, batch, names)


def _metrics(cfg: GRPOConfig, ratio: mx.array, advantage: mx.array, kl: mx.array | None, weights: mx.array,
             counts: mx.array, batch: dict[str, Any], names: Sequence[str]) -> dict[str, mx.array]:
    ratio = mx.stop_gradient(ratio)

    def per_completion(values: mx.array) -> mx.array:  # the share (or mean) over each completion's tokens
        return ((values * weights).sum(axis=1) / mx.maximum(counts, 1.0)).mean()

    low = ((ratio < 1 - cfg.epsilon) & (advantage < 0)).astype(mx.float32)
    high = ((ratio > 1 + cfg.upper) & (advantage > 0)).astype(mx.float32)
    rewards = batch["rewards"]
    out = {"reward_mean": rewards.mean(), "reward_std": mx.sqrt(mx.var(rewards)),
           "completion_length": counts.mean(), "completion_length_max": counts.max(),
           "clip_ratio_low": per_completion(low), "clip_ratio_high": per_completion(high),
           "clip_ratio": per_completion(mx.maximum(low, high))}
    functions = batch["function_rewards"]
    for j, name in enumerate(names):
        values = functions[:, j]
        scored = ~mx.isnan(values)
        n = mx.maximum(scored.sum(), 1)
        mean = mx.where(scored, values, 0.0).sum() / n
        out[f"reward_{name}_mean"] = mean
        out[f"reward_{name}_std"] = mx.sqrt(mx.where(scored, (values - mean) ** 2, 0.0).sum() / n)
        out[f"reward_{name}_coverage"] = scored.astype(mx.float32).mean()
    if kl is not None:
        out["kl"] = per_completion(mx.stop_gradient(kl))
    return out


def _joined(parts: list[Any]) -> Any:
    """One ``Completions`` of several sampled one after the other (their widths padded to the widest)."""
    from mlx_train.llm.rollouts import Completions

    if len(parts) == 1:
        return parts[0]
    width = max(p.tokens.shape[1] for p in parts)
    tokens = np.concatenate([np.pad(p.tokens, ((0, 0), (0, width - p.tokens.shape[1]))) for p in parts])
    return Completions(tokens, np.concatenate([p.lengths for p in parts]), np.concatenate([p.ended for p in parts]))
