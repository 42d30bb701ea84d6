"""The Trainer: a flat loop around one step function and one loop state."""

from __future__ import annotations

import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_train import rundir
from mlx_train.checkpointing.manager import CheckpointManager, CheckpointWarning
from mlx_train.config import TrainConfig
from mlx_train.data import DataLoader
from mlx_train.errors import (
    CheckpointError,
    ConfigError,
    MLXTrainError,
    NonFiniteError,
    TrainingInterrupted,
)
from mlx_train.run_directory import RunDirectory
from mlx_train.training.callbacks import CallbackList, EarlyStopping, ModelCheckpoint
from mlx_train.training.evaluation import Evaluator
from mlx_train.training.extensions import StepExtension
from mlx_train.training.finite import FiniteWatch
from mlx_train.training.heartbeat import Heartbeat
from mlx_train.training.interrupt import StopSignals
from mlx_train.training.labels import LabelCheck
from mlx_train.training.loggers import MetricsLogger, ProgressBar
from mlx_train.training.losses import Loss, metric_means
from mlx_train.training.meter import Meter, report_window
from mlx_train.training.oom import MemoryGuard, MemoryPolicy, any_rank
from mlx_train.training.resume import keep_global_batch
from mlx_train.training.schedule import Cadences, at_epoch_end, length_of, nonfinite_inputs, total_steps
from mlx_train.training.state import LoopState, summed_over_ranks
from mlx_train.training.step import Reduction, StepOptions, TrainStep, build_step


class Trainer:
    """Trains an ``mlx.nn.Module`` with an ``mlx.optimizers.Optimizer``.

    ``batch_size`` is the micro-batch per device; each optimizer step sees
    ``batch_size * gradient_accumulation`` samples. Every other knob is a ``TrainConfig``
    field, given as ``config=`` or as a keyword (``precision="bfloat16"``, ``max_grad_norm=1.0``).
    Everything a checkpoint holds is in ``trainer.state`` (a ``LoopState``).

    The step path never waits for the device: a NaN/Inf loss or gradient is looked for at the next
    report, validation, checkpoint or epoch end (and at the end of the run), where
    ``nonfinite="raise"``/``"stop"`` act and name the step it happened at; nothing after that step
    is ever saved or kept as best. With ``"skip"`` the step undoes its own update as it runs.

    Example::

        trainer = Trainer(model=model, optimizer=optim.AdamW(1e-3), batch_size=32, gradient_accumulation=4)
        history = trainer.train(train_dataset=(x, y), val_dataset=(vx, vy), epochs=10,
                                checkpoint_dir="checkpoints")
        metrics = trainer.evaluate((tx, ty))      # {"loss": ..., "accuracy": ...}
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer | None = None,
        loss_fn: Callable[..., Any] | None = None,
        device_config: Any = None,
        batch_size: int | None = None,
        gradient_accumulation: int | None = None,
        config: TrainConfig | None = None,
        **overrides: Any,
    ) -> None:
        given = {k: v for k, v in (("batch_size", batch_size), ("gradient_accumulation", gradient_accumulation))
                 if v is not None}
        self.config = (config or TrainConfig()).replace(**given, **overrides)
        if device_config is not None and hasattr(device_config, "apply"):
            device_config.apply()
        self.device_config = device_config
        _check_model(model)
        self.model = model
        if optimizer is None:
            from mlx_train.optim import build_optimizer

            optimizer = build_optimizer(self.config)
        self.optimizer = optimizer
        self.loss = Loss(loss_fn)
        self.state = LoopState()
        self.state.set_loss_scale(self.config.loss_scale if self.config.precision == "float16" else 1.0)
        self.epochs: int | None = None
        self.total_steps: int | None = None
        self.group: Any = None
        #: Gradient reduction across processes, passed into the step (set by DistributedTrainer).
        self.gradient_reduction: Reduction | None = None
        #: Seconds of gradient communication per step (estimated by distributed training; reports show it
        #: as time_comm, taken out of time_compute).
        self.comm_seconds: float = 0.0
        #: ``with trainer.collective("what"):`` guards a blocking collective (a watchdog when distributed).
        self.collective: Callable[[str], AbstractContextManager[Any]] = lambda what: nullcontext()
        #: Runs the steps and recovers from out-of-memory; keeps the micro-batch it settled on.
        self.memory_guard: MemoryGuard | None = None
        self._loaders: tuple[Any, ...] | None = None
        self._optimizer_ready = False
        self._seeded = False
        self._checkpointed_blocks: str | None = None  # what gradient checkpointing recomputes
        self._saved_step: int | None = None
        self._poisoned = False
        self._signals: StopSignals | None = None
        self._voted_stop = False
        self._watch = FiniteWatch()
        self._epoch_start = (0, 0)  # (step, loader position) where the current epoch's steps began here
        self.evaluator = Evaluator(model, self.loss, self.config.precision, self.config.compile, self.log)

    # -- the loop state, by name ----------------------------------------------------------

    step = property(lambda self: self.state.step, doc="Optimizer steps taken.")
    epoch = property(lambda self: self.state.epoch, doc="The current epoch (0-based).")
    history = property(lambda self: self.state.history, doc="Per-epoch logs: {'train_loss': [...], ...}.")

    @property
    def stop_training(self) -> bool:
        """Set to True (from a callback) to stop after the current step."""
        return self.state.stop_training

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self.state.request_stop(value)

    @property
    def base_model(self) -> dict[str, Any] | None:
        """The frozen base a checkpoint of trainable parameters needs ({"path", "sha256"}), checked on resume."""
        return self.state.base_model

    @base_model.setter
    def base_model(self, value: dict[str, Any] | None) -> None:
        self.state.set_base_model(value)

    @property
    def is_main(self) -> bool:
        """True on the process that writes files and prints (rank 0, or the only process)."""
        return self.group is None or self.group.rank() == 0

    # -- public API ---------------------------------------------------------------------

    def train(self, train_dataset: Any = None, val_dataset: Any = None, epochs: int | None = None,
              checkpoint_dir: str | None = None, callbacks: list[Any] | None = None,
              resume: str | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Train on a dataset (arrays, map-style, iterable or a DataLoader); returns the per-epoch history.

        Called again without datasets, it continues on the datasets of the previous call
        (``trainer.train(callbacks=[...])`` trains ``epochs`` more epochs). A new run (no ``resume``)
        into a ``checkpoint_dir`` or ``run_dir`` that holds another run is refused; ``resume="auto"``
        continues that run, ``overwrite=True`` moves it aside (``<dir>.old-<date>-<time>``) first.

        A DataLoader's batch is a micro-batch, as in ``fit``: with gradient accumulation each optimizer
        step takes ``gradient_accumulation`` of them. A dataset that is not a DataLoader is batched with
        the config's ``batch_size`` (per micro-batch) the same way.
        """
        if train_dataset is None:
            if self._loaders is None:
                raise ConfigError("train() needs a train_dataset: none was given and there is no earlier "
                                  "train() call whose datasets could be reused")
            loader, val_loader = self._loaders
            epochs = _epoch_of(loader, self.state) + (epochs or self.config.epochs or _epochs_for(loader, self.config))
            return self._run(loader, val_loader, epochs, checkpoint_dir, callbacks or [], resume, overwrite)
        cfg = self.config
        loader = self._micro_loader(train_dataset) if isinstance(train_dataset, DataLoader) else DataLoader(
            train_dataset, batch_size=cfg.batch_size * cfg.gradient_accumulation, shuffle=cfg.shuffle,
            num_workers=cfg.num_workers, drop_last=cfg.drop_last, seed=cfg.seed)
        val_loader = val_dataset if val_dataset is None or isinstance(val_dataset, DataLoader) else \
            self._eval_loader(val_dataset)
        self._loaders = (loader, val_loader)
        return self._run(loader, val_loader, epochs, checkpoint_dir, callbacks or [], resume, overwrite)

    def fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None = None, epochs: int | None = None,
            save_best: bool = True, callbacks: list[Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Train from DataLoaders (or any iterable of batches); returns the per-epoch history.

        With ``save_best`` the best weights by ``val_loss`` go to ``best_model.safetensors`` in
        ``run_dir``, or without one in the current directory, where a file of that name from before
        is refused rather than replaced (``overwrite=True`` replaces it; like ``train``, it also moves
        a previous run in ``run_dir``/``checkpoint_dir`` aside). A DataLoader's batch is a micro-batch:
        with gradient accumulation each optimizer step takes ``gradient_accumulation`` of them. Other
        iterables give one optimizer step per item.
        """
        callbacks = list(callbacks or [])
        if save_best and val_loader is not None:
            best = os.path.join(self.config.run_dir or ".", "best_model.safetensors")
            if not (self.config.run_dir or overwrite or self.state.step) and os.path.exists(best):
                raise ConfigError(f"fit(save_best=True) would replace {os.path.abspath(best)}, written before this "
                                  "run; give the run a place (Trainer(..., run_dir=...)), pass overwrite=True to "
                                  "replace it, or save_best=False")
            callbacks.append(ModelCheckpoint(best, monitor="val_loss", save_best_only=True))
        loader = self._micro_loader(train_loader) if isinstance(train_loader, DataLoader) else train_loader
        return self._run(loader, val_loader, epochs, self.config.checkpoint_dir, callbacks, None, overwrite)

    def evaluate(self, dataset: Any) -> dict[str, float]:
        """Loss (and accuracy for classification) over a whole dataset or loader."""
        loader = dataset if isinstance(dataset, DataLoader) else self._eval_loader(dataset)
        metrics = self._evaluate_loader(loader)
        return {k.removeprefix("val_"): v for k, v in metrics.items() if k != "val_time"}

    def predict(self, dataset: Any) -> mx.array:
        """Model outputs for every sample, in dataset order."""
        return self.evaluator.predict(dataset if isinstance(dataset, DataLoader) else self._eval_loader(dataset))

    def log(self, message: str) -> None:
        """Print a message from the training run (rank 0 only when distributed); with a
        ``run_dir``, also append it to ``RUN_DIR/train.log``."""
        if self.is_main:
            rundir.log_message(self.config.run_dir, message)

    # -- the loop -----------------------------------------------------------------------

    def _run(self, loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int | None,
             checkpoint_dir: str | None, callbacks: Any, resume: str | None, overwrite: bool = False) -> dict[str, Any]:
        cfg, state = self.config, self.state
        self._shard(loader, val_loader)  # first: epochs: null counts this rank's batches
        self.epochs = epochs = epochs or cfg.epochs or _epochs_for(loader, cfg)
        state.request_stop(False)
        callbacks = CallbackList(self._default_callbacks() + list(callbacks))
        checkpoints = self._checkpoints(checkpoint_dir or cfg.checkpoint_dir)
        run = RunDirectory(cfg.run_dir, checkpoints=checkpoints)
        if overwrite and resume:
            raise ConfigError(f"overwrite=True starts over and resume={resume!r} continues: pass one of them")
        fresh = not resume and state.step == 0  # a new run, not this trainer's next train() call
        if fresh and overwrite and self.is_main:
            run.make_room(True, self.log)
        with run.locks(self.is_main), StopSignals(self.log, lambda: state.step) as signals:
            if fresh and self.is_main:  # the other ranks may already see the files rank 0 writes
                run.refuse_fresh_start()
            self._signals, self._voted_stop = signals, False
            if self.gradient_reduction is not None and self.gradient_reduction.state is not None:
                self.gradient_reduction.state["stop"] = mx.array(0.0)  # not the sum that ended a previous run
            loader = self._start(run, resume, loader, callbacks)  # resized to keep a global batch
            step = self.memory_guard = self._guard(callbacks)
            every = Cadences(cfg)
            periods = _step_periods(every)
            stop_at = math.inf if self.config.max_steps is None else self.config.max_steps
            self.total_steps = total_steps(loader, epochs, cfg.max_steps)
            meter = Meter(state, self._batch_ranks())
            meter.comm_seconds = self.comm_seconds
            per_batch = callbacks.has("on_batch_end")
            voting = self.group is not None and self.group.size() > 1
            labels = LabelCheck.for_run(self.loss, self.model, loader)
            advance, count, mark = state.advance, meter.count, self._watch.add  # the step path's calls, found once
            callbacks.call("on_fit_start", self)
            try:
                while _epoch_of(loader, state) < epochs and not self._done():
                    self._begin_epoch(loader, callbacks)
                    due = _next_due(periods, state.step)
                    # The step path: nothing here waits for the device. A NaN/Inf is looked for at the next
                    # report, validation, checkpoint or epoch end (``_check_finite``), which names its step.
                    for batch in meter.timed(loader):
                        if labels is not None:
                            labels.batch(batch)  # a no-op when the whole dataset was checked at start
                        running = step(state, batch)
                        advance(running, count(batch))
                        mark(running)
                        if voting:
                            self._vote_stop(signals)
                        if per_batch:
                            callbacks.call("on_batch_end", self, state.step)
                        if state.step >= due:
                            self._boundary(loader, val_loader, checkpoints, callbacks, meter, every)
                            due = _next_due(periods, state.step)
                        if checkpoints:
                            checkpoints.raise_failed_save()
                        # A cheap look first (the same conditions, read directly): _done() decides.
                        if (state.step >= stop_at or state.stop_training or signals.requested is not None
                                or self._voted_stop) and self._done():
                            break
                    # Non-finite weights (found now or at a look during the epoch) never reach an epoch's end.
                    if self._check_finite(loader) or self._poisoned or not self._epoch_complete(loader):
                        break
                    self._end_epoch(loader, val_loader, callbacks, meter, every)
                    due_save = every.save.by_epoch(state.epoch + 1) or every.save.by_step(state.step)
                    if checkpoints and due_save and self._saved_step != state.step:
                        self._save(checkpoints, loader, callbacks, meter)
                self._check_finite(loader)
                if checkpoints and self._saved_step != state.step:
                    self._save(checkpoints, loader, callbacks, meter)
                if checkpoints:
                    checkpoints.wait()
                if self._stop_requested():  # in a group, the vote: a signal after the last step is too late
                    raise self._interruption(signals.requested or signal.SIGTERM, checkpoints)
            except BaseException as error:
                callbacks.call("on_exception", self, error)
                raise
            finally:
                if checkpoints:
                    checkpoints.wait(raise_error=False)
                state.record_micro_batch(step.settings())  # where memory recovery settled: the next train() call
            # Still under the signal handlers: a late SIGTERM cannot cut on_fit_end short (the run is saved).
            history = self._history_with_open_epoch()
            callbacks.call("on_fit_end", self, history)
        return history

    def _history_with_open_epoch(self) -> dict[str, list[Any]]:
        """The history, plus the epoch the run stopped in when it stopped before that epoch's end (a run
        counted in steps): its train_loss so far and the last validation. Checkpoints keep only whole epochs."""
        state = self.state
        if state.epoch_done or not state.running:
            return state.history
        totals = self._totals()
        if not totals["items"]:
            return state.history
        logs: dict[str, Any] = {"epoch": state.epoch, "train_loss": totals["loss_sum"] / max(totals["items"], 1.0)}
        logs.update(metric_means(totals, totals["items"], "train_"))
        logs.update({k: v for k, v in state.last_val.items() if k not in ("step", "epoch", "val_time")})
        logs["learning_rate"] = float(self.optimizer.learning_rate.item())
        history = {k: list(v) for k, v in state.history.items()}
        for key, value in logs.items():
            history.setdefault(key, []).append(value)
        return history

    def _begin_epoch(self, loader: Iterable[Any], callbacks: CallbackList) -> None:
        state = self.state
        epoch = _epoch_of(loader, state)
        if epoch != state.epoch or not state.running:  # a new epoch (a resumed one keeps its sums)
            state.begin_epoch(epoch, self.memory_guard.step.zero_running())  # type: ignore[union-attr]  # set by _run
        self._watch.start(state.running, state.step)
        self._epoch_start = (state.step, loader.position if isinstance(loader, DataLoader) else 0)
        callbacks.call("on_epoch_start", self, state.epoch)

    def _end_epoch(self, loader: Iterable[Any], val_loader: Iterable[Any] | None, callbacks: CallbackList,
                   meter: Meter, every: Cadences) -> None:
        state = self.state  # (the loop looked for non-finite steps right before)
        if not every.report.by_step(state.step) and meter.pending:
            self._report(loader, callbacks, meter)
        totals = self._totals()
        logs = {"train_loss": totals["loss_sum"] / max(totals["items"], 1.0)}
        logs.update(metric_means(totals, totals["items"], "train_"))
        if val_loader is not None and every.validate.by_epoch(state.epoch + 1):
            self._validate(loader, val_loader, callbacks, meter)
        logs.update({k: v for k, v in state.last_val.items() if k not in ("step", "epoch", "val_time")})
        logs["learning_rate"] = float(self.optimizer.learning_rate.item())
        logs.update(callbacks.report_metrics())
        state.end_epoch(logs)
        callbacks.call("on_epoch_end", self, state.epoch, logs)

    def _boundary(self, loader: Iterable[Any], val_loader: Iterable[Any] | None,
                  checkpoints: CheckpointManager | None, callbacks: CallbackList, meter: Meter,
                  every: Cadences) -> None:
        """What is due after this step by the step cadences: a report, a validation, a save. Each first looks
        for non-finite steps (``_check_finite``)."""
        step = self.state.step
        if every.report.by_step(step):
            self._report(loader, callbacks, meter)
        if every.validate.by_step(step) and val_loader is not None:
            self._validate(loader, val_loader, callbacks, meter)
        # A save due on an epoch's last step waits for the epoch's end: the checkpoint then
        # holds its validation, history and callback decisions, and a resume does not redo them.
        if every.save.by_step(step) and checkpoints and not at_epoch_end(loader):
            self._save(checkpoints, loader, callbacks, meter)

    def _report(self, loader: Iterable[Any], callbacks: CallbackList, meter: Meter) -> None:
        """One report: a look for non-finite steps, one read of the running sums (summed over ranks), the logs
        built once for the callbacks that take reports. The loop's largest host work between two steps (one
        report every 10 steps by default): each value is read once and no dict is built twice."""
        self._check_finite(loader)
        state = self.state
        grad_norm = state.running.get("grad_norm")
        totals = self._totals()
        window = report_window(totals, state.report_base)
        logs = meter.report(window, float(self.optimizer.learning_rate.item()),
                            None if grad_norm is None else float(grad_norm.item()))  # type: ignore[arg-type]
        state.close_window(totals, window["items"])  # the window was read (and summed over ranks): the next starts
        if callbacks.has_metrics:
            logs.update(callbacks.report_metrics())
        callbacks.call("on_report", self, logs)

    def _validate(self, loader: Iterable[Any], val_loader: Iterable[Any], callbacks: CallbackList,
                  meter: Meter) -> None:
        self._check_finite(loader)
        meter.pause()
        with callbacks.validation_weights(self.model):
            logs = {"step": self.state.step, "epoch": self.state.epoch,
                    **self._evaluate_loader(val_loader, self.config.val_batches)}
        self.state.record_validation(logs)
        callbacks.call("on_validation_end", self, logs)
        meter.resume()

    def _save(self, checkpoints: CheckpointManager, loader: Iterable[Any], callbacks: CallbackList,
              meter: Meter) -> None:
        state = self.state
        self._check_finite(loader)
        if self._poisoned:
            return  # non-finite weights are never saved: the last finite checkpoint stays the newest
        self._saved_step = state.step
        state.record_micro_batch(self.memory_guard.settings() if self.memory_guard is not None else {})
        totals = self._totals() if state.running else {}
        if self.group is not None and self.group.size() > 1 and state.running:
            # Canonical form of the running sums: rank 0 holds the totals, the others zero, as after a resume.
            mine = totals if self.is_main else {k: 0.0 for k in totals}
            state.set_running({k: mx.array(v) for k, v in mine.items()})
            self._watch.start(state.running, state.step)
        if not self.is_main:
            return  # only rank 0 writes; every rank holds the same state
        meter.pause()
        running = {k: float(v.item()) for k, v in state.running.items()}  # type: ignore[arg-type]  # real scalars
        running.update(totals)
        arrays, saved = state.capture(self.model, self.optimizer, loader, callbacks, self.config, running,
                                      self.group.size() if self.group is not None else 1, checkpoints.directory)
        path = checkpoints.save(state.step, arrays, saved, metrics=state.last_val)
        callbacks.call("on_checkpoint", self, path)
        meter.resume(checkpoint=True)

    # -- pieces -------------------------------------------------------------------------

    def _start(self, run: RunDirectory, resume: str | None, loader: Iterable[Any],
               callbacks: CallbackList) -> Iterable[Any]:
        """Make the optimizer state, then restore a checkpoint into it or seed a fresh run.

        With ``resume="auto"`` a checkpoint that passes its checks but cannot be restored (damaged
        after its manifest was written) is skipped for the previous one, with a warning.
        """
        if not self._optimizer_ready:
            self.optimizer.init(self.model.trainable_parameters())
            self._optimizer_ready = True
        candidates = run.resume_candidates(resume, self.log)
        for i, path in enumerate(candidates):
            try:
                restored = self._restore(path, loader, callbacks)
            except ConfigError:
                raise  # the run's settings do not fit the checkpoint: an older one would not fit either
            except (CheckpointError, KeyError, ValueError, RuntimeError) as error:
                if resume != "auto" or i == len(candidates) - 1:
                    if isinstance(error, CheckpointError):
                        raise
                    raise CheckpointError(f"checkpoint {path} cannot be restored ({type(error).__name__}: {error}); "
                                          "resume from an earlier checkpoint, or start without resume") from error
                warnings.warn(f"checkpoint {path} cannot be restored ({type(error).__name__}: {error}); trying the "
                              f"previous one, {candidates[i + 1]}", CheckpointWarning, stacklevel=3)
                continue
            self._saved_step, self._poisoned = self.state.step, False
            self.log(f"resumed from {path} (step {self.state.step}, epoch {self.state.epoch + 1})")
            self._seeded = True
            return restored
        if not self._seeded:
            mx.random.seed(self.config.seed)
        self._seeded = True
        return loader

    def _restore(self, path: str, loader: Iterable[Any], callbacks: CallbackList) -> Iterable[Any]:
        from mlx_train.checkpointing import load_checkpoint

        arrays, saved = load_checkpoint(path)
        resized, config = keep_global_batch(path, saved, loader, self.config, self._batch_ranks(), self.log)
        self.state.restore(path, arrays, saved, self.model, self.optimizer, resized, callbacks,
                           rank=self.group.rank() if self.group is not None else 0)
        if resized is not loader:  # another number of processes: another micro-batch count per step
            self.config = config
            self.state.record_micro_batch({**self.state.micro_batch, "step_batch": None})
            if self._loaders is not None and self._loaders[0] is loader:
                self._loaders = (resized, *self._loaders[1:])
        return resized

    def _guard(self, callbacks: CallbackList) -> MemoryGuard:
        """The memory guard around the step function, with the micro-batch settings of the loop state."""
        cfg = self.config
        extensions = tuple(c for c in callbacks.callbacks if isinstance(c, StepExtension))
        previous = self.memory_guard
        settings = self.state.micro_batch or (previous.settings() if previous is not None else {})
        if previous is not None and previous.extensions == extensions and settings == previous.settings():
            return previous  # the same step: no new compile
        budget = cfg.memory_limit or getattr(self.device_config, "memory_limit", None)
        policy = MemoryPolicy(recover=cfg.oom_recovery, budget=budget, device_memory=self._device_memory(),
                              can_checkpoint=self._can_checkpoint())
        options: dict[str, Any] = dict(precision=cfg.precision, max_grad_norm=cfg.max_grad_norm,
                       loss_scale_window=cfg.loss_scale_window, compile=cfg.compile, nonfinite=cfg.nonfinite)

        def build(accumulation: int, checkpointing: bool) -> TrainStep:
            # what is recomputed: "blocks" (true, or the memory guard's retry), "attention", "auto", or nothing
            granularity = "blocks" if checkpointing or cfg.gradient_checkpointing is True else \
                cfg.gradient_checkpointing or None
            if granularity and self._checkpointed_blocks not in (granularity, "blocks"):
                from mlx_train.training.recompute import enable_gradient_checkpointing

                enable_gradient_checkpointing(self.model, cfg.checkpoint_modules, str(granularity))  # before the trace
                self._checkpointed_blocks = str(granularity)
            return build_step(self.model, self.optimizer, self.loss, StepOptions(accumulation=accumulation, **options),
                              self.state.loss_scale, self.gradient_reduction, extensions)

        guard = MemoryGuard(build, cfg.gradient_accumulation, policy, self.group, self.log, settings)
        guard.extensions = extensions
        self.state.record_micro_batch(guard.settings())
        return guard

    def _done(self) -> bool:
        if self._stop_requested():
            return True
        max_steps = self.config.max_steps
        return self.state.stop_training or (max_steps is not None and self.state.step >= max_steps)

    def _vote_stop(self, signals: StopSignals) -> bool | None:
        """In a distributed run: did a stop signal arrive on any rank (so all stop at the same step)? Every
        rank votes right after each step, still under the step's watchdog; a reduction with a vote slot
        sums the votes with the gradients (the vote cast before the step), with no collective of its
        own. None for a lone process."""
        if self.group is None or self.group.size() == 1:
            return None
        votes = self.gradient_reduction.state if self.gradient_reduction is not None else None
        if votes is None:
            self._voted_stop = any_rank(signals.requested is not None, self.group)
        else:
            self._voted_stop = votes["stop"].item() > 0  # type: ignore[operator]  # a float32 scalar
            votes["stop"] = mx.array(1.0 if signals.requested is not None else 0.0)  # for the next step
        if self._voted_stop and signals.requested is None:
            signals.requested = signal.SIGTERM
        return self._voted_stop

    def _stop_requested(self) -> bool:
        if self._signals is None:
            return False
        if self.group is not None and self.group.size() > 1:
            return self._voted_stop  # ranks agree: the decision of the last vote
        return self._signals.requested is not None

    def _interruption(self, signum: int, checkpoints: CheckpointManager | None) -> TrainingInterrupted:
        name = signal.Signals(signum).name
        if checkpoints is None:
            where, saved = "no checkpoint_dir was set, so nothing was saved", None
        else:
            saved = checkpoints.resolve("auto") if self.is_main else None
            where = f"saved {saved}; resume with train(..., resume='auto') or --resume"
        message = f"training stopped by {name} at step {self.state.step}: {where}"
        self.log(message)
        return TrainingInterrupted(signum, self.state.step, saved, message)

    def _check_finite(self, loader: Iterable[Any]) -> bool:
        """Act on the NaN/Inf losses or gradients flagged inside the steps since the last look (one host read).

        The loop looks before every report, validation, checkpoint and epoch end, and when the run ends:
        ``nonfinite="raise"`` and ``"stop"`` act there, up to one report/checkpoint interval after the step,
        and name the step; nothing after it is ever saved or kept as best. ``"skip"``: the step's update was
        already undone inside it; the look only says so. Returns True when the run must stop here.
        """
        state = self.state
        bad = self._watch.take(state.running, state.step)
        if not bad:
            return False
        policy, batches = self.config.nonfinite, self._replayed(loader, bad)
        if policy == "skip":
            for step in bad:
                self.log(f"non-finite loss or gradient at {self._where(loader, step)}{batches.get(step, '')}: the "
                         "update was skipped (nonfinite='skip')")
            return False
        self._poisoned = True  # the update was applied: this state must never be saved
        step = bad[0]
        where, culprit = self._where(loader, step), batches.get(step, "")
        later = f", found at step {state.step}" if state.step != step else ""
        advice = ("resume from the last checkpoint; find the bad samples, lower learning_rate, set max_grad_norm, "
                  "or set nonfinite='skip' to skip such steps")
        if policy == "stop":
            state.request_stop()
            self.log(f"non-finite loss or gradient at {where}{culprit}; stopping{later} (nonfinite='stop'). The "
                     f"model's weights are not finite; the last finite checkpoint is kept. To continue: {advice}")
            return True
        raise NonFiniteError(f"non-finite loss or gradient at {where}{culprit}{later}. The model's weights are no "
                             f"longer finite and nothing was saved after this step. To fix: {advice}")

    def _where(self, loader: Iterable[Any], step: int) -> str:
        """"step 5 (epoch 1, batch 5 of 8)" for a step of the current epoch."""
        first_step, first_position = self._epoch_start
        length = length_of(loader) if isinstance(loader, DataLoader) else None
        place = "" if length is None else f", batch {first_position + step - first_step} of {length}"
        return f"step {step} (epoch {self.state.epoch + 1}{place})"

    def _replayed(self, loader: Iterable[Any], steps: list[int]) -> dict[int, str]:
        """Which samples of the given steps' batches hold NaN/Inf (only on this error path): a DataLoader's
        batches are read again from the start of the epoch (a copy of it: the loader is not moved)."""
        if not isinstance(loader, DataLoader) or loader.num_samples is None:
            return {}
        first_step, first_position = self._epoch_start
        wanted = {first_position + step - first_step - 1: step for step in steps}
        found: dict[int, str] = {}
        try:
            replay = loader.replace(num_workers=0)
            replay.set_epoch(self.state.epoch)
            for index, batch in enumerate(replay):
                if index in wanted:
                    found[wanted[index]] = nonfinite_inputs(batch)
                if index >= max(wanted):
                    break
        except Exception:  # noqa: BLE001  # a detail of the message: never in the way of the error it explains
            pass
        return found

    def _epoch_complete(self, loader: Iterable[Any]) -> bool:
        if not isinstance(loader, DataLoader):
            return not self._done()
        if loader.epoch == self.state.epoch and at_epoch_end(loader):  # (the epoch's length only when needed)
            loader.set_epoch(self.state.epoch + 1)  # stopped right on the last batch: the epoch is done
        return loader.epoch > self.state.epoch

    def _micro_loader(self, loader: DataLoader) -> DataLoader:
        """A user's DataLoader yields micro-batches: one step takes ``gradient_accumulation`` of them."""
        accumulation = self.config.gradient_accumulation
        return loader.replace(batch_size=loader.batch_size * accumulation) if accumulation > 1 else loader

    def _eval_loader(self, dataset: Any) -> DataLoader:
        cfg = self.config
        return DataLoader(dataset, batch_size=cfg.eval_batch_size or cfg.batch_size, shuffle=False,
                          num_workers=cfg.num_workers, drop_last=False, seed=cfg.seed)

    def _evaluate_loader(self, loader: Iterable[Any], max_batches: int | None = None) -> dict[str, float]:
        start = time.perf_counter()
        guard, cfg = self.memory_guard, self.config
        if guard is not None and guard.events and guard.batch_size:  # training settled on a smaller micro-batch
            needed = -(-(cfg.eval_batch_size or cfg.batch_size) // guard.batch_size)
            self.evaluator.parts = max(self.evaluator.parts, needed)
        values = self._reduce(self.evaluator.sums(loader, max_batches))
        out = {"val_loss": values["loss_sum"] / max(values["items"], 1.0)}
        out.update(metric_means(values, values["items"], "val_"))
        if "correct" in values:
            out["val_accuracy"] = values["correct"] / max(values["counted"], 1.0)
        out["val_time"] = time.perf_counter() - start
        return out

    def _totals(self) -> dict[str, float]:
        """The epoch's and the report window's loss sum and item count (and a loss's metric sums), summed over
        ranks (report time only)."""
        running = self.state.running
        keys = _summed_keys(tuple(running))
        if self.group is None or self.group.size() == 1:  # one process: read them as they are
            return {k: float(running[k].item()) for k in keys}  # type: ignore[arg-type]  # real scalars
        return self._reduce({k: running[k] for k in keys})

    def _reduce(self, values: dict[str, mx.array]) -> dict[str, float]:
        """Sum on-device values over ranks and read them: the one place metrics cross processes."""
        if self.group is not None and self.group.size() > 1:
            with self.collective("metric reduction"):
                values = {k: mx.distributed.all_sum(v, group=self.group, stream=mx.cpu) for k, v in values.items()}
                mx.eval(values)
        return {k: float(v.item()) for k, v in values.items()}  # type: ignore[arg-type]  # real scalars

    def _batch_ranks(self) -> int:
        """How many processes each train on their own slice of every batch (the global batch is that many
        times the loader's); tensor parallelism's ranks all see the whole batch."""
        return self.group.size() if self.group is not None else 1

    def _shard(self, *loaders: Iterable[Any] | None) -> None:
        if self.group is None or self.group.size() == 1:
            return
        for loader in loaders:
            if isinstance(loader, DataLoader) and loader.world_size != self.group.size():
                loader.set_shard(self.group.rank(), self.group.size())

    def _default_callbacks(self) -> list[Any]:
        cfg = self.config
        callbacks: list[Any] = [ProgressBar()] if self.is_main else []
        if cfg.run_dir and self.is_main:
            callbacks.append(MetricsLogger(cfg.run_dir))
        if cfg.report_to and self.is_main:
            from mlx_train.training.trackers import trackers_for

            callbacks += trackers_for(cfg)
        if cfg.run_dir:  # every rank: the monitor shows each one's progress and memory
            callbacks.append(Heartbeat(cfg.run_dir))
        if cfg.early_stopping_patience is not None:
            callbacks.append(EarlyStopping(monitor=cfg.monitor, patience=cfg.early_stopping_patience,
                                           min_delta=cfg.early_stopping_min_delta, mode=cfg.monitor_mode))
        return callbacks + self._config_extensions()

    def _config_extensions(self) -> list[Any]:
        """The step extensions the config turns on: ``prune_sparsity`` and ``ema_decay`` (masked like the weights)."""
        from mlx_train.training.ema import EMA
        from mlx_train.training.pruning import Pruning

        cfg = self.config
        pruning = None if cfg.prune_sparsity is None else Pruning(
            cfg.prune_sparsity, start_step=cfg.prune_start, end_step=cfg.prune_end, frequency=cfg.prune_frequency,
            schedule=cfg.prune_schedule, scope=cfg.prune_scope)
        ema = None if cfg.ema_decay is None else EMA(cfg.ema_decay, pruning=pruning)
        return [c for c in (pruning, ema) if c is not None]

    def _checkpoints(self, directory: str | None) -> CheckpointManager | None:
        if not directory:
            return None
        cfg = self.config
        return CheckpointManager(directory, keep_last=cfg.keep_last, keep_best=cfg.keep_best,
                                 monitor=cfg.monitor, mode=cfg.monitor_direction())

    def _device_memory(self) -> int | None:
        from mlx_train.device import DeviceConfig

        config = self.device_config if isinstance(self.device_config, DeviceConfig) else DeviceConfig()
        try:
            return config.device_memory()
        except MLXTrainError:
            return None

    def _can_checkpoint(self) -> bool:
        from mlx_train.training.recompute import find_blocks

        try:
            find_blocks(self.model, self.config.checkpoint_modules)
        except ConfigError:
            return False
        return True


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"the model must be an mlx.nn.Module, got {type(model).__name__}; wrap a function in a Module "
            "subclass whose __call__ computes the outputs (its parameters are then found and trained)")


def _epochs_for(loader: Any, config: TrainConfig) -> int:
    """``epochs: null``: as many passes as ``max_steps`` needs (a loader of unknown length: until max_steps)."""
    per_epoch = length_of(loader)
    return math.ceil((config.max_steps or 1) / per_epoch) if per_epoch else 2**62


def _epoch_of(loader: Any, state: LoopState) -> int:
    """The epoch to train next: the loader's, or for a plain iterable the loop state's."""
    return loader.epoch if hasattr(loader, "epoch") else state.next_epoch


@lru_cache(maxsize=8)
def _summed_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The running sums that are summed over ranks (and reported), of a step's running keys (the same every
    report: found once)."""
    return tuple(k for k in keys if summed_over_ranks(k))


def _step_periods(every: Cadences) -> tuple[int, ...]:
    """The step cadences' periods (report, validation, save counted in steps), found once per run."""
    return tuple(c.step_n for c in (every.report, every.validate, every.save) if c.step_n)


def _next_due(periods: tuple[int, ...], step: int) -> float:
    """The next step after ``step`` at which a report, validation or save is due (``periods``: the step
    cadences, ``_step_periods``)."""
    if len(periods) == 1:
        return (step // periods[0] + 1) * periods[0]
    return min((step // n + 1) * n for n in periods) if periods else math.inf
