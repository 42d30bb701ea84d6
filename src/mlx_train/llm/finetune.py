"""Fine-tune a language model with the Trainer: what ``mlx_lm.lora`` does, with exact resume,
packing and token-length bucketing.

The configuration is a ``FinetuneConfig``: the Trainer's ``TrainConfig`` (as ``mlx-train train``'s) with
the ``llm`` section; ``model`` is the base model and ``dataset`` the data directory.
``FinetuneConfig.from_yaml(path)`` reads mlx_lm.lora's YAML files as they are, on mlx_lm.lora's
defaults; ``FineTuneConfig(...)`` builds the same from mlx_lm.lora's names. What is trained (SFT,
DPO, ORPO, CPO) is the run's task (``mlx_train.llm.tasks``), picked once from ``train_mode``.

Example::

    config = FineTuneConfig(model="SmolLM2-135M-Instruct.Q4_1.gguf", data="data/", iters=100,
                            num_layers=8, pack=True, run_dir="runs/smol")      # a FinetuneConfig
    result = finetune(config)
    result["val_loss"], result["val_perplexity"]      # adapters in runs/smol/adapters
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import mlx.core as mx

from mlx_train import rundir
from mlx_train.config import FinetuneConfig
from mlx_train.errors import ConfigError
from mlx_train.llm.tasks import PairCounter, Task, TokenCounter, task_for
from mlx_train.training.callbacks import Callback

__all__ = ["AdapterSplit", "AdapterWriter", "FineTuneConfig", "PairCounter", "TokenCounter", "adapter_file_settings",
           "check_before_loading", "check_fuse_target", "check_tensor_parallel", "finetune", "fuse_model",
           "path_in_run", "prepare", "recompute_setting", "resume_checkpoint"]


def FineTuneConfig(**values: Any) -> FinetuneConfig:  # noqa: N802 - the name of the class it replaces
    """The ``FinetuneConfig`` of a fine-tuning run, from mlx_lm.lora's names (``iters``, ``data``,
    ``grad_accumulation_steps``, ``steps_per_eval``, ``optimizer_config``, ...) or the fields' own,
    on ``mlx-train finetune``'s defaults (mlx_lm.lora's). A shim for code written against the
    former FineTuneConfig class: it is ``FinetuneConfig.from_dict(values)``.

    Example: ``FineTuneConfig(model="base", data="data", iters=8, grad_accumulation_steps=2).max_steps`` -> ``4``.
    """
    config = FinetuneConfig.from_dict(values, source="FineTuneConfig")
    assert isinstance(config, FinetuneConfig)  # from_dict of a class builds that class
    return config


def path_in_run(config: FinetuneConfig, path: str) -> str:
    """``path`` inside the run directory when it is relative and the run has one.

    Example: ``path_in_run(FinetuneConfig(run_dir="runs/a"), "adapters")`` -> ``"runs/a/adapters"``.
    """
    return path if os.path.isabs(path) or not config.run_dir else os.path.join(config.run_dir, path)


def _for_trainer(config: FinetuneConfig) -> FinetuneConfig:
    """The run's config as the Trainer takes it: checkpoints in RUN_DIR/checkpoints, and a run shorter
    than report_every reports at its last step (as mlx_lm.lora reports at its last iteration)."""
    from mlx_train.config import parse_every

    if config.run_dir and not config.checkpoint_dir:
        config = config.replace(checkpoint_dir=rundir.checkpoints_path(config.run_dir))
    report = parse_every(config.report_every)
    if config.max_steps and report.unit == "step" and report.n > config.max_steps:
        config = config.replace(report_every=f"{config.max_steps} steps")
    return config


class AdapterSplit(Protocol):
    """How the adapters of a model split over the ranks of a group are added and written whole
    (tensor parallelism; ``mlx_train.llm.tensor_parallel.TensorParallelAdapters`` is the one in use).

    Example: ``finetune(config, trainer_class=DistributedTrainer, split=TensorParallelAdapters(group))``
    """

    def add(self, model: Any, spec: Any) -> None:
        """Split ``model`` over the group and add ``spec``'s adapters to the split layers."""

    def save(self, model: Any, spec: Any, directory: str, extra: dict[str, Any]) -> None:
        """Write the adapters whole in mlx-lm's format; every rank calls it (one writes)."""

    def whole_at_checkpoint(self, model: Any, path: str, step: int) -> dict[str, mx.array]:
        """On rank 0 alone: the whole trained parameters at the checkpoint ``path`` of ``step``."""
        return {}


class AdapterWriter(Callback):
    """Keeps the mlx-lm adapter files in step with each checkpoint and writes them at the end.

    With a ``split`` (a model split over the ranks) the adapters are written whole: at the end every
    rank takes part in gathering them; at a checkpoint (where only rank 0 is called) rank 0 gets them
    from ``split.whole_at_checkpoint``.

    ``weights`` gives the arrays to write from the model (None: its trainable parameters; a vision-language
    model's full fine-tuning writes every weight, ``Task.adapter_weights``).

    Example: ``AdapterWriter(spec, "runs/a/adapters", {"model": "base"})`` among a Trainer's callbacks.
    """

    def __init__(self, spec: Any, directory: str, extra: dict[str, Any], split: AdapterSplit | None = None,
                 weights: Any = None) -> None:
        self.spec, self.directory, self.extra, self.split = spec, directory, extra, split
        self.weights = weights or (lambda model: None)

    def on_checkpoint(self, trainer: Any, path: str) -> None:
        from mlx_train.llm.adapters import save_adapters

        if not trainer.is_main:
            return
        weights = self.split.whole_at_checkpoint(trainer.model, path, trainer.step) if self.split else \
            self.weights(trainer.model)
        save_adapters(trainer.model, self.spec, self.directory, self.extra, weights=weights)

    def on_fit_end(self, trainer: Any, history: dict[str, Any]) -> None:
        from mlx_train.llm.adapters import save_adapters

        if self.split is not None:  # every rank gathers; rank 0 writes
            self.split.save(trainer.model, self.spec, self.directory, self.extra)
        elif trainer.is_main:
            save_adapters(trainer.model, self.spec, self.directory, self.extra, weights=self.weights(trainer.model))


def check_before_loading(config: FinetuneConfig, resume: str | None = None, overwrite: bool = False,
                         log: Any = print, launched: bool = False) -> None:
    """What can be checked without the (slow) model load: a base model and data are given, --test's split,
    the run directory (a new run into one that holds a run is refused, or moved aside with ``overwrite``)
    and what a resume continues (its batch size and seed cannot change). The values themselves were
    checked when ``config`` was made. ``launched``: a rank of a launched group, whose launcher made room.

    Example: ``check_before_loading(FineTuneConfig(data="data"))`` raises ConfigError (no base model).
    """
    from mlx_train.run_directory import RunDirectory

    if not config.model or not config.dataset:
        raise ConfigError("fine-tuning needs a base model and data: pass --model PATH and --data DIR")
    data_dir = config.dataset
    if config.test and os.path.isdir(data_dir) and not os.path.isfile(os.path.join(data_dir, "test.jsonl")):
        raise ConfigError(f"--test evaluates on {os.path.join(data_dir, 'test.jsonl')}, which does not exist; add "
                          "it, or leave --test out")
    if config.run_dir and os.path.exists(config.run_dir) and not os.path.isdir(config.run_dir):
        raise ConfigError(f"the run directory {config.run_dir} is a file, not a directory; pass --run-dir a "
                          "directory that can be written (it is created if missing)")
    if overwrite and resume:
        raise ConfigError("--overwrite starts the run over and --resume continues it: give one of them")
    if resume:
        _check_resume(config, resume, log)
    elif config.run_dir and not launched:
        RunDirectory.of(config.run_dir, config.checkpoint_dir).make_room(overwrite, log)


def adapter_file_settings(config: FinetuneConfig, log: Any = print) -> FinetuneConfig:
    """``config`` with the adapters of ``resume_adapter_file`` described as they are: training continues
    from them with their own method, blocks and LoRA parameters (their ``adapter_config.json``). A setting
    given on purpose (not the default) that differs from theirs is refused before the model loads, where
    mlx_lm.lora would build the configured adapters and load the file's weights into what fits; a default
    that differs is replaced, and the log says so.

    Example: ``adapter_file_settings(FineTuneConfig(resume_adapter_file="old/adapters")).num_layers`` -> the
    adapters' num_layers.
    """
    from mlx_train.llm.adapters import read_adapter_config

    directory: str | None = getattr(config, "resume_adapter_file", None)  # (task_for says what a config must be)
    if not directory:
        return config
    if directory.endswith(".safetensors"):
        directory = os.path.dirname(directory) or "."
    theirs = read_adapter_config(directory)
    defaults = FinetuneConfig.defaults()
    lora, default_lora = config.lora_parameters, defaults["lora_parameters"]
    # name -> (the configuration's value, its default, the adapters' value)
    settings = {"fine_tune_type": (config.fine_tune_type, defaults["fine_tune_type"], theirs.fine_tune_type),
                "num_layers": (config.num_layers, defaults["num_layers"], theirs.num_layers)}
    if theirs.fine_tune_type != "full":
        for key in ("rank", "scale", "dropout"):
            settings[f"lora_parameters.{key}"] = (lora.get(key, default_lora[key]), default_lora[key],
                                                 getattr(theirs, key))
    differ = {name: values for name, values in settings.items() if values[0] != values[2]}
    chosen = [name for name, (value, default, _) in differ.items() if value != default]
    if chosen:
        name = chosen[0]
        raise ConfigError(f"{name} {differ[name][0]!r} differs from the adapters of --resume-adapter-file "
                          f"{config.resume_adapter_file}, which have {name} {differ[name][2]!r} (their "
                          f"{os.path.join(directory, 'adapter_config.json')}): training continues those adapters "
                          f"as they are. Leave {name} out (or give {differ[name][2]!r}), or start new adapters "
                          "without --resume-adapter-file")
    if not differ:
        return config
    said = ", ".join(f"{name} {theirs_value!r} (not the default {value!r})"
                     for name, (value, _, theirs_value) in differ.items())
    log(f"continuing the adapters of {config.resume_adapter_file} with their own {said}")
    return config.replace(fine_tune_type=theirs.fine_tune_type, num_layers=theirs.num_layers,
                          lora_parameters={**lora, **({} if theirs.fine_tune_type == "full" else
                                                      {"rank": theirs.rank, "scale": theirs.scale,
                                                       "dropout": theirs.dropout})})


def resume_checkpoint(config: FinetuneConfig, resume: str) -> str | None:
    """The checkpoint ``resume`` ("auto" or a path) continues: a checked path, or None for "auto" before the
    first checkpoint (the run then starts from scratch, as ``Trainer.train(resume="auto")`` does).

    Example: ``resume_checkpoint(FinetuneConfig(run_dir="runs/a"), "auto")`` -> ``"runs/a/checkpoints/step-..."``
    """
    from mlx_train.run_directory import RunDirectory

    if resume == "auto" and not (config.checkpoint_dir or config.run_dir):
        raise ConfigError("--resume auto looks in RUN_DIR/checkpoints: pass --run-dir, or a checkpoint path")
    return RunDirectory.of(config.run_dir, config.checkpoint_dir).resolve(resume)


def _check_resume(config: FinetuneConfig, resume: str, log: Any = print) -> None:
    """Refuse a resume with a global batch or seed other than its checkpoint's (the data order and the
    position in the epoch are restored from it, counted in its batches), or a ``max_steps`` below its step
    (nothing would train); at ``max_steps`` already, say that nothing is left to train."""
    from mlx_train.checkpointing import load_checkpoint

    path = resume_checkpoint(config, resume)
    if path is None:
        return
    state = load_checkpoint(path, groups=[])[1]
    step = state.get("step")
    if config.max_steps and isinstance(step, int) and step >= config.max_steps:
        train_longer = f"give --max-steps above {step}, e.g. --max-steps {2 * step}, to train longer"
        if step > config.max_steps:
            raise ConfigError(f"{path} is at step {step}, past max_steps {config.max_steps}: the resumed run would "
                              f"train nothing; {train_longer}, or resume an earlier checkpoint with --resume PATH")
        log(f"{path} is at step {step} = max_steps: nothing is left to train; {train_longer}")
    saved = state.get("config") or {}
    was = {"rows per step": saved.get("batch_size", 0) * saved.get("gradient_accumulation", 1),
           "seed": saved.get("seed"), "num_iterations": saved.get("num_iterations", 1)}
    now = {"rows per step": config.batch_size * config.gradient_accumulation, "seed": config.seed,
           "num_iterations": config.num_iterations}
    changed = [name for name in was if saved and was[name] != now[name]]
    if changed:
        settings = ", ".join(f"{name} {was[name]} -> {now[name]}" for name in changed)
        repeated = ", each repeated num_iterations times," if "num_iterations" in changed else ""
        raise ConfigError(f"{settings}: cannot change on resume (the data order and the position in the epoch are "
                          f"restored from {path}, counted in its batches{repeated} and drawn with its seed). To "
                          "resume, give the run's own values; to train with others, start a new run without --resume")


def _check_one_step(config: FinetuneConfig, rows: Any, distributed: bool) -> None:
    """Refuse a training set smaller than one optimizer step (``batch_size x gradient_accumulation`` rows),
    in the run's own numbers: a step takes its rows from one pass over the data, never repeating a row, where
    mlx_lm.lora loops over its batches (its step may repeat one batch). A distributed run's loader says it with
    the ranks' numbers; batches by token budget (``pack: by_length``) hold as many rows as fit."""
    from mlx_train.errors import DataError

    if distributed or getattr(rows, "packing", None) == "by_length":
        return
    batch, accumulation = config.batch_size, config.gradient_accumulation
    count, needed = len(rows), batch * accumulation
    if count >= needed:
        return
    what = ("row" if count == 1 else "rows") + (" (packed)" if getattr(rows, "packed", False) else "")
    fix = (f"batch_size {count} with grad_accumulation_steps 1" if count < batch else
           f"grad_accumulation_steps {count // batch}{' or less' if count // batch > 1 else ''}")
    repeat = (f"; mlx_lm.lora would repeat its one batch of {batch} rows {accumulation} times in a step, which "
              f"makes the same update as grad_accumulation_steps 1" if batch <= count < 2 * batch else "")
    raise DataError(f"{config.dataset}: the training set has {count} {what}, fewer than one optimizer step of "
                    f"batch_size {batch} x grad_accumulation_steps {accumulation} = {needed} rows (a step takes its "
                    f"rows from one pass over the data, never the same row twice{repeat}); use {fix}, or add rows")


def prepare(cfg: FinetuneConfig, log: Any = print, split: AdapterSplit | None = None,
            task: Task | None = None) -> dict[str, Any]:
    """Load the model, add adapters and build the datasets (what :func:`finetune` trains on) as the run's
    ``task`` (default: the one ``cfg.train_mode`` names) builds them. With a ``split`` (tensor parallelism)
    the model is split over the ranks and the adapters are added to the split layers.

    Example: ``prepare(FineTuneConfig(model="base", data="data"))["splits"]["train"]``
    """
    from mlx_train.llm import adapters, data

    if not cfg.model or not cfg.dataset:
        raise ConfigError("fine-tuning needs a base model and data: pass --model PATH and --data DIR")
    task = task or task_for(cfg)  # a setting the task refuses fails before the model loads
    spec = adapters.AdapterConfig.from_mlx_lm(
        {"fine_tune_type": cfg.fine_tune_type, "num_layers": cfg.num_layers, "lora_parameters": cfg.lora_parameters})
    records = data.load_records(cfg.dataset)
    if not records["train"]:
        raise ConfigError(f"{cfg.dataset} has no training records (train.jsonl is missing or empty)")
    task.check_records(records)  # rows the task cannot train on fail before the model loads
    quantized = cfg.quantized if cfg.quantized is not None else mx.default_device() == mx.gpu
    model, tokenizer, model_config = task.load_model(quantized, split is not None, log)
    mx.random.seed(cfg.seed)  # adapter initialisation
    if cfg.resume_adapter_file:
        directory = cfg.resume_adapter_file
        if directory.endswith(".safetensors"):
            directory = os.path.dirname(directory) or "."
        spec = adapters.load_adapters(model, directory)
        log(f"continuing from the adapters in {directory}")
    elif split is not None:
        split.add(model, spec)
    else:
        adapters.apply_adapters(model, spec)
    spec = task.adapter_spec(model, spec)
    splits = task.datasets(model, tokenizer, records, log)
    trainable, total = adapters.trainable_count(model)
    log(task.parameters_line(spec.fine_tune_type, trainable, total))
    return {"model": model, "tokenizer": tokenizer, "model_config": model_config, "spec": spec, "splits": splits}


def check_tensor_parallel(config: FinetuneConfig, task: Task | None = None) -> None:
    """Refuse what a fine-tuning run split over its ranks (``distributed_strategy="tensor_parallel"``)
    cannot do yet: continue from adapter files, or what its task cannot do on a split model (a DPO
    reference that is the model with its adapters off: the split adapters cannot be switched off).

    Example: ``check_tensor_parallel(FineTuneConfig(train_mode="dpo", distributed_strategy="tensor_parallel"))``
    raises ConfigError.
    """
    if config.distributed_strategy != "tensor_parallel":
        return
    if config.resume_adapter_file:
        raise ConfigError("--resume-adapter-file cannot go with --strategy tensor_parallel: the adapters would be "
                          "added before the model is split. Continue a run with --resume, or use --strategy "
                          "data_parallel")
    (task or task_for(config)).check_tensor_parallel()


def recompute_setting(config: FinetuneConfig, model: Any, log: Any = print) -> FinetuneConfig:
    """``config``, with attention recomputation (``gradient_checkpointing: attention``, or ``auto``, finetune's
    default) turned off where ``model`` has no block with an attention module to recompute (said in the log).
    A task may have settled ``auto`` already (``Task.settings``: GRPO recomputes whole blocks).

    Example: ``recompute_setting(FineTuneConfig(model="base", data="data"), model).gradient_checkpointing``
    -> ``"auto"`` for an mlx-lm llama.
    """
    from mlx_train.training.recompute import find_attention, find_blocks

    if config.gradient_checkpointing not in ("attention", "auto"):
        return config
    try:
        blocks = find_blocks(model, config.checkpoint_modules)
    except ConfigError:
        blocks = []
    if any(find_attention(block) is not None for _, block in blocks):
        return config
    log(f"gradient_checkpointing: {config.gradient_checkpointing} finds no attention module in this model's "
        "blocks: nothing is recomputed (set gradient_checkpointing: true to recompute whole blocks)")
    return config.replace(gradient_checkpointing=False)


def _loss_for(cfg: FinetuneConfig) -> Any:
    """The loss of the run's task (``task_for(cfg).loss()``)."""
    return task_for(cfg).loss()


def finetune(config: FinetuneConfig, callbacks: list[Any] | None = None, resume: str | None = None,
             overwrite: bool = False, log: Any = print, trainer_class: Any = None,
             split: AdapterSplit | None = None) -> dict[str, Any]:
    """Fine-tune ``config.model`` on ``config.dataset``; returns the trainer, model, history and final
    validation loss/perplexity. Adapters are written to ``config.adapter_path`` (in the run directory)
    in mlx-lm's format, and the run directory gets config.yaml, metrics.jsonl and checkpoints, as with
    ``mlx-train train``. ``resume`` ("auto" or a checkpoint) continues a run; ``overwrite`` moves a run
    that is in the run directory aside first. ``trainer_class``: ``DistributedTrainer`` on the ranks of a
    launched group (``mlx-train finetune --distributed``; ``batch_size`` is then per rank); ``split``: the
    model is split over the group's ranks (``distributed_strategy="tensor_parallel"``; each rank trains on
    the whole batch and the adapters are written whole).

    The run's task (``result["task"]``, from ``train_mode``) builds the rows and the loss, counts what is
    trained (``result["trained"]``: tokens, or pairs) and adds its metrics, adapter facts and card facts.

    Example: ``finetune(FineTuneConfig(model="base", data="data", iters=50))["val_perplexity"]``.
    """
    from mlx_train import transforms
    from mlx_train.llm import card, data, models
    from mlx_train.training import Trainer

    trainer_class = trainer_class or Trainer
    config = adapter_file_settings(config, log)  # continued adapters keep their own settings
    task = task_for(config)  # picked once: the rest asks it
    check_before_loading(config, resume, overwrite, log, launched=trainer_class is not Trainer)
    config = task.settings(config, log)
    if split is not None:
        check_tensor_parallel(config, task)
    parts = prepare(config, log, split, task)
    model, splits = parts["model"], parts["splits"]
    if config.test and "test" not in splits:  # an empty test.jsonl, or a dataset without a test split
        raise ConfigError(f"--test: {config.dataset} has no test records to evaluate on; add some, or leave --test "
                          "out")
    train_rows, valid_rows = splits["train"], splits.get("valid")
    if valid_rows is None:  # as mlx_lm.lora, train without validation, and say so
        log(f"no validation: {config.dataset} has no validation records (valid.jsonl is missing or empty), so no "
            "validation loss is reported; add rows to valid.jsonl to validate")
    _check_one_step(config, train_rows, trainer_class is not Trainer)
    # A loader batch is a micro-batch; the Trainer takes gradient_accumulation of them per optimizer step.
    gather = task.gathers_positions()
    loader = data.make_loader(train_rows, config.batch_size, seed=config.seed, num_workers=config.num_workers,
                              positions=gather, repeat=task.batch_repeats())
    options = {"strategy": config.distributed_strategy} if trainer_class is not Trainer else {}
    transforms.apply_fast_paths(model, log)  # blocked attention, a lean SwiGLU where validated; logged
    config = recompute_setting(config, model, log)
    # training mode, as mlx_lm.lora sets it (mlx_lm.load leaves a model in eval mode): the loss takes eval
    # mode (which the Trainer's evaluation sets) for an evaluation, and leaves out the gradient work then
    model.train()
    # The Trainer records the whole config (checkpoints, config.yaml): a resume continues the same task.
    trainer = trainer_class(model, loss_fn=task.loss(), config=_for_trainer(config), **options)
    # Checkpoints of a run with a frozen base hold the trained parameters and this reference.
    trainer.base_model = models.base_reference(config.model) if os.path.exists(config.model) else \
        {"path": config.model}
    counter = task.counter()
    adapter_dir = path_in_run(config, config.adapter_path)
    extra = {"model": config.model, "data": config.dataset, "max_seq_length": config.max_seq_length,
             "seed": config.seed, "mask_prompt": config.mask_prompt, "pack": config.pack, **task.adapter_facts()}
    writer = AdapterWriter(parts["spec"], adapter_dir, extra, split, task.adapter_weights)
    val = None
    eval_rows = config.eval_batch_size or config.batch_size
    if valid_rows is not None:  # the same collate (padding to a multiple of 8) as training, in file order
        rows = valid_rows.head(config.val_batches * eval_rows) if config.val_batches else valid_rows
        val = data.make_loader(rows, eval_rows, shuffle=False, num_workers=0, drop_last=False, positions=gather)
    # epochs: null (mlx_lm.lora's iters) -> the Trainer passes over the data as often as max_steps needs
    history = trainer.train(train_dataset=loader, val_dataset=val, resume=resume,
                            callbacks=[counter, writer, *task.callbacks(), *(callbacks or [])])
    result: dict[str, Any] = {"trainer": trainer, "model": model, "tokenizer": parts["tokenizer"], "history": history,
                              "adapter_path": adapter_dir, "task": task, **task.result_counts(counter)}
    if val is not None:
        result["val_metrics"] = trainer.evaluate(val)
        result["val_loss"] = result["val_metrics"]["loss"]
        _record_final_validation(trainer, config, result["val_metrics"])
    test_rows = None
    if config.test and "test" in splits:
        test_rows = splits["test"].head(config.test_batches * eval_rows) if config.test_batches else splits["test"]
    task.evaluate(trainer, result, test_rows, eval_rows)
    if trainer.is_main:
        result["card"] = card.card_facts(config, result, task)
        card.write_model_card(adapter_dir, result["card"])
    return result


def _record_final_validation(trainer: Any, config: FinetuneConfig, metrics: dict[str, float]) -> None:
    """The validation after the last step, in metrics.jsonl as mlx_lm.lora validates at its last iteration
    (unless the run's own validation fell on that step)."""
    state = trainer.state
    if not config.run_dir or not trainer.is_main or state.last_val.get("step") == state.step:
        return
    from mlx_train.training.loggers import MetricsLogger

    MetricsLogger.append(config.run_dir, "val", {"step": state.step, "epoch": state.epoch,
                                                 **{f"val_{k}": v for k, v in metrics.items()}})


def check_fuse_target(model: str | None, fuse: str) -> None:
    """Refuse a ``--fuse`` directory that is not new or empty (the fused model's files would mix with what is
    there), or that is, or is inside, a base model's directory (the fused weights would replace the base ones,
    whose sha256 the run's checkpoints pin). A directory beside a ``.gguf`` base is fine: nothing there is the
    base but the file.

    Example: ``check_fuse_target("SmolLM2-135M-Instruct.Q4_1.gguf", "smol-tuned")`` passes for a new directory.
    """
    target = os.path.realpath(fuse)
    if model and os.path.isdir(model):  # a repo id is mlx-lm's cache, not a place we write; a file is only itself
        base = os.path.realpath(model)
        if target == base or target.startswith(base + os.sep):
            raise ConfigError(f"--fuse {fuse} is inside the base model's directory {base}: the fused weights would "
                              "overwrite the base that the run's checkpoints were trained on; give --fuse a new "
                              "directory")
    if os.path.exists(fuse) and not os.path.isdir(fuse):
        which = " (the base model)" if model and target == os.path.realpath(model) else ""
        raise ConfigError(f"--fuse {fuse} is a file{which}: --fuse writes a model directory; give it a new directory")
    if os.path.isdir(fuse) and os.listdir(fuse):
        shown = sorted(os.listdir(fuse))
        raise ConfigError(f"--fuse {fuse} is not empty ({', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''}): "
                          "the fused model is written only into a new or empty directory, so that nothing of another "
                          "model is mixed with it; give --fuse a new directory, or move that one aside first")


def fuse_model(model_path: str, adapter_path: str, save_path: str, dequantize: bool = False) -> str:
    """Load a base model, add the adapters of ``adapter_path``, fold them in and write an mlx-lm
    model directory (``mlx_lm.load(save_path)`` reads it), with the adapters' model card when they
    have one. Works for GGUF bases too; a vision-language base gives an mlx-vlm model directory
    (``mlx_vlm.load(save_path)``: ``mlx_train.llm.vision.models.fuse``).

    ``save_path`` must be a new or empty directory, outside a base model's directory (``check_fuse_target``).

    Example: ``fuse_model("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/a/adapters", "smol-tuned")``.
    """
    from mlx_train.llm import adapters, card, models
    from mlx_train.llm.vision import models as vision

    check_fuse_target(model_path, save_path)
    if vision.vision_model_type(model_path):  # an mlx-vlm model directory, which mlx_vlm.load reads
        vision.fuse(model_path, adapter_path, save_path, dequantize=dequantize)
        card.write_fused_card(adapter_path, save_path)
        return save_path
    model, tokenizer, config = models.load_model(model_path, quantized=not dequantize)
    adapters.load_adapters(model, adapter_path)
    adapters.fuse_adapters(model, dequantize=dequantize)
    if dequantize:
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    models.save_model(model, tokenizer, config, save_path)
    card.write_fused_card(adapter_path, save_path)
    return save_path
