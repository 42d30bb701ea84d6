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


class Task:
    """What a kind of fine-tuning trains (the base: every method has a default or says what it needs).

    ``name`` is its ``train_mode``; ``unit`` what its runs count. A subclass builds its rows
    (``datasets``) and its loss (``loss``); the rest have defaults for a language-model loss.
    """

    name = ""
    unit = "trained tokens"
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

    def adapter_facts(self) -> dict[str, Any]:
        """What the task adds to the adapters' ``adapter_config.json``."""
        return {}

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
    inapplicable = _PREFERENCE_SETTINGS

    def applies_to(self, name: str) -> str:
        return "the preference tasks (dpo, orpo, cpo)"

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
        return () if self.name == "dpo" else _REFERENCE_SETTINGS

    def applies_to(self, name: str) -> str:
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
        from mlx_train.llm import data

        if test_rows is not None:
            result["test_metrics"] = trainer.evaluate(data.make_loader(test_rows, eval_rows, shuffle=False,
                                                                       num_workers=0, drop_last=False))
            result["test_loss"] = result["test_metrics"]["loss"]

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


#: train_mode -> its task. A new task: its class above and one line here (and its name in TRAIN_MODES).
TASKS: dict[str, Callable[[FinetuneConfig], Task]] = {
    "sft": SFT,
    "dpo": Preference,
    "orpo": Preference,
    "cpo": Preference,
}


def task_for(config: FinetuneConfig) -> Task:
    """The task of a fine-tuning run, from its ``train_mode``; its settings are checked here.

    Example: ``task_for(FinetuneConfig(model="base", dataset="data")).name`` -> ``"sft"``.
    """
    if not isinstance(config, FinetuneConfig):
        raise ConfigError(f"fine-tuning takes a FinetuneConfig (the Trainer's config with the llm section), got "
                          f"{type(config).__name__}: build it with FinetuneConfig(...) or "
                          "TrainConfig.from_yaml(path, finetune=True)")
    return TASKS[config.train_mode](config)
