"""Preference tuning on the Trainer: DPO (sigmoid, hinge, IPO losses), ORPO and CPO, from pairs
of replies to one prompt.

Rows are ``{"prompt": str, "chosen": str, "rejected": str}`` (optionally ``"system"``), or chat
rows whose prompt is a conversation -- ``{"messages" or "prompt": [{"role", "content"}, ...],
"chosen": reply, "rejected": reply}`` with a reply a string, a message or a list of messages.
Both replies are rendered after the prompt with the tokenizer's chat template, and only the
reply's tokens are scored: a sequence's log-probability is the sum over its reply tokens.

A pair is one item: a dataset row holds both sequences (``chosen_*``/``rejected_*`` arrays), so
batches, gradient accumulation and the Trainer's out-of-memory splitting (all cut along the
first axis) never separate them, and accumulation is weighted by pairs.

The reference policy of DPO:

- LoRA/DoRA: the same model with the adapters off. Inside the compiled step the loss swaps each
  adapter layer for the base layer it wraps (its ``linear``/``embedding``), runs the forward
  pass under ``stop_gradient`` and puts the adapters back. The swap is part of every trace (it
  is not a switch flipped between calls), so no second copy of the weights is held and compiled
  steps stay correct.
- full fine-tuning, a ``reference_model_path``, or ``precompute_ref_log_probs`` (TRL's name; with
  LoRA/DoRA the adapters are off for it): the reference log-probabilities are computed once before
  training (by the base model as loaded, or by the reference model, which is then freed) and
  stored with the rows (``reference_chosen``/``reference_rejected``). A step then runs no
  reference pass: less memory and time per step, for one forward pass over the data first.
- ``reference_free``: the reference log-probabilities are 0.

Example::

    loss = PreferenceLoss(PreferenceConfig("dpo", beta=0.1))
    trainer = Trainer(model, optimizer, loss_fn=loss)     # reports rewards, accuracy, margin
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_train.config.finetune import DPO_LOSS_TYPES, TRAIN_MODES
from mlx_train.errors import ConfigError, DataError

METRICS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen",
           "logps_rejected")
SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferenceConfig:
    """What a preference loss computes: ``method`` (dpo, orpo, or cpo: mlx-lm-lora's CPO, the DPO loss
    against no reference -- TRL's CPO adds an NLL term on the chosen reply, this does not); ``beta``
    (DPO's temperature, ORPO's weight of the odds-ratio term, as in mlx-lm-lora); the DPO/CPO
    ``loss_type`` (sigmoid, hinge, ipo), ``label_smoothing`` (sigmoid only: the assumed share of
    flipped labels) and ``reference_free``.

    Example: ``PreferenceConfig("dpo", beta=0.1, loss_type="ipo")``.
    """

    method: str = "dpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False

    def __post_init__(self) -> None:
        if self.method not in TRAIN_MODES[1:]:
            raise ConfigError(f"train_mode is {self.method!r}; choose one of {', '.join(TRAIN_MODES)}")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(f"dpo_loss_type is {self.loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
        if not self.beta > 0:
            raise ConfigError(f"beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and (self.method == "orpo" or self.loss_type != "sigmoid"):
            raise ConfigError("label_smoothing applies to the DPO sigmoid loss only; set it to 0 or use "
                              "--dpo-loss-type sigmoid")

    @property
    def needs_reference(self) -> bool:
        """DPO compares with a reference policy unless ``reference_free``; ORPO and CPO need none."""
        return self.method == "dpo" and not self.reference_free

    @classmethod
    def from_finetune(cls, cfg: Any) -> PreferenceConfig:
        """The preference settings of a fine-tuning run's ``FinetuneConfig`` (its llm section).

        Example: ``PreferenceConfig.from_finetune(FinetuneConfig(train_mode="dpo", beta=0.5)).beta`` -> ``0.5``.
        """
        return cls(cfg.train_mode, float(cfg.beta), cfg.dpo_loss_type, float(cfg.label_smoothing),
                   bool(cfg.reference_free))


# -- data ----------------------------------------------------------------------------------


def _reply(record: dict[str, Any], side: str, where: str) -> list[dict[str, Any]]:
    if side not in record:
        raise DataError(f"{where}: the row has no \"{side}\" reply (keys: {sorted(record)}); a preference row "
                        "is {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}")
    value = record[side]
    messages = [{"role": "assistant", "content": value}] if isinstance(value, str) else \
        [value] if isinstance(value, dict) else value
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise DataError(f"{where}: \"{side}\" must be a string, a message {{\"role\", \"content\"}} or a list of "
                        f"messages, got {type(value).__name__}")
    if not any(str(m["content"]).strip() for m in messages):
        raise DataError(f"{where}: the \"{side}\" reply is empty; give it text or drop the row")
    return messages


Message = dict[str, Any]  # a chat message: {"role": ..., "content": ...}


def pair_messages(record: dict[str, Any], where: str = "row") -> tuple[list[Message], list[Message], list[Message]]:
    """``(prompt, chosen, rejected)`` message lists of a preference row (see the module docstring).

    Example: ``pair_messages({"prompt": "2+2?", "chosen": "4", "rejected": "5"})[1]``
    -> ``[{"role": "assistant", "content": "4"}]``.
    """
    prompt = record.get("messages", record.get("prompt"))
    if prompt is None:
        raise DataError(f"{where}: the row has no \"prompt\" (or \"messages\"); a preference row is "
                        "{\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}")
    if isinstance(prompt, str):
        prompt = ([{"role": "system", "content": record["system"]}] if record.get("system") else []) + \
            [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: the prompt must be a string or a non-empty list of messages")
    return prompt, _reply(record, "chosen", where), _reply(record, "rejected", where)


def encode_pair(record: dict[str, Any], tokenizer: Any, where: str = "row") -> tuple[list[int], list[int], int]:
    """``(chosen tokens, rejected tokens, prompt length)``: both sequences start with the same prompt
    tokens, rendered with the chat template and its generation prompt.

    Example: ``chosen, rejected, n = encode_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, tokenizer)``.
    """
    from mlx_train.llm.chat_masks import reply_start
    from mlx_train.llm.data import _chat

    prompt_messages, chosen, rejected = pair_messages(record, where)
    tools = record.get("tools")
    try:
        prompt = _chat(tokenizer, prompt_messages, tools, add_generation_prompt=True)
        sequences = [_chat(tokenizer, prompt_messages + reply, tools) for reply in (chosen, rejected)]
    except DataError as error:
        raise DataError(f"{where}: {error}") from None
    if all(tokens[:len(prompt)] == prompt for tokens in sequences):
        return sequences[0], sequences[1], len(prompt)
    # a generation prompt that is no prefix of the conversation: find where each reply starts, turn by turn
    try:
        starts = [reply_start(tokenizer, prompt_messages + reply, tools, first=len(prompt_messages))
                  for reply in (chosen, rejected)]
    except DataError as error:
        raise DataError(f"{where}: {error}") from None
    if starts[0] != starts[1] or sequences[0][:starts[0]] != sequences[1][:starts[1]]:
        raise DataError(f"{where}: the chat template renders the prompt differently before the chosen and the "
                        "rejected reply, so the two cannot be scored from the same prompt tokens; use a template "
                        "that renders the prompt the same whatever follows it")
    return sequences[0], sequences[1], starts[0]


class PairDataset:
    """Map-style dataset of preference pairs, one pair per row, built once (deterministically).

    A row holds ``chosen_inputs``/``chosen_targets``/``chosen_mask`` and the same for
    ``rejected`` (targets shifted by one; the mask is 1 on reply tokens), and with stored
    reference log-probabilities ``reference_chosen``/``reference_rejected`` (0-d float32).
    ``lengths`` (the longer sequence of each pair) drive length bucketing.

    Example::

        pairs = PairDataset.from_records(records, tokenizer, max_seq_length=512, where=["train.jsonl:1", ...])
        make_loader(pairs, batch_size=4)      # mlx_train.llm.data.make_loader
    """

    def __init__(self, chosen: list[np.ndarray], rejected: list[np.ndarray], prompt_lengths: list[int],
                 reference: np.ndarray | None = None) -> None:
        self.chosen, self.rejected, self.prompt_lengths = chosen, rejected, prompt_lengths
        self.reference = reference  # float32 [pairs, 2]: chosen, rejected
        self.index = list(range(len(chosen)))
        self.lengths = [max(len(chosen[i]), len(rejected[i])) for i in self.index]
        self.packed = False

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Any]], tokenizer: Any, max_seq_length: int | None,
                     where: Sequence[str]) -> PairDataset:
        """Tokenize preference rows; ``where[i]`` names row ``i`` in errors (``train.jsonl:7``)."""
        chosen, rejected, prompts = [], [], []
        for record, place in zip(records, where, strict=True):
            c, r, n = encode_pair(record, tokenizer, place)
            for side, tokens in zip(SIDES, (c, r), strict=True):
                if max_seq_length is not None and len(tokens) > max_seq_length:
                    raise DataError(
                        f"{place}: prompt and {side} reply are {len(tokens)} tokens, more than max_seq_length="
                        f"{max_seq_length}; raise --max-seq-length, or shorten or drop the row (a cut reply "
                        "would be scored as if it were complete)")
            chosen.append(np.asarray(c, dtype=np.int32))
            rejected.append(np.asarray(r, dtype=np.int32))
            prompts.append(n)
        if not chosen:
            raise DataError("no preference rows to train on")
        return cls(chosen, rejected, prompts)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def trained_tokens(self) -> int:
        """Reply tokens scored over the whole dataset (both replies of every pair)."""
        return int(sum(len(s[i]) - self.prompt_lengths[i] for i in self.index for s in (self.chosen, self.rejected)))

    def head(self, count: int) -> PairDataset:
        """The first ``count`` pairs (all when ``count`` < 0)."""
        if count < 0 or count >= len(self.index):
            return self
        first = copy.copy(self)
        first.index, first.lengths = self.index[:count], self.lengths[:count]
        return first

    def with_reference(self, reference: np.ndarray) -> PairDataset:
        """A copy whose rows carry these reference log-probabilities (``[pairs, 2]``)."""
        out = copy.copy(self)
        out.reference = np.asarray(reference, dtype=np.float32)
        return out

    def samples(self) -> list[dict[str, np.ndarray]]:
        """Every row, built now."""
        return [self[i] for i in range(len(self))]

    def __getitem__(self, position: int) -> dict[str, np.ndarray]:
        i = self.index[position]
        row: dict[str, np.ndarray] = {}
        for side, tokens in zip(SIDES, (self.chosen[i], self.rejected[i]), strict=True):
            mask = np.zeros(len(tokens) - 1, dtype=np.int32)
            mask[self.prompt_lengths[i] - 1:] = 1  # target j is token j + 1: a reply token from the prompt's end
            row[f"{side}_inputs"], row[f"{side}_targets"], row[f"{side}_mask"] = tokens[:-1], tokens[1:], mask
        if self.reference is not None:
            row["reference_chosen"], row["reference_rejected"] = self.reference[i, 0], self.reference[i, 1]
        return row


def load_pairs(data: str) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
    """Each split's preference rows and where each comes from (``dir/train.jsonl:LINE``, or the
    dataset and index for a Hugging Face dataset); a missing split has no rows.

    Example: ``records, where = load_pairs("data/")["train"]``.
    """
    from mlx_train.llm.data import SPLITS, load_records, read_jsonl_lines

    if not os.path.isdir(data):
        loaded = load_records(data)
        return {s: (loaded[s], [f"{data} {s} row {i}" for i in range(len(loaded[s]))]) for s in SPLITS}
    out = {}
    for split in SPLITS:
        path = os.path.join(data, f"{split}.jsonl")
        numbered = read_jsonl_lines(path) if os.path.isfile(path) else []
        out[split] = ([r for _, r in numbered], [f"{path}:{n}" for n, _ in numbered])
    return out


# -- log-probabilities and the losses ----------------------------------------------------


def both_sequences(batch: dict[str, Any], after: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """``(inputs, targets, mask)`` of a batch of pairs, chosen rows then rejected rows; the inputs wait for
    ``after`` (if given). The mask is float32 (1 on reply targets)."""
    inputs = mx.concatenate([batch["chosen_inputs"], batch["rejected_inputs"]])
    if after is not None:
        inputs = mx.depends(inputs, after)
    targets = mx.concatenate([batch["chosen_targets"], batch["rejected_targets"]])
    return inputs, targets, mx.concatenate([batch["chosen_mask"], batch["rejected_mask"]]).astype(mx.float32)


def sequence_logps(model: nn.Module, batch: dict[str, Any], after: mx.array | None = None,
                   grad: bool = True, chunk: int | None = None) -> tuple[mx.array, mx.array]:
    """Summed reply log-probabilities and reply token counts, chosen rows then rejected rows
    (``[2 * pairs]`` each), from one forward pass over both; the pass starts once ``after`` (if
    given) is computed, so that the arrays behind ``after`` are freed before this pass builds its own.
    The output projection runs in chunks, never holding the full logits
    (:func:`mlx_train.llm.loss.target_logprobs`); ``grad=False`` (a reference pass) skips the
    gradient work a chunk otherwise does in its forward pass; ``chunk``: tokens per chunk (None: the
    default; 0: the full logits).

    Example: ``logps, tokens = sequence_logps(model, batch); chosen = logps[:len(logps) // 2]``.
    """
    from mlx_train.llm.loss import target_logprobs, target_weights

    inputs, targets, mask = both_sequences(batch, after)
    positions = None
    if "chosen_positions" in batch:
        positions = mx.concatenate([batch["chosen_positions"], batch["rejected_positions"]])
    logps, positions = target_logprobs(model, {"inputs": inputs, "targets": targets, "positions": positions},
                                       chunk, grad=grad, precompute=model.training)
    weights = target_weights(mask, positions)
    return (logps * weights).sum(axis=-1), mask.sum(axis=-1)


def _base_layer(module: nn.Module) -> nn.Module | None:
    from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
    from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear

    if isinstance(module, (LoRALinear, DoRALinear, LoRASwitchLinear)):
        return module.linear
    if isinstance(module, (LoRAEmbedding, DoRAEmbedding)):
        return module.embedding
    return None


def _put(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    node: Any = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = module
    else:
        node[last] = module


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base: every LoRA/DoRA layer is replaced by the layer it wraps, and put
    back on exit. Nothing is copied. Inside a compiled function the swap is traced like any code.

    Example: ``with adapters_off(model): base_logits = model(tokens)``.
    """
    swaps = [(path, m, base) for path, m in model.named_modules() if (base := _base_layer(m)) is not None]
    if not swaps:
        raise ConfigError("the DPO reference is the model with its adapters off, but this model has no LoRA/DoRA "
                          "layers; for full fine-tuning store reference log-probabilities with the data "
                          "(finetune does it) or pass reference_model_path")
    for path, _, base in swaps:
        _put(model, path, base)
    try:
        yield model
    finally:
        for path, adapter, _ in swaps:
            _put(model, path, adapter)


def _log1mexp(x: mx.array) -> mx.array:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    x = mx.minimum(x, -1e-7)
    return mx.where(x > -math.log(2.0), mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


class PreferenceLoss:
    """``loss(model, batch) -> (mean loss over pairs, pairs, metrics)`` for the Trainer.

    DPO, with ``h = (pi_c - pi_r) - (ref_c - ref_r)`` (summed reply log-probabilities; IPO uses
    their per-token means, as TRL and mlx-lm-lora do): sigmoid ``-(1-e) log s(beta h) - e log s(-beta h)``
    (``e`` = label_smoothing), hinge ``max(0, 1 - beta h)``, ipo ``(h - 1/(2 beta))^2``. Rewards are
    ``beta (pi - ref)``. ORPO, with per-token mean log-probabilities ``p``:
    ``-p_c - beta log s(log(p_c / (1 - p_c)) - log(p_r / (1 - p_r)))`` in log space; rewards ``beta p``.
    CPO: the DPO loss with reference log-probabilities 0.
    Metrics (means over pairs): rewards chosen/rejected, reward accuracy (chosen above rejected),
    reward margin, summed reply log-probabilities of chosen and rejected.

    Example: ``loss, pairs, metrics = PreferenceLoss(PreferenceConfig("orpo"))(model, batch)``.
    """

    metric_names = METRICS

    def __init__(self, config: PreferenceConfig, chunk: int | None = None) -> None:
        self.config, self.chunk = config, chunk  # chunk: tokens per chunk of the output projection
        self.__name__ = f"{config.method}_loss"

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
        cfg = self.config
        pairs = batch["chosen_inputs"].shape[0]
        # the reference pass first: its activations are gone before the policy's (kept for the
        # backward pass) are built, so a step holds one forward pass's worth, not two
        ref = self._reference(model, batch)
        logps, tokens = self.sequence_logps(model, batch, after=ref)
        if cfg.method == "orpo":
            return self._orpo(logps, tokens, pairs)
        if ref is None:
            ref = mx.zeros_like(logps)
        policy, reference = logps, ref
        if cfg.loss_type == "ipo":
            policy, reference = logps / mx.maximum(tokens, 1.0), ref / mx.maximum(tokens, 1.0)
        h = (policy[:pairs] - policy[pairs:]) - (reference[:pairs] - reference[pairs:])
        if cfg.loss_type == "sigmoid":
            e = cfg.label_smoothing
            losses = -(1 - e) * nn.log_sigmoid(cfg.beta * h) - e * nn.log_sigmoid(-cfg.beta * h)
        elif cfg.loss_type == "hinge":
            losses = nn.relu(1 - cfg.beta * h)
        else:
            losses = (h - 1 / (2 * cfg.beta)) ** 2
        rewards = mx.stop_gradient(cfg.beta * (policy - reference))
        return losses.mean(), mx.array(pairs, mx.float32), _metrics(rewards, logps, pairs)

    def _reference(self, model: nn.Module, batch: dict[str, Any]) -> mx.array | None:
        if not self.config.needs_reference:
            return None
        if "reference_chosen" in batch:
            return mx.concatenate([batch["reference_chosen"], batch["reference_rejected"]]).astype(mx.float32)
        with adapters_off(model):
            ref, _ = self.sequence_logps(model, batch, grad=False)
        return mx.stop_gradient(ref)

    def sequence_logps(self, model: nn.Module, batch: dict[str, Any], after: mx.array | None = None,
                       grad: bool = True) -> tuple[mx.array, mx.array]:
        """The pairs' summed reply log-probabilities and reply token counts (:func:`sequence_logps`); the
        vision-language loss (``mlx_train.llm.vision.loss.VisionPreferenceLoss``) shows the model the pictures."""
        return sequence_logps(model, batch, after=after, grad=grad, chunk=self.chunk)

    def _orpo(self, logps: mx.array, tokens: mx.array, pairs: int) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
        beta = self.config.beta
        mean = logps / mx.maximum(tokens, 1.0)
        chosen, rejected = mean[:pairs], mean[pairs:]
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        losses = -chosen - beta * nn.log_sigmoid(log_odds)
        return losses.mean(), mx.array(pairs, mx.float32), _metrics(mx.stop_gradient(beta * mean), logps, pairs)


def _metrics(rewards: mx.array, logps: mx.array, pairs: int) -> dict[str, mx.array]:
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    logps = mx.stop_gradient(logps)
    return {"rewards_chosen": chosen.mean(), "rewards_rejected": rejected.mean(),
            "reward_accuracy": (chosen > rejected).astype(mx.float32).mean(),
            "reward_margin": (chosen - rejected).mean(),
            "logps_chosen": logps[:pairs].mean(), "logps_rejected": logps[pairs:].mean()}


def reference_logps(model: nn.Module, pairs: PairDataset, batch_size: int = 8) -> np.ndarray:
    """``float32 [pairs, 2]``: summed reply log-probabilities of each pair's chosen and rejected
    sequence under ``model`` as it is now (computed once, before training, for a frozen reference).

    Example: ``train = train.with_reference(reference_logps(base_model, train))``.
    """
    from mlx_train.llm.data import collate

    out = np.zeros((len(pairs), 2), dtype=np.float32)
    model.eval()
    try:
        for start in range(0, len(pairs), batch_size):
            rows = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
            batch = {k: mx.array(v) for k, v in collate(rows).items()}
            logps, _ = sequence_logps(model, batch, grad=False)
            n = len(rows)
            out[start:start + n] = np.array(mx.stack([logps[:n], logps[n:]], axis=1))
    finally:
        model.train()
    return out


# -- fine-tuning ---------------------------------------------------------------------------


def check_distinct_replies(pairs: PairDataset, where: Sequence[str], split: str = "train") -> None:
    """Say where a pair's chosen reply is its rejected one (the same tokens): the preference term has nothing to
    compare (DPO's sigmoid loss stays at log 2 = 0.6931 on it). All of the training pairs: refused (DataError);
    some: a warning with their count and the first one's file and line.

    Example: ``check_distinct_replies(PairDataset.from_records(rows, tok, None, where), where)``.
    """
    import warnings

    same = [i for i in range(len(pairs.chosen)) if np.array_equal(pairs.chosen[i], pairs.rejected[i])]
    if not same:
        return
    total = len(pairs.chosen)
    if len(same) == total and split == "train":
        raise DataError(f"{where[same[0]]}: in all {total} training pairs the chosen reply is the rejected one, so "
                        "there is no preference to learn (DPO's loss would stay at log 2 = 0.6931); give each row a "
                        "chosen reply that differs from its rejected one")
    warnings.warn(f"{where[same[0]]}: {len(same)} of the {total} {split} pairs have a chosen reply equal to the "
                  "rejected one (this is the first); they add only a constant to the preference loss and count as a "
                  "miss in the reward accuracy (chosen > rejected): fix or drop them", stacklevel=2)


def build_splits(cfg: Any, model: nn.Module, tokenizer: Any, log: Any = print) -> dict[str, PairDataset]:
    """The preference pairs of each split of ``cfg.data``, with stored reference log-probabilities
    for full fine-tuning, a ``reference_model_path`` or ``precompute_ref_log_probs``.

    Example: ``splits = build_splits(FineTuneConfig(model=..., data="prefs/", train_mode="dpo"), model, tok)``.
    """
    from mlx_train.llm.models import load_model

    options = PreferenceConfig.from_finetune(cfg)  # (--pack is refused by the task, llm.tasks.Preference)
    splits: dict[str, PairDataset] = {}
    for name, (records, where) in load_pairs(cfg.data).items():
        if records:
            splits[name] = PairDataset.from_records(records, tokenizer, cfg.max_seq_length, where)
            log(f"{name}: {len(records)} preference pairs, {splits[name].trained_tokens} reply tokens")
            check_distinct_replies(splits[name], where, name)
    if "train" not in splits:
        raise ConfigError(f"{cfg.data} has no training pairs (train.jsonl is missing or empty)")
    stored = cfg.fine_tune_type == "full" or cfg.reference_model_path or cfg.precompute_ref_log_probs
    if not options.needs_reference:
        return splits
    if not stored:
        log("reference policy: the model with its adapters off, inside each step (no second copy of the weights)")
        return splits
    context: AbstractContextManager[Any] = nullcontext()
    reference, source = model, "the base model"
    if cfg.reference_model_path:
        reference, _, _ = load_model(cfg.reference_model_path)
        source = cfg.reference_model_path
    elif cfg.fine_tune_type != "full":
        source, context = "the model with its adapters off", adapters_off(model)
    log(f"computing reference log-probabilities with {source} (once, before training)")
    with context:
        splits = {name: pairs.with_reference(reference_logps(reference, pairs, cfg.batch_size))
                  for name, pairs in splits.items()}
    return splits

