"""``FinetuneConfig``: the config of ``mlx-train finetune`` and ``finetune()``: the Trainer's ``TrainConfig``
with the llm section (adapters, data rows, the task and its loss), on mlx_lm.lora's defaults.

A fine-tuning setting is declared here once, like the Trainer's (``option``); given to the Trainer's
config it is an error that says to pass it here (``TrainConfig(train_mode="dpo")``).

Example::

    config = FinetuneConfig(model="base", dataset="data", train_mode="dpo", beta=0.5)
    config.batch_size, config.optimizer            # 4, "adam": mlx_lm.lora's defaults
    FinetuneConfig.from_yaml("lora_config.yaml")   # an mlx_lm.lora file, or train's layout with llm:
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from mlx_train.config.launch import LaunchConfig
from mlx_train.config.options import Invalid, option
from mlx_train.config.sections import extends
from mlx_train.errors import did_you_mean

in_llm = partial(option, section="llm")

#: The fine-tuning methods, training modes (each one a task of ``mlx_train.llm.tasks``) and DPO/CPO losses.
FINE_TUNE_TYPES = ("lora", "dora", "full")
TRAIN_MODES = ("sft", "dpo", "orpo", "cpo", "grpo")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
#: GRPO's normalisations of the summed token losses, ratio levels (sequence: GSPO) and advantage scalings.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
PACKINGS = ("best_fit", "by_length")

#: Logits per chunk of the loss's output projection (``mlx_train.llm.loss``): a chunk is this many over the
#: vocabulary size tokens (a multiple of 32 from 64 on), at least MIN_CHUNK_TOKENS; 4M float32 logits are
#: 16 MB (64 tokens of a 49152-token vocabulary). 0 computes the full logits (the plain loss). Measured on
#: SmolLM2-135M LoRA at batch 4: 160-token chunks peaked at 0.66x mlx-lm's memory, 64-token chunks at 0.55x,
#: for ~2% of the step (docs/benchmarks.md, Fine-tuning).
CHUNK_LOGITS = 1 << 22
#: Smaller chunks save little more memory and cost time (many small matrix products).
MIN_CHUNK_TOKENS = 32
#: The vocabulary the help of loss_chunk counts its tokens in (SmolLM2's).
EXAMPLE_VOCABULARY = 49152


def chunk_tokens(vocabulary: int, logits: int = CHUNK_LOGITS, minimum: int = MIN_CHUNK_TOKENS) -> int:
    """Tokens per chunk of the output projection for this vocabulary size (see ``CHUNK_LOGITS``).

    Example: ``chunk_tokens(49152)`` -> ``64``.
    """
    rows = logits // vocabulary
    return max(minimum, rows - rows % 32 if rows >= 64 else rows)


def _all_batches(value: Any) -> Any:
    """mlx_lm.lora's ``-1`` batches means all of them: null here."""
    return None if value == -1 and not isinstance(value, bool) else value


def _packing(value: Any) -> Any:
    """``pack``: true/false, or a packing by name (``best_fit``, ``by_length``; ``--pack`` alone is best_fit)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, str) and value.strip().lower() in PACKINGS:
        return value.strip().lower()
    raise Invalid(f"must be true, false or one of {', '.join(PACKINGS)}, got {value!r}"
                  f"{did_you_mean(str(value), PACKINGS)}")


def _one_mask(value: bool, values: Mapping[str, Any]) -> str | None:
    if value and values["mask_prompt"]:
        return ("and mask_prompt exclude each other: assistant_only_loss trains every assistant turn, mask_prompt "
                "only the last message (mlx_lm.lora's meaning); choose one")
    return None


def _needs_assistant_only(value: bool, values: Mapping[str, Any]) -> str | None:
    if not value and not values["assistant_only_loss"]:
        return "false applies with assistant_only_loss only (the other modes train whole messages); set that too"
    return None


#: lora_parameters' keys (mlx_lm.lora's) -> (what the value must be, its converter from a number).
_LORA_KEYS: dict[str, tuple[str, Any]] = {"rank": ("a whole number of at least 1", int),
                                          "scale": ("a number", float),
                                          "dropout": ("a number in [0, 1)", float)}


def _lora_parameters(value: Any) -> Any:
    """``lora_parameters``: a mapping of rank, scale, dropout (numbers; YAML may give ``1e-2`` as a string)
    and keys (the module names to adapt, or null); raises ``Invalid`` naming the key and what it must be."""
    from mlx_train.config.options import number

    if not isinstance(value, Mapping):
        raise Invalid(f"must be a mapping {{rank, scale, dropout, keys}}, e.g. {{rank: 8, scale: 20.0}}, got "
                      f"{value!r} ({type(value).__name__})")
    out = dict(value)
    if "alpha" in out and "scale" not in out:
        raise Invalid("has 'alpha' but mlx-lm's LoRA uses 'scale' (the multiplier of the low-rank update); "
                      "rename it to scale")
    unknown = sorted(str(k) for k in out if k not in (*_LORA_KEYS, "keys"))
    if unknown:
        raise Invalid(f"has unknown key {unknown[0]!r}{did_you_mean(unknown[0], (*_LORA_KEYS, 'keys'))}; its keys "
                      "are rank, scale, dropout and keys")
    for key, (expected, kind) in _LORA_KEYS.items():
        if key not in out:
            continue
        given = number(out[key])
        good = given is not None and (kind is float or (given == int(given) and given >= 1))
        if good and key == "dropout":
            good = 0 <= given < 1  # type: ignore[operator]
        if not good:
            raise Invalid(f"has {key} {out[key]!r} ({type(out[key]).__name__}), which must be {expected}; e.g. "
                          f"lora_parameters.{key}={ {'rank': 8, 'scale': 20.0, 'dropout': 0.05}[key] }")
        out[key] = kind(given)
    keys = out.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise Invalid(f"has keys {keys!r}, which must be a list of module names (e.g. [self_attn.q_proj, "
                      "self_attn.v_proj]) or null")
    return out


def _layers(value: int, values: Mapping[str, Any]) -> str | None:
    if value == -1 or value >= 1:
        return None
    return f"must be -1 (all blocks, as in mlx_lm.lora) or at least 1, got {value}"


def _smoothing(value: float, values: Mapping[str, Any]) -> str | None:
    if value and (values["train_mode"] == "orpo" or values["dpo_loss_type"] != "sigmoid"):
        return "applies to the DPO sigmoid loss only; set it to 0 or use dpo_loss_type: sigmoid"
    return None


def _preference_beta(value: float, values: Mapping[str, Any]) -> str | None:
    if value == 0 and values["train_mode"] in ("dpo", "orpo", "cpo"):
        return f"must be above 0 for --train-mode {values['train_mode']} (0 applies to grpo: no KL penalty)"
    return None


def _names(value: Any) -> Any:
    """``reward_functions``: a list of names, or one comma-separated string of them."""
    if isinstance(value, str):
        value = [name.strip() for name in value.split(",")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise Invalid(f"must be names of reward functions, comma-separated or a list (e.g. answer_match,"
                      f"think_answer_format), got {value!r}")
    return [v.strip() for v in value]


def _weights(value: Any) -> Any:
    """``reward_weights``: a list of numbers, or one comma-separated string of them."""
    from mlx_train.config.options import number

    items = value.split(",") if isinstance(value, str) else value
    numbers = [number(v) for v in items] if isinstance(items, (list, tuple)) else [None]
    if not numbers or any(n is None for n in numbers):
        raise Invalid(f"must be numbers, comma-separated or a list, one per reward function (e.g. 1.0,0.5), "
                      f"got {value!r}")
    return numbers


def _scale_rewards(value: Any) -> Any:
    """``scale_rewards``: group, batch or none; TRL's former true/false mean group/none."""
    if isinstance(value, bool):
        return "group" if value else "none"
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return "group" if value.strip().lower() == "true" else "none"
    return value


def _probability(value: float, values: Mapping[str, Any]) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1] (1: no nucleus filter), got {value}"


@extends("fine-tuning", "mlx-train finetune")
@dataclass
class FinetuneConfig(LaunchConfig):
    """The config of a fine-tuning run: the Trainer's (``TrainConfig``, with the launcher's ``LaunchConfig``)
    plus the llm section, with
    ``mlx-train finetune``'s defaults (mlx_lm.lora's: adam at 1e-5, batch_size 4, 1000 iterations, ...)
    for what is not given. The Trainer of a fine-tuning run records it whole (checkpoints, config.yaml);
    what it trains is the task ``train_mode`` names (``mlx_train.llm.tasks``).

    Example::

        FinetuneConfig(model="base", dataset="data").learning_rate     # 1e-05
        FinetuneConfig(model="base", dataset="data").replace(train_mode="orpo", beta=0.2)
    """

    finetune_defaults: ClassVar[bool] = True

    # ----- llm: fine-tuning a language model (mlx_lm.lora's and mlx-lm-lora's names) -----
    fine_tune_type: str = in_llm("lora", "How the base is tuned: lora, dora (adapters) or full (the blocks' weights) "
                                         "(mlx-lm-lora's train_type).",
                                 choices=FINE_TUNE_TYPES, aliases={"train_type": None})
    num_layers: int = in_llm(16, "Blocks to fine-tune, counted from the last (-1: all; 0 is refused). Under "
                                 "model: a built-in model's option of that name instead.",
                             check=_layers, shared_name=True)
    lora_parameters: dict = in_llm({"rank": 8, "scale": 20.0, "dropout": 0.0},  # type: ignore[type-arg]
                                   "LoRA/DoRA rank, scale, dropout and keys (mlx_lm.lora's lora_parameters).",
                                   parse=_lora_parameters)
    max_seq_length: int = in_llm(2048, "Longest sequence in tokens; longer documents are cut (and counted).",
                                 minimum=1)
    mask_prompt: bool = in_llm(False, "Train on completions only (prompt/completion and chat records): as "
                                      "mlx_lm.lora, only the last message of a conversation.")
    assistant_only_loss: bool = in_llm(False, "Train every assistant turn of chat and prompt/completion records, and "
                                              "nothing else (TRL's assistant_only_loss): from the template's "
                                              "{% generation %} markers, else by rendering turn by turn.",
                                       check=_one_mask)
    train_on_tool_calls: bool = in_llm(True, "With assistant_only_loss: train assistant messages that carry "
                                             "tool_calls (false: leave those messages out of the loss).",
                                       check=_needs_assistant_only)
    train_on_reasoning: bool = in_llm(True, "With assistant_only_loss: train the reasoning (reasoning_content, "
                                            "<think> blocks) of assistant turns (false: only the rest of the reply).",
                                      check=_needs_assistant_only)
    pack: bool | str = in_llm(False, "Pack the training rows: true or best_fit (several documents per row up to "
                                     "max_seq_length, no loss or attention across them), by_length (one document a "
                                     "row, batches of similar lengths), false.", parse=_packing)
    loss_chunk: int | None = in_llm(None, "Tokens per chunk of the loss's output projection: the loss never holds "
                                          "more logits than this many tokens x vocabulary (null: "
                                          f"{CHUNK_LOGITS >> 20}M logits a chunk, {chunk_tokens(EXAMPLE_VOCABULARY)} "
                                          f"tokens of a {EXAMPLE_VOCABULARY:,}-token vocabulary; 0: the full logits, "
                                          "as mlx_lm.lora).", minimum=0)
    adapter_path: str = in_llm("adapters", "Where the adapters are written (mlx-lm format); relative to run_dir.")
    resume_adapter_file: str | None = in_llm(None, "Adapters (directory or adapters.safetensors) to start from.")
    quantized: bool | None = in_llm(None, "Keep a quantized base quantized (QLoRA); null: keep it on a GPU, "
                                          "dequantize to float32 on a CPU (quantized matmuls are slow there).")
    train_vision: bool = in_llm(False, "Vision-language models: also train the vision tower and its projector (all "
                                       "their weights, saved with the adapters; mlx-vlm's --train-vision).")
    test: bool = in_llm(False, "Evaluate on the test split (test.jsonl) after training.")
    test_batches: int | None = in_llm(500, "Test batches (null or -1: the whole test set).", minimum=1,
                                      parse=_all_batches)
    train_mode: str = in_llm("sft", "sft (next-token loss), dpo, orpo or cpo (preference rows: prompt, chosen, "
                                    "rejected), grpo (RL on prompt/answer rows with reward functions).",
                             choices=TRAIN_MODES)
    beta: float = in_llm(0.1, "DPO: temperature of the implicit reward; ORPO: weight of the odds-ratio term; GRPO: "
                              "weight of the KL penalty against the model with its adapters off (0: none, and no "
                              "reference pass; TRL's default).", minimum=0, check=_preference_beta)
    dpo_loss_type: str = in_llm("sigmoid", "DPO/CPO loss: sigmoid, hinge or ipo (YAML alias: dpo_cpo_loss_type).",
                                choices=DPO_LOSS_TYPES, aliases={"dpo_cpo_loss_type": None})
    label_smoothing: float = in_llm(0.0, "DPO sigmoid: share of preference labels assumed wrong (conservative "
                                         "DPO).", minimum=0, below=0.5, check=_smoothing)
    reference_free: bool = in_llm(False, "DPO against a uniform reference (reference log-probabilities 0).")
    reference_model_path: str | None = in_llm(None, "DPO reference model (null: the base model; with LoRA/DoRA "
                                                    "the adapters are switched off, with full fine-tuning its "
                                                    "log-probabilities are computed once before training).")
    precompute_ref_log_probs: bool = in_llm(False, "DPO with LoRA/DoRA: compute the reference log-probabilities "
                                                   "once before training (adapters off) instead of in every step.")
    # ----- GRPO (mlx-lm-lora's names and defaults; TRL's as aliases) -----
    group_size: int = in_llm(4, "GRPO: completions sampled per prompt, whose rewards are compared (TRL: "
                                "num_generations).", minimum=2, aliases={"num_generations": None},
                             hint="a group of one has no other completion to compare with")
    max_completion_length: int = in_llm(512, "GRPO: most tokens sampled per completion (its end-of-sequence token "
                                             "included).", minimum=1)
    temperature: float = in_llm(0.8, "GRPO: sampling temperature of the completions (0: greedy, the same "
                                     "completion for a whole group).", minimum=0)
    top_p: float = in_llm(0.95, "GRPO: sample from the smallest set of tokens with this much probability (1: all).",
                          check=_probability)
    top_k: int = in_llm(20, "GRPO: sample from the k most probable tokens (0: all).", minimum=0)
    clip_epsilon: float = in_llm(1e-4, "GRPO: the ratio to the sampling policy is clipped to [1 - clip_epsilon, 1 "
                                       "+ epsilon_high] (mlx-lm-lora's and TRL's epsilon: flag --epsilon too, and "
                                       "a fine-tuning file's top-level key epsilon with train_mode: grpo; TRL's "
                                       "default: 0.2).", minimum=0)
    epsilon_high: float | None = in_llm(None, "GRPO: upper clipping width (DAPO's clip-higher; null: clip_epsilon).",
                                        minimum=0)
    grpo_loss_type: str = in_llm("grpo", "GRPO: how token losses are averaged: grpo (over each completion, then "
                                         "over completions), bnpo (over all tokens), dr_grpo (sum over completions x "
                                         "max_completion_length).", choices=GRPO_LOSS_TYPES)
    importance_sampling_level: str = in_llm("token", "GRPO: one ratio per token, or per sequence (the exp of the "
                                                     "mean log-ratio of a completion: GSPO).",
                                            choices=IMPORTANCE_SAMPLING_LEVELS)
    scale_rewards: str = in_llm("group", "GRPO: advantages are (reward - group mean) divided by the group's "
                                         "standard deviation (group), the batch's (batch), or not (none; Dr. GRPO) "
                                         "(TRL's scale_rewards; true/false mean group/none).",
                                choices=SCALE_REWARDS, parse=_scale_rewards)
    reward_functions: list | None = in_llm(None, "GRPO: reward functions: built-in names, functions of "  # type: ignore[type-arg]
                                                 "reward_functions_file, or module:function; comma-separated "
                                                 "(null: the file's registered ones, else mlx-lm-lora's default set).",
                                           parse=_names)
    reward_functions_file: str | None = in_llm(None, "GRPO: a Python file defining reward functions.")
    reward_weights: list | None = in_llm(None, "GRPO: weight of each reward function in the total, comma-separated "  # type: ignore[type-arg]
                                               "(null: 1 each).", parse=_weights)
    num_iterations: int = in_llm(1, "GRPO: optimizer steps on each batch of rollouts, its log-probabilities under "
                                    "the sampling weights kept (TRL's name).", minimum=1)


    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Fine-tuning's defaults: mlx_lm.lora's where it has one (adam at 1e-5, batch_size 4, 1000 iterations as
        optimizer steps, ...), else the declared ones (what ``--help`` shows).

        Example: ``FinetuneConfig.defaults()["batch_size"]`` -> ``4``.
        """
        return cls().to_dict()
