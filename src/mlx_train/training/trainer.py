"""The Trainer: a flat loop around one step function and one loop state."""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_train import rundir
from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.config import TrainConfig
from mlx_train.distributed.topology import Single, Topology
from mlx_train.errors import ConfigError, TrainingInterrupted
from mlx_train.run_directory import RunDirectory
from mlx_train.training import checks
from mlx_train.training.batches import Batches
from mlx_train.training.callbacks import CallbackList, best_model_checkpoint
from mlx_train.training.evaluation import Evaluator
from mlx_train.training.extensions import StepExtension
from mlx_train.training.finite import NonFiniteSteps
from mlx_train.training.interrupt import StopSignals
from mlx_train.training.labels import LabelCheck
from mlx_train.training.losses import Loss
from mlx_train.training.meter import Meter, report_window
from mlx_train.training.oom import MemoryGuard
from mlx_train.training.reporting import epoch_logs, train_logs, with_open_epoch
from mlx_train.training.saving import interruption, restore_checkpoint, restore_latest
from mlx_train.training.schedule import (
    Cadences,
    at_epoch_end,
    epochs_for,
    eval_loader,
    micro_loader,
    next_due,
    step_periods,
    summed_keys,
    total_steps,
    train_loader,
)
from mlx_train.training.standard import default_callbacks
from mlx_train.training.state import LoopState
from mlx_train.training.stepping import StepMaker


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
        topology: Topology | None = None,
        **overrides: Any,
    ) -> None:
        given = {k: v for k, v in (("batch_size", batch_size), ("gradient_accumulation", gradient_accumulation))
                 if v is not None}
        self.config = (config or TrainConfig()).replace(**given, **overrides)
        if device_config is not None and hasattr(device_config, "apply"):
            device_config.apply()
        self.device_config = device_config
        checks.check_model(model)
        #: Where the work is spread (one process, data parallel, tensor parallel, FSDP).
        self.topology = topology or Single()
        self.model = model = self.topology.prepare(model, self.config)
        self.optimizer = optimizer = checks.optimizer_of(optimizer, self.config)
        self.loss = Loss(loss_fn)
        self.state = LoopState()
        self.state.set_loss_scale(self.config.loss_scale if self.config.precision == "float16" else 1.0)
        self.epochs: int | None = None
        self.total_steps: int | None = None
        #: Runs the steps and recovers from out-of-memory; keeps the micro-batch it settled on.
        self.memory_guard: MemoryGuard | None = None
        self._loaders: tuple[Any, ...] | None = None
        self._optimizer_ready = False
        self._seeded = False
        self._saved_step: int | None = None
        self._signals: StopSignals | None = None
        self._finite = NonFiniteSteps(self.log)
        self._steps = StepMaker(model, optimizer, self.loss, self.topology, device_config, self.log)
        self.evaluator = Evaluator(model, self.loss, self.config.precision, self.config.compile, self.log)

    # -- the loop state, by name ----------------------------------------------------------

    step = property(lambda self: self.state.step, doc="Optimizer steps taken.")
    epoch = property(lambda self: self.state.epoch, doc="The current epoch (0-based).")
    history = property(lambda self: self.state.history, doc="Per-epoch logs: {'train_loss': [...], ...}.")

    stop_training = property(lambda self: self.state.stop_training, lambda self, value: self.state.request_stop(
        value), doc="Set to True (from a callback) to stop after the current step.")
    base_model = property(lambda self: self.state.base_model, lambda self, value: self.state.set_base_model(value),
                          doc="The frozen base a checkpoint of trainable parameters needs ({'path', 'sha256'}).")
    is_main = property(lambda self: self.topology.is_main, doc="True on the process that writes files and prints.")
    gradient_reduction = property(lambda self: self.topology.reduction, lambda self, value: setattr(
        self.topology, "reduction", value), doc="Gradient reduction across processes, passed into the step.")
    comm_seconds = property(lambda self: self.topology.comm_seconds, lambda self, value: setattr(
        self.topology, "comm_seconds", value), doc="Seconds of gradient communication per step (reports show "
        "it as time_comm, taken out of time_compute).")

    @property
    def group(self) -> Any:
        """The process group (None for one process); setting one makes the topology ``DataParallel(group)``."""
        return self.topology.group

    @group.setter
    def group(self, group: Any) -> None:
        from mlx_train.distributed.topology import DataParallel

        self.topology = self._steps.topology = Single() if group is None else DataParallel(group)

    def collective(self, what: str) -> AbstractContextManager[Any]:
        """``with trainer.collective("what"):`` guards a blocking collective (a watchdog when distributed)."""
        return self.topology.collective(what)

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
        checks.check_epochs(epochs, self.config)
        resume = self.topology.check_run(self.model, self.config, checkpoint_dir or self.config.checkpoint_dir,
                                         resume)
        callbacks = self.topology.callbacks(self.config) + list(callbacks or [])
        with self.topology.errors():
            return self._train(train_dataset, val_dataset, epochs, checkpoint_dir, callbacks, resume, overwrite)

    def _train(self, train_dataset: Any, val_dataset: Any, epochs: int | None, checkpoint_dir: str | None,
               callbacks: list[Any], resume: str | None, overwrite: bool) -> dict[str, Any]:
        if train_dataset is None:
            if self._loaders is None:
                raise ConfigError("train() needs a train_dataset: none was given and there is no earlier "
                                  "train() call whose datasets could be reused")
            loader, val_loader = self._loaders
            more = epochs or self.config.epochs or epochs_for(loader, self.config)
            epochs = Batches(loader).epoch(self.state) + more
            return self._run(loader, val_loader, epochs, checkpoint_dir, callbacks, resume, overwrite)
        loader = train_loader(train_dataset, self.config)
        val_loader = None if val_dataset is None else eval_loader(val_dataset, self.config)
        self._loaders = (loader, val_loader)
        return self._run(loader, val_loader, epochs, checkpoint_dir, callbacks, resume, overwrite)

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
        checks.check_epochs(epochs, self.config)
        callbacks = list(callbacks or [])
        if save_best and val_loader is None:
            warnings.warn("fit(save_best=True) without a val_loader keeps no best model (the best is judged by "
                          "val_loss): pass a val_loader, or save_best=False to silence this", UserWarning,
                          stacklevel=2)
        if save_best and val_loader is not None:
            callbacks.append(best_model_checkpoint(self.config.run_dir, overwrite or self.state.step > 0))
        return self._run(micro_loader(train_loader, self.config), val_loader, epochs, self.config.checkpoint_dir,
                         callbacks, None, overwrite)

    def evaluate(self, dataset: Any) -> dict[str, float]:
        """Loss (and accuracy for classification) over a whole dataset or loader."""
        with self.topology.errors():
            metrics = self._evaluate_loader(eval_loader(dataset, self.config))
        return {k.removeprefix("val_"): v for k, v in metrics.items() if k != "val_time"}

    def predict(self, dataset: Any) -> mx.array:
        """Model outputs for every sample, in dataset order."""
        return self.evaluator.predict(eval_loader(dataset, self.config))

    def log(self, message: str) -> None:
        """Print a message from the training run (rank 0 only when distributed); with a
        ``run_dir``, also append it to ``RUN_DIR/train.log``."""
        if self.is_main:
            rundir.log_message(self.config.run_dir, message)

    # -- the loop -----------------------------------------------------------------------

    def _run(self, loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int | None,
             checkpoint_dir: str | None, callbacks: Any, resume: str | None, overwrite: bool = False) -> dict[str, Any]:
        cfg, state, topology = self.config, self.state, self.topology
        checks.check_trainable(self.model)
        batches = Batches(loader)
        topology.shard(batches)  # first: epochs: null counts this rank's batches
        topology.shard(Batches(val_loader))
        self.epochs = epochs = epochs or cfg.epochs or epochs_for(loader, cfg)
        state.request_stop(False)
        callbacks = CallbackList(default_callbacks(cfg, topology.is_main) + list(callbacks))
        checkpoints = self._checkpoints(checkpoint_dir or cfg.checkpoint_dir)
        run = RunDirectory(cfg.run_dir, checkpoints=checkpoints)
        if overwrite and resume:
            raise ConfigError(f"overwrite=True starts over and resume={resume!r} continues: pass one of them")
        fresh = not resume and state.step == 0  # a new run, not this trainer's next train() call
        if fresh and overwrite and topology.is_main:
            run.make_room(True, self.log)
        with run.locks(topology.is_main), StopSignals(self.log, lambda: state.step, topology.vote_stop) as signals:
            if fresh and topology.is_main:  # the other ranks may already see the files rank 0 writes
                run.refuse_fresh_start()
            self._signals = signals
            topology.start_run()
            batches = self._start(run, resume, batches, callbacks)  # resized to keep a global batch
            guard = self.memory_guard = self._guard(callbacks)
            self.total_steps = total_steps(batches.source, epochs, cfg.max_steps)
            meter = Meter(state, topology.batch_ranks)
            meter.comm_seconds = self.comm_seconds
            callbacks.call("on_fit_start", self)
            try:
                self._epochs(batches, val_loader, checkpoints, callbacks, meter)
                self._check_finite(batches)
                if checkpoints and self._saved_step != state.step:
                    self._save(checkpoints, batches, callbacks, meter)
                if checkpoints:
                    checkpoints.wait()
                if signals.stopping:  # in a group, the vote: a signal after the last step is too late
                    raise self._interruption(signals.requested or signal.SIGTERM, checkpoints,
                                             received=signals.received is not None)
            except BaseException as error:
                writing = checkpoints.writing() if checkpoints else None
                if writing:  # a stop, even "at once", or a failure first lets the save under way finish
                    self.log(f"waiting for the checkpoint being written, {writing}, to be complete before stopping "
                             "(SIGKILL stops without it; the checkpoints before it stay)")
                callbacks.call("on_exception", self, error)
                raise
            finally:
                if checkpoints:
                    checkpoints.wait(raise_error=False)
                state.record_micro_batch(guard.settings())  # where memory recovery settled: the next train() call
            # Still under the signal handlers: a late SIGTERM cannot cut on_fit_end short (the run is saved).
            history = with_open_epoch(state, self._totals, self._learning_rate())
            callbacks.call("on_fit_end", self, history)
        return history

    def _epochs(self, batches: Batches, val_loader: Iterable[Any] | None, checkpoints: CheckpointManager | None,
                callbacks: CallbackList, meter: Meter) -> None:
        """The epochs: step, periodic work (report, validation, save), stop check. Nothing on the step path
        waits for the device: a NaN/Inf is looked for at the next report, validation, checkpoint or epoch end
        (``_check_finite``), which names its step."""
        state, every, guard = self.state, Cadences(self.config), self.memory_guard
        periods = step_periods(every)
        labels = LabelCheck.for_run(self.loss, self.model, batches.source)
        per_batch = callbacks.has("on_batch_end")
        while batches.epoch(state) < (self.epochs or 0) and not self._done():
            self._begin_epoch(batches, callbacks)
            due = next_due(periods, state.step)
            for batch in meter.timed(batches):
                batch = self.loss.prepare(self.model, batch, state.step)  # a loss's rollouts: now, current weights
                if labels is not None:
                    labels.batch(batch)  # a no-op when the whole dataset was checked at start
                running = guard(state, batch)  # type: ignore[misc]  # set by _run
                state.advance(running, meter.count(batch))
                self._finite.watch.add(running)
                self._signals.vote()  # type: ignore[union-attr]  # set by _run
                if per_batch:
                    callbacks.call("on_batch_end", self, state.step)
                if state.step >= due:
                    self._boundary(batches, val_loader, checkpoints, callbacks, meter, every)
                    due = next_due(periods, state.step)
                if checkpoints:
                    checkpoints.raise_failed_save()
                if self._done():
                    break
            # Non-finite weights (found now or at a look during the epoch) never reach an epoch's end.
            if self._check_finite(batches) or self._finite.poisoned or not self._epoch_complete(batches):
                break
            self._end_epoch(batches, val_loader, callbacks, meter, every)
            due_save = every.save.by_epoch(state.epoch + 1) or every.save.by_step(state.step)
            if checkpoints and due_save and self._saved_step != state.step:
                self._save(checkpoints, batches, callbacks, meter)

    def _begin_epoch(self, batches: Batches, callbacks: CallbackList) -> None:
        state = self.state
        epoch = batches.epoch(state)
        if epoch != state.epoch or not state.running:  # a new epoch (a resumed one keeps its sums)
            state.begin_epoch(epoch, self.memory_guard.step.zero_running())  # type: ignore[union-attr]  # set by _run
        self._finite.begin_epoch(state.running, state.step, batches.position)
        callbacks.call("on_epoch_start", self, state.epoch)

    def _end_epoch(self, loader: Batches, val_loader: Iterable[Any] | None, callbacks: CallbackList,
                   meter: Meter, every: Cadences) -> None:
        state = self.state  # (the loop looked for non-finite steps right before)
        if not every.report.by_step(state.step) and meter.pending:
            self._report(loader, callbacks, meter)
        logs = train_logs(self._totals())
        if val_loader is not None and every.validate.by_epoch(state.epoch + 1):
            self._validate(loader, val_loader, callbacks, meter)
        epoch_logs(logs, state.last_val, self._learning_rate())
        logs.update(callbacks.report_metrics())
        state.end_epoch(logs)
        callbacks.call("on_epoch_end", self, state.epoch, logs)

    def _boundary(self, loader: Batches, val_loader: Iterable[Any] | None,
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
        if every.save.by_step(step) and checkpoints and not at_epoch_end(loader.loader):
            self._save(checkpoints, loader, callbacks, meter)

    def _report(self, loader: Batches, callbacks: CallbackList, meter: Meter) -> None:
        """One report: a look for non-finite steps, one read of the running sums (summed over ranks), the logs
        built once for the callbacks that take reports. The loop's largest host work between two steps (one
        report every 10 steps by default): each value is read once and no dict is built twice."""
        self.topology.before_report(meter)
        self._check_finite(loader)
        state = self.state
        grad_norm = state.running.get("grad_norm")
        totals = self._totals()
        window = report_window(totals, state.report_base)
        logs = meter.report(window, self._learning_rate(),
                            None if grad_norm is None else float(grad_norm.item()))  # type: ignore[arg-type]
        state.close_window(totals, window["items"])  # the window was read (and summed over ranks): the next starts
        if callbacks.has_metrics:
            logs.update(callbacks.report_metrics())
        callbacks.call("on_report", self, logs)

    def _validate(self, loader: Batches, val_loader: Iterable[Any], callbacks: CallbackList,
                  meter: Meter) -> None:
        self._check_finite(loader)
        meter.pause()
        with callbacks.validation_weights(self.model):
            logs = {"step": self.state.step, "epoch": self.state.epoch,
                    **self._evaluate_loader(val_loader, self.config.val_batches)}
        self.state.record_validation(logs)
        callbacks.call("on_validation_end", self, logs)
        meter.resume()

    def _save(self, checkpoints: CheckpointManager, loader: Batches, callbacks: CallbackList,
              meter: Meter) -> None:
        state, topology = self.state, self.topology
        self._check_finite(loader)
        if self._finite.poisoned:
            return  # non-finite weights are never saved: the last finite checkpoint stays the newest
        topology.before_save(checkpoints, state.step, self.model, self.optimizer)
        self._saved_step = state.step
        state.record_micro_batch(self.memory_guard.settings() if self.memory_guard is not None else {})
        totals = self._totals() if state.running else {}
        shared = topology.share_running(totals) if state.running else None
        if shared is not None:
            state.set_running({k: mx.array(v) for k, v in shared.items()})
            self._finite.watch.start(state.running, state.step)
        if not topology.is_main:
            return  # only rank 0 writes; every rank holds the same state
        meter.pause()
        running = {k: float(v.item()) for k, v in state.running.items()}  # type: ignore[arg-type]  # real scalars
        running.update(totals)
        arrays, saved = state.capture(self.model, self.optimizer, loader.source, callbacks, self.config, running,
                                      topology.size, checkpoints.directory)
        path = checkpoints.save(state.step, arrays, saved, metrics=state.last_val)
        callbacks.call("on_checkpoint", self, path)
        meter.resume(checkpoint=True)

    # -- pieces -------------------------------------------------------------------------

    def _start(self, run: RunDirectory, resume: str | None, batches: Batches, callbacks: CallbackList) -> Batches:
        """Make the optimizer state, then restore a checkpoint into it or seed a fresh run."""
        if not self._optimizer_ready:
            self.optimizer.init(self.model.trainable_parameters())
            self._optimizer_ready = True
        found = restore_latest(run, resume, lambda path: self._restore(path, batches, callbacks), self.log)
        if found is not None:
            self._saved_step, self._finite.poisoned = self.state.step, False
            self.log(f"resumed from {found[0]} (step {self.state.step}, epoch {self.state.epoch + 1})")
        elif not self._seeded:
            mx.random.seed(self.config.seed)
        self._seeded = True
        return found[1] if found is not None else batches

    def _restore(self, path: str, batches: Batches, callbacks: CallbackList) -> Batches:
        loader = batches.source
        resized, config = restore_checkpoint(path, loader, callbacks, self.state, self.model, self.optimizer,
                                             self.config, self.topology, self.log)
        if resized is loader:
            return batches
        # another number of processes: another micro-batch count per step
        self.config = config
        self.state.record_micro_batch({**self.state.micro_batch, "step_batch": None})
        if self._loaders is not None and self._loaders[0] is loader:
            self._loaders = (resized, *self._loaders[1:])
        return Batches(resized)

    def _guard(self, callbacks: CallbackList) -> MemoryGuard:
        """The memory guard around the step function, with the micro-batch settings of the loop state."""
        extensions = tuple(c for c in callbacks.callbacks if isinstance(c, StepExtension))
        guard = self._steps.guard(self.config, self.state, extensions)
        self.state.record_micro_batch(guard.settings())
        return guard

    def _done(self) -> bool:
        max_steps, signals = self.config.max_steps, self._signals
        return (signals is not None and signals.stopping) or self.state.stop_training or \
            (max_steps is not None and self.state.step >= max_steps)

    def _interruption(self, signum: int, checkpoints: CheckpointManager | None,
                      received: bool) -> TrainingInterrupted:
        # Every rank stopped at the same step; none leaves before rank 0 has written its checkpoint (a rank
        # that exits makes ``mlx.launch`` stop the others, which would cut that save short).
        self.topology.barrier("the barrier after the stop checkpoint")
        return interruption(signum, self.state.step, checkpoints, self.is_main, self.log, received)

    def _check_finite(self, batches: Batches) -> bool:
        """A look for non-finite steps (``NonFiniteSteps``): True when the run must stop here."""
        return self._finite.look(self.state, batches, self.config.nonfinite)

    def _epoch_complete(self, batches: Batches) -> bool:
        finished = batches.finished_epoch(self.state.epoch)
        return not self._done() if finished is None else finished

    def _evaluate_loader(self, loader: Iterable[Any], max_batches: int | None = None) -> dict[str, float]:
        guard = self.memory_guard  # after running out of memory, training settled on a smaller micro-batch
        settled = guard.batch_size if guard is not None and guard.events else None
        return self.evaluator.metrics(loader, max_batches, self.topology.reduce, settled,
                                      self.config.eval_batch_size or self.config.batch_size)

    def _totals(self) -> dict[str, float]:
        """The epoch's and the report window's loss sum and item count (and a loss's metric sums), summed over
        ranks (report time only)."""
        running = self.state.running
        return self.topology.reduce({k: running[k] for k in summed_keys(tuple(running))})

    def _checkpoints(self, directory: str | None) -> CheckpointManager | None:
        return self.topology.checkpoints(directory, self.config) if directory else None

    def _learning_rate(self) -> float:
        return float(self.optimizer.learning_rate.item())
