"""Fine-tune a language model with the Trainer: what ``mlx_lm.lora`` does, with exact resume,
packing and token-length bucketing.

``FineTuneConfig`` uses mlx_lm.lora's names, so its YAML files load as they are.

Example::

    result = finetune(FineTuneConfig(model="SmolLM2-135M-Instruct.Q4_1.gguf", data="data/",
                                     iters=100, num_layers=8, pack=True, run_dir="runs/smol"))
    result["val_loss"], result["val_perplexity"]      # adapters in runs/smol/adapters
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_train.errors import ConfigError, did_you_mean
from mlx_train.training.callbacks import Callback


def _f(default: Any, help: str) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class FineTuneConfig:
    """Every fine-tuning knob, with mlx_lm.lora's names and defaults (plus epochs, pack, resume,
    run_dir, quantized), and mlx-lm-lora's for preference tuning (train_mode, beta, dpo_loss_type,
    reference_model_path; label_smoothing, reference_free and TRL's precompute_ref_log_probs)."""

    model: str | None = _f(None, "Base model: an mlx-lm/Hugging Face directory, a Hugging Face repo id or a "
                                 ".gguf file.")
    data: str | None = _f(None, "Directory with train.jsonl/valid.jsonl/test.jsonl, or a Hugging Face dataset name.")
    fine_tune_type: str = _f("lora", "lora, dora or full.")
    num_layers: int = _f(16, "Blocks to fine-tune, counted from the last (-1: all; 0 is refused).")
    lora_parameters: dict = _f({"rank": 8, "scale": 20.0, "dropout": 0.0}, "LoRA rank, scale, dropout and keys.")
    batch_size: int = _f(4, "Rows per optimizer step (split into grad_accumulation_steps micro-batches).")
    iters: int | None = _f(None, "Optimizer steps to train for (null: train for epochs).")
    epochs: int = _f(1, "Passes over the training rows when iters is not set.")
    learning_rate: float = _f(1e-5, "Learning rate.")
    optimizer: str = _f("adam", "Optimizer from mlx.optimizers (adam, adamw, sgd, adafactor, muon, ...).")
    lr_schedule: dict | None = _f(None, "mlx-lm schedule: {name, arguments, warmup, warmup_init}.")
    max_seq_length: int = _f(2048, "Longest sequence in tokens; longer documents are cut (and counted).")
    mask_prompt: bool = _f(False, "Train on completions only (prompt/completion and chat records).")
    pack: bool = _f(False, "Pack several documents per row up to max_seq_length (no loss or attention across them).")
    grad_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.")
    grad_checkpoint: bool = _f(False, "Recompute block activations in the backward pass to save memory.")
    adapter_path: str = _f("adapters", "Where the adapters are written (mlx-lm format); relative to run_dir when set.")
    resume_adapter_file: str | None = _f(None, "Adapters (directory or adapters.safetensors) to start from.")
    steps_per_report: int = _f(10, "Optimizer steps between training reports.")
    steps_per_eval: int = _f(200, "Optimizer steps between validations.")
    save_every: int = _f(100, "Optimizer steps between checkpoints (and adapter saves).")
    val_batches: int = _f(25, "Validation batches (-1: the whole validation set).")
    test: bool = _f(False, "Evaluate on the test set after training.")
    test_batches: int = _f(500, "Test batches (-1: the whole test set).")
    seed: int = _f(0, "Seed of adapter initialisation, dropout and data order.")
    run_dir: str | None = _f(None, "Run directory: metrics.jsonl, train.log, checkpoints/, adapters/.")
    resume: str | None = _f(None, "Resume from 'auto' (the newest checkpoint in run_dir) or a checkpoint path.")
    overwrite: bool = _f(False, "Start over in a run_dir that holds a run: the old run is moved aside to "
                         "RUN_DIR.old-<date>-<time> (without it such a start is refused).")
    quantized: bool | None = _f(None, "Keep a quantized base quantized (QLoRA). Default: keep it on a GPU, "
                                "dequantize to float32 on a CPU (quantized matmuls are slow there).")
    num_workers: int = _f(1, "Background threads that prepare batches.")
    report_to: str | None = _f(None, "Trackers for the config, metrics and adapters: wandb, mlflow, tensorboard, "
                                     "comma-separated.")
    project_name: str | None = _f(None, "Tracker project (W&B project, MLflow experiment).")
    run_name: str | None = _f(None, "Tracker run name (default: the run directory's name).")

    # preference tuning (mlx-lm-lora's names; llm/preference.py)
    train_mode: str = _f("sft", "sft (next-token loss), dpo, orpo or cpo (preference rows: prompt, chosen, "
                                "rejected).")
    beta: float = _f(0.1, "DPO: temperature of the implicit reward; ORPO: weight of the odds-ratio term.")
    dpo_loss_type: str = _f("sigmoid", "DPO/CPO loss: sigmoid, hinge or ipo (YAML alias: dpo_cpo_loss_type).")
    label_smoothing: float = _f(0.0, "DPO sigmoid: share of preference labels assumed wrong (conservative DPO).")
    reference_free: bool = _f(False, "DPO against a uniform reference (reference log-probabilities 0).")
    reference_model_path: str | None = _f(None, "DPO reference model (default: the base model; with LoRA/DoRA "
                                          "the adapters are switched off, with full fine-tuning its "
                                          "log-probabilities are computed once before training).")
    precompute_ref_log_probs: bool = _f(False, "DPO with LoRA/DoRA: compute the reference log-probabilities once "
                                         "before training (adapters off) instead of in every step: less memory "
                                         "and time per step, one forward pass over the data first.")

    # mlx_lm.lora YAML keys that have no effect here (accepted so its files load as they are).
    IGNORED = ("train", "config", "optimizer_config", "clear_cache_threshold", "trust_remote_code")
    # mlx-lm-lora's YAML names of the same settings
    ALIASES = {"dpo_cpo_loss_type": "dpo_loss_type"}

    @classmethod
    def from_dict(cls, values: dict, where: str = "config") -> FineTuneConfig:
        """Build from a dict (e.g. an mlx_lm.lora YAML); unknown keys are an error."""
        names = [f.name for f in dataclasses.fields(cls)]
        if values.get("wandb"):  # older mlx_lm.lora files: "wandb: PROJECT" reports to W&B
            values = {**values, "report_to": ",".join(filter(None, [values.get("report_to"), "wandb"])),
                      "project_name": values.get("project_name") or values["wandb"]}
        values = {k: v for k, v in values.items() if k != "wandb"}
        values = {cls.ALIASES.get(k, k): v for k, v in values.items()}
        unknown = [k for k in values if k not in names and k not in cls.IGNORED]
        if unknown:
            raise ConfigError(f"{where}: unknown key '{unknown[0]}'{did_you_mean(unknown[0], names)}; "
                              f"known keys: {', '.join(names)}")
        return cls(**{k: v for k, v in values.items() if k in names})

    @classmethod
    def from_yaml(cls, path: str) -> FineTuneConfig:
        """Read an mlx_lm.lora-style YAML file."""
        import yaml

        try:
            with open(path) as f:
                values = yaml.safe_load(f) or {}
        except OSError as error:
            raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config {path} is not valid YAML: {error}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config {path} must be a mapping of option: value")
        return cls.from_dict(values, where=path)

    def path_in_run(self, path: str) -> str:
        return path if os.path.isabs(path) or not self.run_dir else os.path.join(self.run_dir, path)


class TokenCounter(Callback):
    """Counts trained tokens (targets in the loss) and prints a report line with them."""

    def __init__(self) -> None:
        self.trained_tokens = 0.0
        self.tokens_per_second: list[float] = []

    def on_report(self, trainer, logs: dict) -> None:
        # The Trainer counts the targets the loss averaged over (tokens here), checkpointed with the run.
        self.trained_tokens = trainer.state.trained_items
        if "tokens_per_second" in logs:
            self.tokens_per_second.append(logs["tokens_per_second"])

    def on_validation_end(self, trainer, logs: dict) -> None:
        trainer.log(f"step {logs['step']}: val loss {logs['val_loss']:.4f}, "
                    f"val perplexity {math.exp(min(logs['val_loss'], 50)):.3f}")

    def on_fit_end(self, trainer, history: dict) -> None:
        self.trained_tokens = trainer.state.trained_items
        # The final report line, also in train.log: a run shorter than steps_per_report has no other.
        trainer.log(f"finished at step {trainer.step}: {int(self.trained_tokens):,} trained tokens")


class AdapterWriter(Callback):
    """Keeps the mlx-lm adapter files in step with each checkpoint and writes them at the end."""

    def __init__(self, spec: Any, directory: str, extra: dict) -> None:
        self.spec, self.directory, self.extra = spec, directory, extra

    def _write(self, trainer) -> None:
        from mlx_train.llm.adapters import save_adapters

        if trainer.is_main:
            save_adapters(trainer.model, self.spec, self.directory, self.extra)

    def on_checkpoint(self, trainer, path: str) -> None:
        self._write(trainer)

    def on_fit_end(self, trainer, history: dict) -> None:
        self._write(trainer)


def _train_config(cfg: FineTuneConfig, steps_per_epoch: int) -> Any:
    from mlx_train.config import TrainConfig

    if cfg.iters is not None and cfg.iters < 1:
        raise ConfigError(f"iters must be at least 1, got {cfg.iters}")
    if cfg.num_layers == 0 or cfg.num_layers < -1:
        raise ConfigError(f"num_layers must be -1 (all blocks, as in mlx_lm.lora) or at least 1, got {cfg.num_layers}")
    # A run shorter than steps_per_report reports at its last step (mlx_lm.lora reports at the last iteration).
    report_every = min(cfg.steps_per_report, cfg.iters) if cfg.iters else cfg.steps_per_report
    epochs = math.ceil(cfg.iters / steps_per_epoch) if cfg.iters else cfg.epochs
    schedule: dict[str, Any] = {}
    if cfg.lr_schedule:
        args = list(cfg.lr_schedule.get("arguments", []))
        schedule = {"lr_schedule": cfg.lr_schedule["name"], "lr_schedule_args": args[1:],
                    "warmup_steps": int(cfg.lr_schedule.get("warmup", 0)),
                    "warmup_init": float(cfg.lr_schedule.get("warmup_init", 0.0))}
    if cfg.grad_accumulation_steps < 1:
        raise ConfigError(f"grad_accumulation_steps must be at least 1, got {cfg.grad_accumulation_steps}")
    if cfg.batch_size % cfg.grad_accumulation_steps:
        raise ConfigError(f"batch_size {cfg.batch_size} is not a multiple of grad_accumulation_steps "
                          f"{cfg.grad_accumulation_steps}")
    return TrainConfig(
        epochs=epochs, max_steps=cfg.iters, batch_size=cfg.batch_size // cfg.grad_accumulation_steps,
        gradient_accumulation=cfg.grad_accumulation_steps, learning_rate=cfg.learning_rate,
        optimizer=cfg.optimizer, seed=cfg.seed,
        report_every=f"{report_every} steps", eval_every=f"{cfg.steps_per_eval} steps",
        checkpoint_every=f"{cfg.save_every} steps", run_dir=cfg.run_dir,
        checkpoint_dir=os.path.join(cfg.run_dir, "checkpoints") if cfg.run_dir else None,
        gradient_checkpointing=cfg.grad_checkpoint, num_workers=cfg.num_workers,
        eval_batch_size=cfg.batch_size, report_to=cfg.report_to or [], project_name=cfg.project_name,
        run_name=cfg.run_name, **schedule)


def check_before_loading(cfg: FineTuneConfig, log: Any = print) -> None:
    """What can be checked without the (slow) model load: every setting's range, --test's split, the run
    directory (a new run into one that holds a run is refused, or moved aside with ``overwrite``) and what a
    resume continues (its batch size and seed cannot change).

    Example: ``check_before_loading(FineTuneConfig(model="base", data="data", iters=0))`` raises ConfigError.
    """
    from mlx_train.checkpointing import CheckpointManager
    from mlx_train.training.resume import make_room

    new = _train_config(cfg, 1)  # a TrainConfig checks learning_rate, epochs, ... as train's flags are checked
    if cfg.test and cfg.data and os.path.isdir(cfg.data) and not os.path.isfile(os.path.join(cfg.data, "test.jsonl")):
        raise ConfigError(f"--test evaluates on {os.path.join(cfg.data, 'test.jsonl')}, which does not exist; add "
                          "it, or leave --test out")
    if cfg.run_dir and os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError(f"the run directory {cfg.run_dir} is a file, not a directory; pass --run-dir a directory "
                          "that can be written (it is created if missing)")
    if cfg.overwrite and cfg.resume:
        raise ConfigError("--overwrite starts the run over and --resume continues it: give one of them")
    if cfg.resume:
        _check_resume(cfg)
    elif cfg.run_dir:
        make_room(CheckpointManager(new.checkpoint_dir, keep_last=None, async_save=False), cfg.run_dir,
                  cfg.overwrite, log)


def resume_checkpoint(cfg: FineTuneConfig) -> str | None:
    """The checkpoint ``cfg.resume`` continues: a checked path, or None for "auto" before the first checkpoint
    (the run then starts from scratch, as ``Trainer.train(resume="auto")`` does).

    Example: ``resume_checkpoint(FineTuneConfig(run_dir="runs/a", resume="auto"))`` -> ``"runs/a/checkpoints/step-..."``
    """
    from mlx_train.checkpointing import CheckpointManager

    if cfg.run_dir:
        directory = os.path.join(cfg.run_dir, "checkpoints")
    elif cfg.resume == "auto":
        raise ConfigError("--resume auto looks in RUN_DIR/checkpoints: pass --run-dir, or a checkpoint path")
    else:
        directory = os.path.dirname(str(cfg.resume)) or "."
    return CheckpointManager(directory, keep_last=None, async_save=False).resolve(cfg.resume)


def _check_resume(cfg: FineTuneConfig) -> None:
    """Refuse a resume with a batch size or seed other than its checkpoint's (the data order and the position
    in the epoch are restored from it, counted in its batches)."""
    from mlx_train.checkpointing import load_checkpoint

    path = resume_checkpoint(cfg)
    if path is None:
        return
    saved = load_checkpoint(path, groups=[])[1].get("config") or {}
    was = {"batch_size": saved.get("batch_size", 0) * saved.get("gradient_accumulation", 1),
           "grad_accumulation_steps": saved.get("gradient_accumulation"), "seed": saved.get("seed")}
    now = {"batch_size": cfg.batch_size, "grad_accumulation_steps": cfg.grad_accumulation_steps, "seed": cfg.seed}
    changed = [name for name in was if saved and was[name] != now[name]]
    if changed:
        settings = ", ".join(f"{name} {was[name]} -> {now[name]}" for name in changed)
        raise ConfigError(f"{settings}: cannot change on resume (the data order and the position in the epoch are "
                          f"restored from {path}, counted in its batches and drawn with its seed). To resume, give "
                          "the run's own values; to train with others, start a new run without --resume")


def prepare(cfg: FineTuneConfig, log: Any = print) -> dict[str, Any]:
    """Load the model, add adapters and build the datasets (what :func:`finetune` trains on)."""
    from mlx_train.llm import adapters, data, loss, models

    if not cfg.model or not cfg.data:
        raise ConfigError("fine-tuning needs a base model and data: pass --model PATH and --data DIR")
    if cfg.train_mode != "sft":  # a wrong preference setting fails before the model loads
        from mlx_train.llm.preference import PreferenceConfig

        PreferenceConfig.from_finetune(cfg)
    spec = adapters.AdapterConfig.from_mlx_lm(
        {"fine_tune_type": cfg.fine_tune_type, "num_layers": cfg.num_layers, "lora_parameters": cfg.lora_parameters})
    quantized = cfg.quantized if cfg.quantized is not None else mx.default_device() == mx.gpu
    model, tokenizer, model_config = models.load_model(cfg.model, quantized=quantized)
    records = data.load_records(cfg.data)
    if not records["train"]:
        raise ConfigError(f"{cfg.data} has no training records (train.jsonl is missing or empty)")
    mx.random.seed(cfg.seed)  # adapter initialisation
    if cfg.resume_adapter_file:
        directory = cfg.resume_adapter_file
        if directory.endswith(".safetensors"):
            directory = os.path.dirname(directory) or "."
        spec = adapters.load_adapters(model, directory)
        log(f"continuing from the adapters in {directory}")
    else:
        adapters.apply_adapters(model, spec)
    if cfg.train_mode != "sft":
        return _preference_parts(cfg, model, tokenizer, model_config, spec, log)
    document_mask = loss.supports_document_mask(model)
    if cfg.pack and not document_mask:
        log("packing: this model takes no attention mask, so a token may attend to earlier documents of its "
            "row (the loss still never crosses a document boundary)")
    splits: dict[str, Any] = {}
    for name in ("train", "valid", "test"):
        if not records[name]:
            continue
        docs = data.tokenize(records[name], tokenizer, cfg.mask_prompt, cfg.max_seq_length,
                             where=f"{cfg.data}/{name}.jsonl")
        rows = data.SequenceDataset(docs, cfg.max_seq_length, pack=cfg.pack and name == "train",
                                    document_mask=document_mask)
        log(data.describe_documents(name, docs, rows))
        splits[name] = rows
    trainable, total = adapters.trainable_count(model)
    log(f"{spec.fine_tune_type}: training {trainable:,} of {total:,} parameters ({100 * trainable / total:.3f}%)")
    return {"model": model, "tokenizer": tokenizer, "model_config": model_config, "spec": spec, "splits": splits}


def _preference_parts(cfg: FineTuneConfig, model: Any, tokenizer: Any, model_config: dict, spec: Any,
                      log: Any) -> dict[str, Any]:
    """:func:`prepare` for DPO/ORPO: preference pairs instead of documents."""
    from mlx_train.llm import adapters, preference

    splits = preference.build_splits(cfg, model, tokenizer, log)
    trainable, total = adapters.trainable_count(model)
    log(f"{cfg.train_mode} with {spec.fine_tune_type}: training {trainable:,} of {total:,} parameters")
    return {"model": model, "tokenizer": tokenizer, "model_config": model_config, "spec": spec, "splits": splits}


class PairCounter(TokenCounter):
    """TokenCounter for preference runs: the validation line shows reward accuracy and margin."""

    def on_validation_end(self, trainer, logs: dict) -> None:
        trainer.log(f"step {logs['step']}: val loss {logs['val_loss']:.4f}, val reward accuracy "
                    f"{logs['val_reward_accuracy']:.3f}, val reward margin {logs['val_reward_margin']:.4f}")


def _loss_for(cfg: FineTuneConfig) -> Any:
    from mlx_train.llm import loss, preference

    if cfg.train_mode == "sft":
        return loss.lm_loss
    return preference.PreferenceLoss(preference.PreferenceConfig.from_finetune(cfg))


def finetune(cfg: FineTuneConfig, callbacks: list | None = None) -> dict[str, Any]:
    """Fine-tune ``cfg.model`` on ``cfg.data``; returns the trainer, model, history and final
    validation loss/perplexity. Adapters are written to ``cfg.adapter_path`` in mlx-lm's format.

    Example: ``finetune(FineTuneConfig(model="base", data="data", iters=50))["val_perplexity"]``.
    """
    from mlx_train.llm import card, data, models
    from mlx_train.training import Trainer

    log = print
    check_before_loading(cfg, log)
    parts = prepare(cfg, log)
    model, splits = parts["model"], parts["splits"]
    if cfg.test and "test" not in splits:  # an empty test.jsonl, or a dataset without a test split
        raise ConfigError(f"--test: {cfg.data} has no test records to evaluate on; add some, or leave --test out")
    train_rows, valid_rows = splits["train"], splits.get("valid")
    loader = data.make_loader(train_rows, cfg.batch_size, seed=cfg.seed, num_workers=cfg.num_workers)
    trainer = Trainer(model, loss_fn=_loss_for(cfg), config=_train_config(cfg, len(loader)))
    # Checkpoints of a run with a frozen base hold the trained parameters and this reference.
    trainer.base_model = models.base_reference(cfg.model) if os.path.exists(cfg.model) else {"path": cfg.model}
    counter = TokenCounter() if cfg.train_mode == "sft" else PairCounter()
    adapter_dir = cfg.path_in_run(cfg.adapter_path)
    extra = {"model": cfg.model, "data": cfg.data, "max_seq_length": cfg.max_seq_length, "seed": cfg.seed,
             "mask_prompt": cfg.mask_prompt, "pack": cfg.pack}
    if cfg.train_mode != "sft":
        extra.update({"train_mode": cfg.train_mode, "beta": cfg.beta, "dpo_loss_type": cfg.dpo_loss_type})
    writer = AdapterWriter(parts["spec"], adapter_dir, extra)
    val = None
    if valid_rows is not None:  # the same collate (padding to a multiple of 8) as training, in file order
        rows = valid_rows.head(cfg.val_batches * cfg.batch_size) if cfg.val_batches > 0 else valid_rows
        val = data.make_loader(rows, cfg.batch_size, shuffle=False, num_workers=0, drop_last=False)
    history = trainer.train(train_dataset=loader, val_dataset=val, resume=cfg.resume,
                            callbacks=[counter, writer, *(callbacks or [])])
    result: dict[str, Any] = {"trainer": trainer, "model": model, "tokenizer": parts["tokenizer"], "history": history,
                              "adapter_path": adapter_dir, "trained_tokens": int(counter.trained_tokens),
                              "tokens_per_second": (sum(counter.tokens_per_second) / len(counter.tokens_per_second)
                                                    if counter.tokens_per_second else None)}
    if val is not None:
        result["val_metrics"] = trainer.evaluate(val)
        result["val_loss"] = result["val_metrics"]["loss"]
        if cfg.train_mode == "sft":
            result["val_perplexity"] = math.exp(min(result["val_loss"], 50))
    if cfg.test and "test" in splits:
        test_rows = splits["test"].head(cfg.test_batches * cfg.batch_size)
        if cfg.train_mode == "sft":
            result["test_loss"] = trainer.evaluate(test_rows.samples())["loss"]
            result["test_perplexity"] = math.exp(min(result["test_loss"], 50))
        else:
            result["test_metrics"] = trainer.evaluate(data.make_loader(test_rows, cfg.batch_size, shuffle=False,
                                                                       num_workers=0, drop_last=False))
            result["test_loss"] = result["test_metrics"]["loss"]
    if trainer.is_main:
        result["card"] = card.card_facts(cfg, result)
        card.write_model_card(adapter_dir, result["card"])
    return result


def fuse_model(model_path: str, adapter_path: str, save_path: str, dequantize: bool = False) -> str:
    """Load a base model, add the adapters of ``adapter_path``, fold them in and write an mlx-lm
    model directory (``mlx_lm.load(save_path)`` reads it), with the adapters' model card when they
    have one. Works for GGUF bases too.

    Example: ``fuse_model("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/a/adapters", "smol-tuned")``.
    """
    from mlx_train.llm import adapters, card, models

    model, tokenizer, config = models.load_model(model_path, quantized=not dequantize)
    adapters.load_adapters(model, adapter_path)
    adapters.fuse_adapters(model, dequantize=dequantize)
    if dequantize:
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    models.save_model(model, tokenizer, config, save_path)
    card.write_fused_card(adapter_path, save_path)
    return save_path
