"""The Trainer: a flat loop around one compiled step."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_train.config import TrainConfig, parse_every
from mlx_train.data import DataLoader
from mlx_train.errors import ConfigError
from mlx_train.training import state as train_state
from mlx_train.training.callbacks import CallbackList, EarlyStopping, ModelCheckpoint
from mlx_train.training.heartbeat import Heartbeat
from mlx_train.training.loggers import MetricsLogger, ProgressBar
from mlx_train.training.losses import Loss, batch_size_of
from mlx_train.training.oom import MemoryGuard, out_of_memory
from mlx_train.training.recompute import enable_gradient_checkpointing
from mlx_train.training.step import Steps


class Trainer:
    """Trains an ``mlx.nn.Module`` with an ``mlx.optimizers.Optimizer``.

    ``batch_size`` is the micro-batch per device; each optimizer step sees
    ``batch_size * gradient_accumulation`` samples. Every other knob is a ``TrainConfig``
    field, given as ``config=`` or as a keyword (``precision="bfloat16"``, ``max_grad_norm=1.0``).

    Example::

        trainer = Trainer(model=model, optimizer=optim.AdamW(1e-3), batch_size=32, gradient_accumulation=4)
        history = trainer.train(train_dataset=(x, y), val_dataset=(vx, vy), epochs=10,
                                checkpoint_dir="checkpoints")
        metrics = trainer.evaluate((tx, ty))      # {"loss": ..., "accuracy": ...}
    """

    #: Builds the compiled steps; DistributedTrainer uses one that also reduces gradients its way.
    steps_class: type = Steps

    def __init__(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer | None = None,
        loss_fn: Callable | None = None,
        device_config: Any = None,
        batch_size: int | None = None,
        gradient_accumulation: int | None = None,
        config: TrainConfig | None = None,
        **overrides: Any,
    ) -> None:
        given = {k: v for k, v in (("batch_size", batch_size), ("gradient_accumulation", gradient_accumulation)) if v is not None}
        self.config = (config or TrainConfig()).replace(**given, **overrides)
        if device_config is not None and hasattr(device_config, "apply"):
            device_config.apply()
        self.device_config = device_config
        self.model = model
        if optimizer is None:
            from mlx_train.optim import build_optimizer

            optimizer = build_optimizer(self.config)
        self.optimizer = optimizer
        self.loss = Loss(loss_fn)
        self.group = None
        self.step, self.epoch, self.epochs = 0, 0, None
        self.history: dict[str, list] = {}
        self.stop_training = False
        self.total_steps: int | None = None
        self._steps: Steps | None = None
        self._metrics: dict[str, mx.array] = {}
        self._last_val: dict = {}
        self._seeded = False
        self._loaders: tuple | None = None
        self._saved_step: int | None = None
        # Seconds of gradient communication per optimizer step. It happens inside the compiled
        # step, so it cannot be timed apart: distributed code sets an estimate here, and reports
        # show it as time_comm, taken out of time_compute (0 on one process).
        self.comm_seconds: float = 0.0
        # Runs the steps and recovers from out-of-memory; keeps the micro-batch it settled on.
        self.memory_guard: MemoryGuard | None = None

    # -- public API ---------------------------------------------------------------------

    def train(self, train_dataset: Any = None, val_dataset: Any = None, epochs: int | None = None,
              checkpoint_dir: str | None = None, callbacks: list | None = None, resume: str | None = None) -> dict:
        """Train on a dataset (arrays, map-style or iterable); returns the per-epoch history.

        Called again without datasets, it continues on the datasets of the previous call
        (``trainer.train(callbacks=[...])`` trains ``epochs`` more epochs).
        """
        if train_dataset is None:
            if self._loaders is None:
                raise ConfigError("train() needs a train_dataset: none was given and there is no earlier "
                                  "train() call whose datasets could be reused")
            loader, val_loader = self._loaders
            epochs = self._epoch_of(loader) + (epochs or self.config.epochs)
            return self._run(loader, val_loader, epochs, checkpoint_dir, callbacks or [], resume)
        cfg = self.config
        step_batch = cfg.batch_size * cfg.gradient_accumulation
        loader = train_dataset if isinstance(train_dataset, DataLoader) else DataLoader(
            train_dataset, batch_size=step_batch, shuffle=cfg.shuffle, num_workers=cfg.num_workers,
            drop_last=cfg.drop_last, seed=cfg.seed)
        val_loader = None if val_dataset is None else self._eval_loader(val_dataset)
        self._loaders = (loader, val_loader)
        return self._run(loader, val_loader, epochs, checkpoint_dir, callbacks or [], resume)

    def fit(self, train_loader: Iterable, val_loader: Iterable | None = None, epochs: int | None = None,
            save_best: bool = True, callbacks: list | None = None) -> dict:
        """Train from DataLoaders (or any iterable of batches); returns the per-epoch history.

        With ``save_best`` the best weights by ``val_loss`` go to ``best_model.safetensors`` (in
        ``run_dir`` when set). A DataLoader's batch is a micro-batch: with gradient accumulation
        each optimizer step takes ``gradient_accumulation`` of them. Other iterables give one
        optimizer step per item.
        """
        callbacks = list(callbacks or [])
        if save_best and val_loader is not None:
            import os

            callbacks.append(ModelCheckpoint(os.path.join(self.config.run_dir or ".", "best_model.safetensors"),
                                             monitor="val_loss", save_best_only=True))
        accumulation = self.config.gradient_accumulation
        if isinstance(train_loader, DataLoader) and accumulation > 1:
            train_loader = train_loader.replace(batch_size=train_loader.batch_size * accumulation)
        return self._run(train_loader, val_loader, epochs, self.config.checkpoint_dir, callbacks, None)

    def evaluate(self, dataset: Any) -> dict[str, float]:
        """Loss (and accuracy for classification) over a whole dataset or loader."""
        self._build()
        loader = dataset if isinstance(dataset, DataLoader) else self._eval_loader(dataset)
        metrics = self._evaluate_loader(loader)
        return {k.removeprefix("val_"): v for k, v in metrics.items() if k != "val_time"}

    def predict(self, dataset: Any) -> mx.array:
        """Model outputs for every sample, in dataset order."""
        from mlx_train.training.losses import split_parts

        loader = dataset if isinstance(dataset, DataLoader) else self._eval_loader(dataset)
        self.model.eval()
        outputs = []
        for batch in loader:
            outputs.append(self.model(split_parts(batch).inputs))
            mx.async_eval(outputs[-1])
        self.model.train()
        return mx.concatenate(outputs, axis=0)

    @property
    def is_main(self) -> bool:
        """True on the process that writes files and prints (rank 0, or the only process)."""
        return self.group is None or self.group.rank() == 0

    def log(self, message: str) -> None:
        """Print a message from the training run (rank 0 only when distributed); with a
        ``run_dir``, also append it to ``RUN_DIR/train.log``."""
        if self.is_main:
            print(message, flush=True)
            if self.config.run_dir:
                os.makedirs(self.config.run_dir, exist_ok=True)
                with open(os.path.join(self.config.run_dir, "train.log"), "a") as log_file:
                    log_file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    # -- the loop -----------------------------------------------------------------------

    def _run(self, loader, val_loader, epochs, checkpoint_dir, callbacks, resume) -> dict:
        cfg = self.config
        self.epochs = epochs = epochs or cfg.epochs
        self.stop_training = False
        self._shard(loader, val_loader)
        callbacks = CallbackList(self._default_callbacks() + list(callbacks))
        checkpoints = self._checkpoints(checkpoint_dir or cfg.checkpoint_dir)
        self._build()
        path = self._resume_path(checkpoints, resume)
        if path is not None:
            arrays, saved = self._load(path)
            train_state.restore(self, path, arrays, saved, loader, callbacks)
            self._saved_step = self.step
            self.log(f"resumed from {path} (step {self.step}, epoch {self.epoch + 1})")
        elif not self._seeded:
            mx.random.seed(cfg.seed)
        self._seeded = True
        run_step = self.memory_guard = MemoryGuard(self, cfg.gradient_accumulation, previous=self.memory_guard)
        report, evaluate, save = parse_every(cfg.report_every), parse_every(cfg.eval_every), parse_every(cfg.checkpoint_every)
        self.total_steps = _total_steps(loader, epochs, cfg.max_steps)
        # Step cadences as plain ints: the loop body stays cheap (0 = not by steps).
        report_n, eval_n, save_n = (e.n if e.unit == "step" else 0 for e in (report, evaluate, save))
        per_batch, max_steps = callbacks.has("on_batch_end"), cfg.max_steps
        callbacks.call("on_fit_start", self)
        clock = _Clock(self)
        try:
            while self._epoch_of(loader) < epochs and not self._done():
                self.epoch = self._epoch_of(loader)
                self._metrics = self._metrics or self._steps.zero_metrics()
                callbacks.call("on_epoch_start", self, self.epoch)
                for batch in clock.timed(loader):
                    self._metrics = run_step(batch, self._metrics)
                    self.step += 1
                    clock.count(batch)
                    if per_batch:
                        callbacks.call("on_batch_end", self, self.step)
                    if report_n and self.step % report_n == 0:
                        callbacks.call("on_report", self, clock.report())
                    if eval_n and self.step % eval_n == 0 and val_loader is not None:
                        self._validate(val_loader, callbacks, clock)
                    if save_n and self.step % save_n == 0 and checkpoints:
                        self._save(checkpoints, loader, callbacks, clock)
                    if self.stop_training or (max_steps is not None and self.step >= max_steps):
                        break
                if not self._epoch_complete(loader):
                    break
                self._end_epoch(val_loader, callbacks, clock, evaluate, report)
                if checkpoints and _due(save, "epoch", self.epoch + 1):
                    self._save(checkpoints, loader, callbacks, clock)
                if not isinstance(loader, DataLoader):
                    self.epoch += 1
            if checkpoints and self._saved_step != self.step:
                self._save(checkpoints, loader, callbacks, clock)
        except BaseException as error:
            callbacks.call("on_exception", self, error)
            raise
        finally:
            if checkpoints:
                checkpoints.wait()
        callbacks.call("on_fit_end", self, self.history)
        return self.history

    def _end_epoch(self, val_loader, callbacks, clock, evaluate, report) -> None:
        if not _due(report, "step", self.step) and clock.pending_samples:
            callbacks.call("on_report", self, clock.report())
        m = self._reduce({"loss_sum": self._metrics["loss_sum"], "items": self._metrics["items"]})
        logs = {"train_loss": float((m["loss_sum"] / mx.maximum(m["items"], 1)).item())}
        if val_loader is not None and _due(evaluate, "epoch", self.epoch + 1):
            self._validate(val_loader, callbacks, clock)
        logs.update({k: v for k, v in self._last_val.items() if k not in ("step", "epoch", "val_time")})
        logs["learning_rate"] = float(self.optimizer.learning_rate.item())
        for key, value in {"epoch": self.epoch, **logs}.items():
            self.history.setdefault(key, []).append(value)
        self._metrics = {}
        clock.epoch_reset()
        callbacks.call("on_epoch_end", self, self.epoch, logs)

    def _validate(self, val_loader, callbacks, clock) -> None:
        clock.pause()
        logs = {"step": self.step, "epoch": self.epoch, **self._evaluate_loader(val_loader)}
        self._last_val = logs
        callbacks.call("on_validation_end", self, logs)
        clock.resume()

    def _save(self, checkpoints, loader, callbacks, clock) -> None:
        self._saved_step = self.step
        if not self.is_main:
            return  # only rank 0 writes; every rank holds the same state
        clock.pause()
        arrays, saved = train_state.capture(self, loader, callbacks)
        path = checkpoints.save(self.step, arrays, saved, metrics=self._last_val)
        callbacks.call("on_checkpoint", self, path)
        clock.resume(checkpoint=True)

    # -- pieces -------------------------------------------------------------------------

    def _build(self) -> None:
        if self._steps is not None:
            return
        cfg = self.config
        if cfg.gradient_checkpointing:  # before compiling: the trace goes through the checkpointed blocks
            enable_gradient_checkpointing(self.model, cfg.checkpoint_modules)
        self.optimizer.init(self.model.trainable_parameters())
        self._steps = self.steps_class(self.model, self.optimizer, self.loss, precision=cfg.precision,
                                       max_grad_norm=cfg.max_grad_norm, loss_scale=cfg.loss_scale,
                                       loss_scale_window=cfg.loss_scale_window, compile=cfg.compile,
                                       group=self.group)

    def _done(self) -> bool:
        max_steps = self.config.max_steps
        return self.stop_training or (max_steps is not None and self.step >= max_steps)

    def _epoch_complete(self, loader) -> bool:
        if not isinstance(loader, DataLoader):
            return not self._done()
        if loader.epoch == self.epoch and _length(loader) is not None and loader.position >= _length(loader):
            loader.set_epoch(self.epoch + 1)  # stopped right on the last batch: the epoch is done
        return loader.epoch > self.epoch

    def _epoch_of(self, loader) -> int:
        return loader.epoch if hasattr(loader, "epoch") else self.epoch

    def _eval_loader(self, dataset: Any) -> DataLoader:
        cfg = self.config
        return DataLoader(dataset, batch_size=cfg.eval_batch_size or cfg.batch_size, shuffle=False,
                          num_workers=cfg.num_workers, drop_last=False, seed=cfg.seed)

    def _evaluate_loader(self, loader) -> dict[str, float]:
        start = time.perf_counter()
        self._build()
        metrics = {"loss_sum": mx.array(0.0), "items": mx.array(0.0)}
        self.model.eval()
        try:
            with out_of_memory("evaluation", "set a smaller eval_batch_size"):
                for batch in loader:
                    metrics = self._steps.evaluate(batch, metrics)
                    mx.eval(metrics)
        finally:
            self.model.train()
        values = {k: float(v.item()) for k, v in self._reduce(metrics).items()}
        out = {"val_loss": values["loss_sum"] / max(values["items"], 1.0)}
        if "correct" in values:
            out["val_accuracy"] = values["correct"] / max(values["counted"], 1.0)
        out["val_time"] = time.perf_counter() - start
        return out

    def _shard(self, *loaders) -> None:
        if self.group is None or self.group.size() == 1:
            return
        for loader in loaders:
            if isinstance(loader, DataLoader) and loader.world_size != self.group.size():
                loader.set_shard(self.group.rank(), self.group.size())

    def _reduce(self, values: dict[str, mx.array]) -> dict[str, mx.array]:
        """Sum on-device metrics over ranks (report time only)."""
        if self.group is None or self.group.size() == 1:
            return values
        return {k: mx.distributed.all_sum(v, group=self.group, stream=mx.cpu) for k, v in values.items()}

    def _default_callbacks(self) -> list:
        cfg = self.config
        callbacks: list = [ProgressBar()] if self.is_main else []
        if cfg.run_dir and self.is_main:
            callbacks.append(MetricsLogger(cfg.run_dir))
        if cfg.run_dir:  # every rank: the monitor shows each one's progress and memory
            callbacks.append(Heartbeat(cfg.run_dir))
        if cfg.early_stopping_patience is not None:
            callbacks.append(EarlyStopping(monitor=cfg.monitor, patience=cfg.early_stopping_patience,
                                           min_delta=cfg.early_stopping_min_delta, mode=cfg.monitor_mode))
        return callbacks

    def _checkpoints(self, directory: str | None):
        if not directory:
            return None
        from mlx_train.checkpoint import CheckpointManager

        cfg = self.config
        manager = CheckpointManager(directory, keep_last=cfg.keep_last, keep_best=cfg.keep_best,
                                    monitor=cfg.monitor, mode=cfg.monitor_direction())
        return manager

    def _resume_path(self, checkpoints, resume) -> str | None:
        if not resume:
            return None
        if resume == "auto":
            if checkpoints is None:
                raise ConfigError("resume='auto' needs a checkpoint_dir to look in; pass checkpoint_dir=... or a checkpoint path")
            path = checkpoints.resolve("auto")
            if path is None:
                self.log(f"no complete checkpoint in {checkpoints.directory}; starting from scratch")
            return path
        if checkpoints is not None:
            return checkpoints.resolve(resume)
        return resume

    def _load(self, path: str):
        from mlx_train.checkpoint import load_checkpoint

        return load_checkpoint(path)


def _due(every, unit: str, count: int) -> bool:
    return every.unit == unit and every.due(count)


def _length(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _total_steps(loader, epochs: int, max_steps: int | None) -> int | None:
    per_epoch = _length(loader)
    candidates = [x for x in (max_steps, per_epoch * epochs if per_epoch else None) if x]
    return min(candidates) if candidates else None


class _Clock:
    """Counts samples/tokens and train time (excluding validation and saving) between reports.

    It also splits the step time: waiting for the loader (``timed``), the step itself (from a
    batch's arrival to ``count``) and checkpoint saves (``resume(checkpoint=True)``). Validation
    is left out of all of them.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.start = time.perf_counter()
        self.paused = 0.0
        self.pending_samples = 0
        self.pending_steps = 0
        self.trained_samples = 0
        self.last_loss_sum, self.last_items = 0.0, 0.0
        if trainer._metrics:  # resumed (or continued) mid-epoch: the running sums hold earlier steps
            self.last_loss_sum, self.last_items = self._totals()
        self.data_seconds = self.step_seconds = self.checkpoint_seconds = 0.0
        self._fetched = self.start
        mx.reset_peak_memory()

    def _totals(self) -> tuple[float, float]:
        """The epoch's running loss sum and item count, summed over ranks."""
        t = self.trainer
        totals = t._reduce({"loss_sum": t._metrics["loss_sum"], "items": t._metrics["items"]})
        return float(totals["loss_sum"].item()), float(totals["items"].item())

    def timed(self, loader: Iterable) -> Iterable:
        """Iterate ``loader``, adding the time spent waiting for each batch to ``data_seconds``."""
        start = time.perf_counter()
        iterator = iter(loader)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                self.data_seconds += time.perf_counter() - start
                return
            self._fetched = time.perf_counter()
            self.data_seconds += self._fetched - start
            yield batch
            start = time.perf_counter()

    def count(self, batch: Any) -> None:
        self.step_seconds += time.perf_counter() - self._fetched
        self.pending_samples += batch_size_of(batch)
        self.pending_steps += 1

    def pause(self) -> None:
        self._pause_start = time.perf_counter()

    def resume(self, checkpoint: bool = False) -> None:
        seconds = time.perf_counter() - self._pause_start
        self.paused += seconds
        if checkpoint:
            self.checkpoint_seconds += seconds

    def epoch_reset(self) -> None:
        self.last_loss_sum, self.last_items = 0.0, 0.0

    def report(self) -> dict:
        t = self.trainer
        now = time.perf_counter()
        seconds = max(now - self.start - self.paused, 1e-9)
        loss_sum, items = self._totals()
        world = t.group.size() if t.group is not None else 1
        d_items = items - self.last_items
        self.trained_samples += self.pending_samples * (t.group.size() if t.group is not None else 1)
        logs = {
            "step": t.step,
            "epoch": t.epoch,
            "loss": (loss_sum - self.last_loss_sum) / max(d_items, 1e-9),
            "learning_rate": float(t.optimizer.learning_rate.item()),
            "samples_per_second": self.pending_samples * world / seconds,
            "steps_per_second": self.pending_steps / seconds,
            "trained_samples": self.trained_samples,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
        }
        if d_items > self.pending_samples * world * 1.5:  # sequences: items are tokens
            logs["tokens_per_second"] = d_items / seconds
        if "grad_norm" in t._metrics:
            logs["grad_norm"] = float(t._metrics["grad_norm"].item())
        logs.update(self._step_times(seconds))
        self.last_loss_sum, self.last_items = loss_sum, items
        self.pending_samples = self.pending_steps = 0
        self.start, self.paused = now, 0.0
        self.data_seconds = self.step_seconds = self.checkpoint_seconds = 0.0
        mx.reset_peak_memory()
        return logs

    def _step_times(self, train_seconds: float) -> dict[str, float]:
        """Seconds per optimizer step since the last report: the wall time and where it went."""
        steps = max(self.pending_steps, 1)
        step = self.step_seconds / steps
        comm = min(max(self.trainer.comm_seconds, 0.0), step)
        return {
            "step_time": (train_seconds + self.checkpoint_seconds) / steps,
            "time_data": self.data_seconds / steps,
            "time_compute": step - comm,
            "time_comm": comm,
            "time_checkpoint": self.checkpoint_seconds / steps,
        }
