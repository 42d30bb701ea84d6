"""Fine-tuning tasks: what a fine-tuning run trains, picked once from ``train_mode``.

A task owns what differs between kinds of fine-tuning: the rows it builds from the data, its loss,
what it counts (trained tokens, preference pairs), its report and summary lines, the facts it adds
to the adapters' files and model card, and the checks of settings that do not apply to it.
``finetune()`` and ``mlx-train finetune`` ask the task and test no mode themselves.

Adding a task is one class here and one line in ``TASKS`` (its name is also a choice of
``train_mode`` in ``mlx_train.config.finetune.TRAIN_MODES``; a test holds the two equal).

Example::

    task = task_for(FinetuneConfig(model="base", dataset="prefs", train_mode="dpo"))
    task.unit                     # "preference pairs"
    loss = task.loss()            # a PreferenceLoss
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from mlx_train.config import FinetuneConfig
from mlx_train.errors import ConfigError
from mlx_train.training.callbacks import Callback


class Counter(Callback):
    """Counts what a task trains on (the items the loss averaged over, which the Trainer checkpoints with the
    run) and prints its report lines; ``unit`` names the items."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self.trained = 0.0
        self.per_second: list[float] = []

    @property
    def trained_tokens(self) -> float:
        """The count, by the name a language-model run gives it (what a former version called it)."""
        return self.trained

    def on_report(self, trainer: Any, logs: dict[str, Any]) -> None:
        self.trained = trainer.state.trained_items
        if "tokens_per_second" in logs:  # the Trainer's rate of the items the loss counts
            self.per_second.append(logs["tokens_per_second"])

    def on_validation_end(self, trainer: Any, logs: dict[str, Any]) -> None:
        trainer.log(f"step {logs['step']}: val loss {logs['val_loss']:.4f}, "
                    f"val perplexity {math.exp(min(logs['val_loss'], 50)):.3f}")

    def on_fit_end(self, trainer: Any, history: dict[str, Any]) -> None:
        self.trained = trainer.state.trained_items
        # The final report line, also in train.log: a run shorter than steps_per_report has no other.
        trainer.log(f"finished at step {trainer.step}: {int(self.trained):,} {self.unit}")

    def rate(self) -> float | None:
        """The mean of the reported rates (items per second), None before a report."""
        return sum(self.per_second) / len(self.per_second) if self.per_second else None


class TokenCounter(Counter):
    """Counts trained tokens (targets in the loss) and prints a report line with them."""

    def __init__(self) -> None:
        super().__init__("trained tokens")


class PairCounter(Counter):
    """Counts preference pairs; the validation line shows reward accuracy and margin."""

    def __init__(self) -> None:
        super().__init__("preference pairs")

    def on_validation_end(self, trainer: Any, logs: dict[str, Any]) -> None:
        trainer.log(f"step {logs['step']}: val loss {logs['val_loss']:.4f}, val reward accuracy "
                    f"{logs['val_reward_accuracy']:.3f}, val reward margin {logs['val_reward_margin']:.4f}")


class CompletionCounter(Counter):
    """Counts GRPO's sampled completions (their tokens with ``grpo_loss_type: bnpo``); the validation line
    shows the mean reward of the sampled completions; reports carry where the steps' time went (the loss's
    ``phases``: ``time_generation``, ``time_rewards``, ``time_update``)."""

    def __init__(self, unit: str, phases: Any = None) -> None:
        super().__init__(unit)
        self.phases = phases

    def report_metrics(self) -> dict[str, float]:
        return {} if self.phases is None else self.phases.read()

    def on_validation_end(self, trainer: Any, logs: dict[str, Any]) -> None:
        trainer.log(f"step {logs['step']}: val loss {logs['val_loss']:.4f}, val reward {logs['val_reward_mean']:.4f} "
                    f"(std {logs['val_reward_std']:.4f}), completion length {logs['val_completion_length']:.1f}")


class Task:
    """What a kind of fine-tuning trains (the base: every method has a default or says what it needs).

    ``name`` is its ``train_mode``; ``unit`` what its runs count. A subclass builds its rows
    (``datasets``) and its loss (``loss``); the rest have defaults for a language-model loss.
    """

    name = ""
    unit = "trained tokens"
    #: The library that loads the base with the adapters (the model card's usage): mlx-lm or mlx-vlm.
    library = "mlx-lm"
    #: Settings that mean nothing for this task: a value other than the default is refused (``check``).
    inapplicable: tuple[str, ...] = ()

    def __init__(self, config: FinetuneConfig) -> None:
        self.config = config
        self.check()

    def check(self) -> None:
        """Refuse settings that do not apply to this task (before the model loads)."""
        defaults = FinetuneConfig.defaults()
        for name in self.inapplicable:
            if getattr(self.config, name) != defaults[name]:
                flag = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag} {getattr(self.config, name)!r} does not apply to --train-mode {self.name} "
                                  f"(it is a setting of {self.applies_to(name)}); leave it out, or choose that "
                                  "--train-mode")

    def applies_to(self, name: str) -> str:
        """The tasks a setting of ``inapplicable`` belongs to, for the message of ``check``."""
        return "another task"

    def settings(self, config: FinetuneConfig, log: Callable[[str], None]) -> FinetuneConfig:
        """``config`` as this task trains (the vision task turns compilation off): the Trainer gets it."""
        return config

    def check_records(self, records: dict[str, Any]) -> None:
        """Refuse rows this task cannot train on, before the model loads: rows with images (text-only tasks)."""
        from mlx_train.llm.vision.data import refuse_image_rows

        refuse_image_rows(records, self.config.model or "the model")

    def load_model(self, quantized: bool, lazy: bool, log: Callable[[str], None]) -> tuple[Any, Any, dict[str, Any]]:
        """``(model, tokenizer, config)`` of the run's base model."""
        from mlx_train.llm import models

        assert self.config.model  # (checked before)
        return models.load_model(self.config.model, quantized=quantized, lazy=lazy)

    def adapter_spec(self, model: Any, spec: Any) -> Any:
        """The adapters' description as their files say it, once they are on ``model``."""
        return spec

    def datasets(self, model: Any, tokenizer: Any, records: dict[str, Any],
                 log: Callable[[str], None]) -> dict[str, Any]:
        """The training rows of each split (train, valid, test) of the run's data."""
        raise NotImplementedError

    def loss(self) -> Any:
        """The loss the Trainer takes (``loss_fn(model, batch) -> (loss, items)``)."""
        raise NotImplementedError

    def parameters_line(self, method: str, trainable: int, total: int) -> str:
        """The log line that says what trains."""
        return f"{method}: training {trainable:,} of {total:,} parameters ({100 * trainable / total:.3f}%)"

    def gathers_positions(self) -> bool:
        """Whether batches carry the positions of the trained tokens (the loss projects only those)."""
        return False

    def counter(self) -> Counter:
        """The callback that counts what the run trains on and prints its report lines."""
        return TokenCounter()

    def callbacks(self) -> list[Callback]:
        """The task's own callbacks, beside the counter (made after ``loss``)."""
        return []

    def batch_repeats(self) -> int:
        """How many optimizer steps in a row each loader batch is trained on (1: one)."""
        return 1

    def adapter_facts(self) -> dict[str, Any]:
        """What the task adds to the adapters' ``adapter_config.json``."""
        return {}

    def adapter_weights(self, model: Any) -> dict[str, Any] | None:
        """The arrays the adapters' ``adapters.safetensors`` holds; None: the trainable parameters (mlx-lm's)."""
        return None

    def card_hyperparameters(self) -> dict[str, Any]:
        """The task's own hyper-parameters on the model card."""
        return {}

    def evaluate(self, trainer: Any, result: dict[str, Any], test_rows: Any, eval_rows: int) -> None:
        """Add the task's final metrics to ``result`` (its val_metrics already there): perplexity, and with
        ``test_rows`` the test split's."""
        if "val_loss" in result:
            result["val_perplexity"] = math.exp(min(result["val_loss"], 50))
        if test_rows is not None:
            result["test_loss"] = trainer.evaluate(test_rows.samples())["loss"]
            result["test_perplexity"] = math.exp(min(result["test_loss"], 50))

    def headline(self, label: str, result: dict[str, Any]) -> str:
        """The summary's first line: steps, what was trained (in ``unit``) and how fast."""
        line = f"{label}: {result['trainer'].step} steps, {result['trained']:,} {self.unit}"
        return line + (f", {result['per_second']:.1f} {self.unit}/s" if result.get("per_second") else "")

    def summary(self, result: dict[str, Any]) -> list[str]:
        """The lines ``mlx-train finetune`` prints about a finished run (after them: where the adapters are)."""
        lines = [self.headline("finetune", result)]
        if "val_perplexity" in result:
            lines.append(f"  validation: loss {result['val_loss']:.4f}, perplexity {result['val_perplexity']:.3f}")
        if "test_perplexity" in result:
            lines.append(f"  test: loss {result['test_loss']:.4f}, perplexity {result['test_perplexity']:.3f}")
        return lines

    def check_tensor_parallel(self) -> None:
        """Refuse what this task cannot do on a model split over the ranks."""

    def result_counts(self, counter: Counter) -> dict[str, Any]:
        """``finetune()``'s result entries of the count: ``trained`` and ``per_second`` (items of ``unit``)."""
        return {"trained": int(counter.trained), "per_second": counter.rate()}


#: GRPO's own settings (``beta`` it shares with the preference tasks).
_GRPO_SETTINGS = ("group_size", "max_completion_length", "temperature", "top_p", "top_k", "clip_epsilon",
                  "epsilon_high", "grpo_loss_type", "importance_sampling_level", "scale_rewards", "reward_functions",
                  "reward_functions_file", "reward_weights", "num_iterations")
#: How SFT picks and packs its trained tokens: nothing of GRPO's, whose completions are sampled.
_SFT_SETTINGS = ("mask_prompt", "assistant_only_loss", "train_on_tool_calls", "train_on_reasoning", "pack")
def _test_metrics(trainer: Any, result: dict[str, Any], test_rows: Any, eval_rows: int) -> None:
    """The loss and the loss's metrics on the test split (``test_metrics``, ``test_loss``), when it is evaluated."""
    from mlx_train.llm import data

    if test_rows is not None:
        result["test_metrics"] = trainer.evaluate(data.make_loader(test_rows, eval_rows, shuffle=False, num_workers=0,
                                                                   drop_last=False))
        result["test_loss"] = result["test_metrics"]["loss"]


_PREFERENCE_SETTINGS = ("beta", "dpo_loss_type", "label_smoothing", "reference_free", "reference_model_path",
                        "precompute_ref_log_probs")
#: DPO's reference policy: ORPO and CPO have none.
_REFERENCE_SETTINGS = ("reference_free", "reference_model_path", "precompute_ref_log_probs")


class SFT(Task):
    """Supervised fine-tuning: the next-token loss on documents, chats or prompt/completion rows
    (optionally packed; on the last message only with ``mask_prompt``, on every assistant turn with
    ``assistant_only_loss``: ``mlx_train.llm.chat_masks``).

    Example: ``SFT(FinetuneConfig(model="base", dataset="data")).loss()`` is ``lm_loss``.
    """

    name = "sft"
    inapplicable = _PREFERENCE_SETTINGS + _GRPO_SETTINGS

    def applies_to(self, name: str) -> str:
        return "--train-mode grpo" if name in _GRPO_SETTINGS else "the preference tasks (dpo, orpo, cpo)"

    def datasets(self, model: Any, tokenizer: Any, records: dict[str, Any],
                 log: Callable[[str], None]) -> dict[str, Any]:
        from mlx_train.llm import data, loss
        from mlx_train.llm.chat_masks import Supervision

        cfg = self.config
        supervision = Supervision.from_finetune(cfg)
        document_mask = loss.supports_document_mask(model)
        if cfg.pack in (True, "best_fit") and not document_mask:
            log("packing: this model takes no attention mask, so a token may attend to earlier documents of its "
                "row (the loss still never crosses a document boundary)")
        splits: dict[str, Any] = {}
        for name in ("train", "valid", "test"):
            if not records[name]:
                continue
            docs = data.tokenize(records[name], tokenizer, supervision, cfg.max_seq_length,
                                 where=f"{cfg.dataset}/{name}.jsonl")
            rows = data.SequenceDataset(docs, cfg.max_seq_length, pack=cfg.pack if name == "train" else False,
                                        document_mask=document_mask)
            log(data.describe_documents(name, docs, rows))
            splits[name] = rows
        return splits

    def loss(self) -> Any:
        from mlx_train.llm import loss

        if self.config.loss_chunk is None:
            return loss.lm_loss
        return functools.update_wrapper(functools.partial(loss.lm_loss, chunk=self.config.loss_chunk), loss.lm_loss)

    def adapter_facts(self) -> dict[str, Any]:
        cfg = self.config
        if not cfg.assistant_only_loss:
            return {}
        return {"assistant_only_loss": True, "train_on_tool_calls": cfg.train_on_tool_calls,
                "train_on_reasoning": cfg.train_on_reasoning}

    def card_hyperparameters(self) -> dict[str, Any]:
        return self.adapter_facts()

    def gathers_positions(self) -> bool:
        # masked rows (prompt, non-assistant turns): the loss projects only the trained positions
        return bool(self.config.mask_prompt or self.config.assistant_only_loss)

    def result_counts(self, counter: Counter) -> dict[str, Any]:
        counts = super().result_counts(counter)
        return {**counts, "trained_tokens": counts["trained"], "tokens_per_second": counts["per_second"]}


class Preference(Task):
    """Preference tuning from pairs of replies: DPO (sigmoid, hinge or IPO loss), ORPO or CPO, as
    ``train_mode`` and ``dpo_loss_type`` say (``mlx_train.llm.preference``). It counts pairs.

    Example: ``Preference(FinetuneConfig(model="base", dataset="prefs", train_mode="orpo")).loss()``.
    """

    unit = "preference pairs"

    def __init__(self, config: FinetuneConfig) -> None:
        from mlx_train.llm.preference import PreferenceConfig

        self.name = config.train_mode
        self.options = PreferenceConfig.from_finetune(config)  # a wrong preference setting fails here
        super().__init__(config)

    def check(self) -> None:
        if self.config.pack:
            raise ConfigError(f"--pack does not apply to --train-mode {self.name}: each reply is scored as a whole "
                              "sequence beside its pair; drop --pack (or pack: true in the config)")
        super().check()

    @property
    def inapplicable(self) -> tuple[str, ...]:  # type: ignore[override]
        """ORPO and CPO compare with no reference policy: DPO's reference settings mean nothing there."""
        return _GRPO_SETTINGS + (() if self.name == "dpo" else _REFERENCE_SETTINGS)

    def applies_to(self, name: str) -> str:
        if name in _GRPO_SETTINGS:
            return "--train-mode grpo"
        return "--train-mode dpo, whose loss compares with a reference policy"

    def datasets(self, model: Any, tokenizer: Any, records: dict[str, Any],
                 log: Callable[[str], None]) -> dict[str, Any]:
        from mlx_train.llm import preference

        return dict(preference.build_splits(self.config, model, tokenizer, log))

    def loss(self) -> Any:
        from mlx_train.llm import preference

        return preference.PreferenceLoss(self.options, chunk=self.config.loss_chunk)

    def parameters_line(self, method: str, trainable: int, total: int) -> str:
        return f"{self.name} with {method}: training {trainable:,} of {total:,} parameters"

    def counter(self) -> Counter:
        return PairCounter()

    def adapter_facts(self) -> dict[str, Any]:
        cfg = self.config
        return {"train_mode": cfg.train_mode, "beta": cfg.beta, "dpo_loss_type": cfg.dpo_loss_type}

    def card_hyperparameters(self) -> dict[str, Any]:
        # ORPO has no DPO loss type
        return {k: getattr(self.config, k) for k in _PREFERENCE_SETTINGS if k != "dpo_loss_type" or self.name != "orpo"}

    def evaluate(self, trainer: Any, result: dict[str, Any], test_rows: Any, eval_rows: int) -> None:
        _test_metrics(trainer, result, test_rows, eval_rows)

    def summary(self, result: dict[str, Any]) -> list[str]:
        lines = [self.headline(f"finetune {self.name}", result)]
        if "val_metrics" in result:
            val = result["val_metrics"]
            lines.append(f"  validation: loss {val['loss']:.4f}, reward accuracy {val['reward_accuracy']:.3f}, "
                         f"reward margin {val['reward_margin']:.4f}, rewards chosen {val['rewards_chosen']:.4f} / "
                         f"rejected {val['rewards_rejected']:.4f}")
        return lines

    def check_tensor_parallel(self) -> None:
        cfg = self.config
        if self.options.needs_reference and not cfg.reference_model_path and cfg.fine_tune_type != "full":
            raise ConfigError(f"--train-mode dpo with {cfg.fine_tune_type} and --strategy tensor_parallel: the DPO "
                              "reference is the model with its adapters off, which a split model cannot do. Pass "
                              "--reference-model-path BASE (the reference then is that model, loaded whole on every "
                              "rank) or --reference-free, or use --strategy data_parallel")

    def result_counts(self, counter: Counter) -> dict[str, Any]:
        counts = super().result_counts(counter)
        return {**counts, "trained_pairs": counts["trained"]}


class GRPO(Task):
    """Reinforcement learning with verifiable rewards (GRPO, DAPO's clip-higher, Dr. GRPO, GSPO): completions
    sampled per prompt, scored by reward functions, compared within their group (``mlx_train.llm.grpo``).
    It counts completions (completion tokens with ``grpo_loss_type: bnpo``, whose loss averages over them).

    Example: ``GRPO(FinetuneConfig(model="base", dataset="gsm8k", train_mode="grpo", beta=0.0)).unit``
    -> ``"completions"``.
    """

    name = "grpo"
    inapplicable = tuple(k for k in _PREFERENCE_SETTINGS if k != "beta") + _SFT_SETTINGS

    def __init__(self, config: FinetuneConfig) -> None:
        super().__init__(config)
        self.unit = "completion tokens" if config.grpo_loss_type == "bnpo" else "completions"
        self._parts: dict[str, Any] = {}
        self._loss: Any = None

    def settings(self, config: FinetuneConfig, log: Callable[[str], None]) -> FinetuneConfig:
        """``gradient_checkpointing: auto`` recomputes whole blocks here (TRL's GRPOTrainer's default): the step
        scores a few short completions, whose blocks' activations are most of its memory above the weights,
        and recomputing them costs less than the prompts' positions the step no longer computes."""
        return config.replace(gradient_checkpointing=True) if config.gradient_checkpointing == "auto" else config

    def check(self) -> None:
        super().check()
        cfg = self.config
        if cfg.max_completion_length >= cfg.max_seq_length:
            raise ConfigError(f"--max-completion-length {cfg.max_completion_length} leaves no room for a prompt in "
                              f"--max-seq-length {cfg.max_seq_length} (prompt and completion together); raise "
                              "--max-seq-length or lower --max-completion-length")
        if cfg.fine_tune_type == "full" and cfg.beta > 0:
            raise ConfigError(f"--train-mode grpo with --fine-tune-type full and --beta {cfg.beta}: the KL penalty's "
                              "reference is the model with its adapters off, and full fine-tuning has none (a "
                              "frozen copy of the model is not kept). Use --fine-tune-type lora or dora, or --beta 0 "
                              "(no KL penalty, TRL's default)")

    def applies_to(self, name: str) -> str:
        return "--train-mode sft" if name in _SFT_SETTINGS else "the preference tasks (dpo, orpo, cpo)"

    def datasets(self, model: Any, tokenizer: Any, records: dict[str, Any],
                 log: Callable[[str], None]) -> dict[str, Any]:
        from mlx_train.llm import grpo
        from mlx_train.llm.rewards import RewardSet

        cfg = self.config
        rewards = RewardSet.load(cfg.reward_functions, file=cfg.reward_functions_file, weights=cfg.reward_weights)
        splits = grpo.build_splits(cfg, tokenizer, log)
        if "train" not in splits:
            raise ConfigError(f"{cfg.dataset} has no training prompts (train.jsonl is missing or empty)")
        train = splits["train"]
        few = range(min(4, len(train)))  # a broken reward function fails now, not after the first rollouts
        rewards.check([train.texts[i] for i in few], None, [train.answers[i] for i in few],
                      [train.types[i] for i in few])
        log(f"rewards: {rewards.describe()}")
        self._parts = {"rewards": rewards, "tokenizer": tokenizer, "rows": list(splits.values())}
        return splits

    def loss(self) -> Any:
        from mlx_train.llm import grpo

        if not self._parts:
            raise ConfigError("the GRPO loss samples from the run's prompts and scores with its reward functions: "
                              "build the datasets first (task.datasets(...), as finetune() does)")
        parts = self._parts
        self._loss = grpo.GRPOLoss(grpo.GRPOConfig.from_finetune(self.config), parts["rewards"], parts["rewards"].names,
                             parts["tokenizer"], parts["rows"], chunk=self.config.loss_chunk)
        return self._loss

    def parameters_line(self, method: str, trainable: int, total: int) -> str:
        return f"grpo with {method}: training {trainable:,} of {total:,} parameters"

    def counter(self) -> Counter:
        return CompletionCounter(self.unit, self._loss.phases if self._loss is not None else None)

    def callbacks(self) -> list[Callback]:
        """With ``num_iterations`` > 1, the one that keeps a rollout batch's weights in checkpoints."""
        from mlx_train.llm import grpo

        return [grpo.RolloutAnchor(self._loss)] if self.config.num_iterations > 1 and self._loss is not None else []

    def batch_repeats(self) -> int:
        """``num_iterations``: each batch of prompts is sampled once and trained on that many steps."""
        return int(self.config.num_iterations)

    def adapter_facts(self) -> dict[str, Any]:
        return {"train_mode": "grpo", **self.card_hyperparameters()}

    def card_hyperparameters(self) -> dict[str, Any]:
        cfg = self.config
        facts = {k: getattr(cfg, k) for k in ("beta", *_GRPO_SETTINGS)}
        if self._parts:  # the functions and weights in use (a null setting: the defaults or the file's)
            facts["reward_functions"] = self._parts["rewards"].names
            facts["reward_weights"] = self._parts["rewards"].weights
        return facts

    def evaluate(self, trainer: Any, result: dict[str, Any], test_rows: Any, eval_rows: int) -> None:
        _test_metrics(trainer, result, test_rows, eval_rows)

    def summary(self, result: dict[str, Any]) -> list[str]:
        lines = [self.headline("finetune grpo", result)]
        for split in ("val", "test"):
            if f"{split}_metrics" in result:
                m = result[f"{split}_metrics"]
                lines.append(f"  {'validation' if split == 'val' else 'test'}: reward {m['reward_mean']:.4f} (std "
                             f"{m['reward_std']:.4f}), loss {m['loss']:.4f}, completion length "
                             f"{m['completion_length']:.1f}")
        return lines

    def check_tensor_parallel(self) -> None:
        raise ConfigError("--train-mode grpo cannot run with --strategy tensor_parallel yet (its sampling runs the "
                          "whole model on each rank); use --strategy data_parallel")

    def result_counts(self, counter: Counter) -> dict[str, Any]:
        counts = super().result_counts(counter)
        return {**counts, "trained_completions": counts["trained"]} if self.unit == "completions" else counts


class _Vision:
    """What the vision-language tasks share: mlx-vlm loads the model (a Qwen2-VL family one) and its processor,
    the step runs uncompiled, rows may have images, and the adapters' files name their layers in full."""

    library = "mlx-vlm"
    config: FinetuneConfig

    def __init__(self, config: FinetuneConfig, model_type: str) -> None:
        self.model_type = model_type
        super().__init__(config)  # type: ignore[call-arg]

    def check(self) -> None:
        from mlx_train.llm.vision import models

        super().check()  # type: ignore[misc]
        path = self.config.model or ""
        models.require_mlx_vlm(path, self.model_type)
        models.check_family(path, self.model_type)
        models.check_settings(self.config, path)

    def settings(self, config: FinetuneConfig, log: Callable[[str], None]) -> FinetuneConfig:
        from mlx_train.llm.vision.models import trainer_settings

        return trainer_settings(config, self.model_type, log)

    def check_records(self, records: dict[str, Any]) -> None:
        pass  # images are what these tasks train on

    def load_model(self, quantized: bool, lazy: bool, log: Callable[[str], None]) -> tuple[Any, Any, dict[str, Any]]:
        from mlx_train.llm.vision.models import load

        # full fine-tuning trains float weights: a quantized base is dequantized (as mlx-vlm's full training)
        return load(self.config.model or "", quantized and self.config.fine_tune_type != "full", log)

    def adapter_spec(self, model: Any, spec: Any) -> Any:
        """The adapters' layers by full name (``mlx_vlm.load`` adds adapters where they say); with
        ``train_vision`` the vision tower and projector are made trainable here (saved with the adapters,
        which ``mlx_vlm.load`` also loads)."""
        import dataclasses

        from mlx_train.llm.vision.models import adapter_keys, unfreeze_vision

        if self.config.train_vision:
            unfreeze_vision(model, self.config.model or "")
        return dataclasses.replace(spec, keys=adapter_keys(model))

    def adapter_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = super().adapter_facts()  # type: ignore[misc]
        return {**facts, "train_vision": True} if self.config.train_vision else facts

    def adapter_weights(self, model: Any) -> dict[str, Any] | None:
        """With full fine-tuning every weight of the model, trained or not: ``mlx_vlm.load(base,
        adapter_path=...)`` loads a full fine-tuning's file as the whole model (as mlx-vlm's trainer writes it)."""
        from mlx.utils import tree_flatten

        return dict(tree_flatten(model.parameters())) if self.config.fine_tune_type == "full" else None


class VisionSFT(_Vision, SFT):
    """SFT of a vision-language model (mlx-vlm's Qwen2-VL family) on rows with images, in mlx-vlm's format
    (``mlx_train.llm.vision``): mlx-vlm loads the model and its processor and builds the prompts; the loss
    masks are SFT's (``mask_prompt``, ``assistant_only_loss``); the step runs uncompiled. Picked by
    ``task_for`` when ``model`` is a vision-language model.

    Example: ``VisionSFT(FinetuneConfig(model="Qwen2-VL-2B-Instruct", dataset="pictures"), "qwen2_vl").loss()``.
    """

    def datasets(self, model: Any, tokenizer: Any, records: dict[str, Any],
                 log: Callable[[str], None]) -> dict[str, Any]:
        from mlx_train.llm.vision.data import build_splits

        return build_splits(self.config, tokenizer, model.config.__dict__, records, log)

    def loss(self) -> Any:
        from mlx_train.llm.vision.loss import vision_lm_loss

        return vision_lm_loss

    def gathers_positions(self) -> bool:
        return False

    def evaluate(self, trainer: Any, result: dict[str, Any], test_rows: Any, eval_rows: int) -> None:
        from mlx_train.llm import data

        if test_rows is not None:  # image rows need the padding collate
            test_rows = data.make_loader(test_rows, eval_rows, shuffle=False, num_workers=0, drop_last=False)
        super().evaluate(trainer, result, None, eval_rows)
        if test_rows is not None:
            result["test_loss"] = trainer.evaluate(test_rows)["loss"]
            result["test_perplexity"] = math.exp(min(result["test_loss"], 50))


class VisionPreference(_Vision, Preference):
    """DPO, ORPO or CPO of a vision-language model on preference pairs with images (mlx-vlm's preference rows:
    ``{"images", "prompt", "chosen", "rejected"}``, ``mlx_train.llm.vision.data.ImagePairRows``): the
    preference task's losses, rewards and metrics, with the pictures shown to both replies. DPO's reference is
    the model with its adapters off, inside each step.

    Example: ``VisionPreference(FinetuneConfig(model="Qwen2-VL-2B-Instruct", dataset="prefs", train_mode="dpo"),
    "qwen2_vl").loss()``.
    """

    def check(self) -> None:
        super().check()
        cfg = self.config
        for name in ("reference_model_path", "precompute_ref_log_probs"):
            if getattr(cfg, name):
                raise ConfigError(f"--{name.replace('_', '-')} is not supported for vision-language models yet: the "
                                  "DPO reference is the model with its adapters off, computed in each step; leave it "
                                  "out")
        if cfg.fine_tune_type == "full" and self.options.needs_reference:
            raise ConfigError("--fine-tune-type full with --train-mode dpo: the DPO reference of a vision-language "
                              "model is the model with its adapters off, and full fine-tuning has none; use "
                              "--fine-tune-type lora or dora, --reference-free, or --train-mode orpo or cpo")
        if cfg.train_vision and self.options.needs_reference:
            raise ConfigError("--train-vision with --train-mode dpo: the DPO reference is the model with its adapters "
                              "off, which would see the vision tower as trained so far, not the base's; leave out "
                              "--train-vision, or use --reference-free, --train-mode orpo or cpo")

    def datasets(self, model: Any, tokenizer: Any, records: dict[str, Any],
                 log: Callable[[str], None]) -> dict[str, Any]:
        from mlx_train.llm.vision.data import build_pair_splits

        splits = build_pair_splits(self.config, tokenizer, model.config.__dict__, records, log)
        if "train" not in splits:
            raise ConfigError(f"{self.config.dataset} has no training pairs (train.jsonl is missing or empty)")
        if self.options.needs_reference:
            log("reference policy: the model with its adapters off, inside each step (no second copy of the weights)")
        return splits

    def loss(self) -> Any:
        from mlx_train.llm.vision.loss import VisionPreferenceLoss

        return VisionPreferenceLoss(self.options)


#: train_mode -> its task. A new task: its class above and one line here (and its name in TRAIN_MODES).
TASKS: dict[str, Callable[[FinetuneConfig], Task]] = {
    "sft": SFT,
    "dpo": Preference,
    "orpo": Preference,
    "cpo": Preference,
    "grpo": GRPO,
}


#: train_mode -> its task for a vision-language model (``task_for``); a mode missing here is refused for them.
VISION_TASKS: dict[str, Callable[[FinetuneConfig, str], Task]] = {
    "sft": VisionSFT,
    "dpo": VisionPreference,
    "orpo": VisionPreference,
    "cpo": VisionPreference,
}


def task_for(config: FinetuneConfig) -> Task:
    """The task of a fine-tuning run, from its ``train_mode``; its settings are checked here.

    A ``model`` that is a vision-language model (``mlx_train.llm.vision.vision_model_type``) gets a vision
    task: :class:`VisionSFT` for ``train_mode`` sft, :class:`VisionPreference` for dpo, orpo and cpo.

    Example: ``task_for(FinetuneConfig(model="base", dataset="data")).name`` -> ``"sft"``.
    """
    if not isinstance(config, FinetuneConfig):
        raise ConfigError(f"fine-tuning takes a FinetuneConfig (the Trainer's config with the llm section), got "
                          f"{type(config).__name__}: build it with FinetuneConfig(...) or "
                          "TrainConfig.from_yaml(path, finetune=True)")
    from mlx_train.llm.vision.models import vision_model_type

    model_type = vision_model_type(config.model) if config.model else None
    if model_type is None:
        if config.train_vision:
            raise ConfigError(f"--train-vision trains the vision tower of a vision-language model, but {config.model} "
                              "is a text-only model (its config.json has no vision_config); leave it out")
        return TASKS[config.train_mode](config)
    if config.train_mode not in VISION_TASKS:
        raise ConfigError(f"--train-mode {config.train_mode} is not supported for vision-language models yet: "
                          f"{config.model} is one ({model_type}); fine-tune it with --train-mode "
                          f"{', '.join(VISION_TASKS)}")
    return VISION_TASKS[config.train_mode](config, model_type)
