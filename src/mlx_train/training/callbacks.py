"""Callbacks: a small set of events, plain values in, a flag to stop.

Events (override only those you need; the Trainer skips the rest):
``on_fit_start(trainer)``, ``on_epoch_start(trainer, epoch)``, ``on_batch_end(trainer, step)``,
``on_report(trainer, logs)``, ``on_validation_end(trainer, logs)``,
``on_epoch_end(trainer, epoch, logs)``, ``on_checkpoint(trainer, path)``,
``on_fit_end(trainer, history)``, ``on_exception(trainer, error)``.

Two optional hooks extend the step and the reports: a callback with ``in_step(model, optimizer)``
and ``step_state`` (a tree of arrays) runs inside the compiled update after the optimizer (pruning
masks, weight averages; ``step_state`` joins the compiled state); ``report_metrics()`` adds values
to reports and epoch logs; ``validation_weights()`` (flat name -> array, or None) replaces the
weights during validation.

``logs`` are plain Python floats (``loss``, ``learning_rate``, ``val_loss``, ...). A callback stops
training by setting ``trainer.stop_training = True``. State that must survive a resume is returned
by ``state_dict()`` (JSON values and ``mx.array`` leaves) and given back to ``load_state_dict()``.

mlx-lm's ``TrainingCallback`` (``on_train_loss_report(info)``, ``on_val_loss_report(info)``)
works as is: pass it in ``callbacks=[...]``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.config import metric_direction
from mlx_train.errors import ConfigError
from mlx_train.training.state import saved_parameters

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer

EVENTS = (
    "on_fit_start",
    "on_epoch_start",
    "on_batch_end",
    "on_report",
    "on_validation_end",
    "on_epoch_end",
    "on_checkpoint",
    "on_fit_end",
    "on_exception",
)


class Callback:
    """Base class for callbacks; every event is a no-op until overridden.

    Example::

        class PrintLoss(Callback):
            def on_report(self, trainer, logs):
                print(logs["step"], logs["loss"])
    """

    def on_fit_start(self, trainer: Trainer) -> None: ...
    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None: ...
    def on_batch_end(self, trainer: Trainer, step: int) -> None: ...
    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None: ...
    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None: ...
    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None: ...
    def on_checkpoint(self, trainer: Trainer, path: str) -> None: ...
    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None: ...
    def on_exception(self, trainer: Trainer, error: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class MLXLMCallback(Callback):
    """Adapts an mlx-lm ``TrainingCallback`` (two report hooks) to the event set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        if hasattr(self.inner, "on_train_loss_report"):
            self.inner.on_train_loss_report({
                "iteration": logs["step"],
                "train_loss": logs["loss"],
                "learning_rate": logs["learning_rate"],
                "iterations_per_second": logs["steps_per_second"],
                "tokens_per_second": logs.get("tokens_per_second", logs["samples_per_second"]),
                "trained_tokens": logs.get("trained_tokens", logs["trained_samples"]),
                "peak_memory": logs["peak_memory_gb"],
            })

    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        if hasattr(self.inner, "on_val_loss_report"):
            self.inner.on_val_loss_report(
                {"iteration": logs["step"], "val_loss": logs["val_loss"], "val_time": logs["val_time"]}
            )


def as_callback(obj: Any) -> Callback:
    """Accept our callbacks, duck-typed ones, and mlx-lm's TrainingCallback."""
    if isinstance(obj, Callback):
        return obj
    if any(hasattr(obj, e) for e in EVENTS):
        return cast(Callback, obj)  # duck-typed: the events it lacks are skipped
    if hasattr(obj, "on_train_loss_report") or hasattr(obj, "on_val_loss_report"):
        return MLXLMCallback(obj)
    keras = [f"{name} -> {ours}" for name, ours in _KERAS_EVENTS.items() if hasattr(obj, name)]
    hint = f"; its Keras events map to mlx-train's as {', '.join(keras)}, each with the trainer first" if keras else ""
    raise ConfigError(
        f"{type(obj).__name__} is not a callback: it has none of the events {', '.join(EVENTS)} "
        f"(nor mlx-lm's on_train_loss_report / on_val_loss_report){hint}"
    )


#: Each event's arguments, as the loop passes them (a callback's method must accept them in this order).
EVENT_ARGUMENTS = {
    "on_fit_start": ("trainer",), "on_epoch_start": ("trainer", "epoch"), "on_batch_end": ("trainer", "step"),
    "on_report": ("trainer", "logs"), "on_validation_end": ("trainer", "logs"),
    "on_epoch_end": ("trainer", "epoch", "logs"), "on_checkpoint": ("trainer", "path"),
    "on_fit_end": ("trainer", "history"), "on_exception": ("trainer", "error"),
}
# Keras' events, and the nearest mlx-train event: a Keras callback is told where each goes.
_KERAS_EVENTS = {"on_train_begin": "on_fit_start", "on_train_end": "on_fit_end", "on_epoch_begin": "on_epoch_start",
                 "on_train_batch_end": "on_batch_end", "on_test_end": "on_validation_end"}


def check_signatures(callback: Any) -> None:
    """Refuse a callback whose event methods cannot take the loop's arguments (Keras' ``on_epoch_end(epoch,
    logs)`` is the usual case), before training rather than at the first epoch's end."""
    import inspect

    for event, names in EVENT_ARGUMENTS.items():
        method = getattr(callback, event, None)
        if method is None or not _overrides(callback, event) or not callable(method):
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue  # a builtin or C callable: nothing to check
        try:
            signature.bind(*names)
        except TypeError:
            raise ConfigError(
                f"callback {type(callback).__name__}.{event}{signature} cannot take the arguments mlx-train passes: "
                f"{event}({', '.join(names)}). Keras' callbacks get (epoch, logs); mlx-train's get the trainer first: "
                f"def {event}(self, {', '.join(names)}) (see mlx_train.training.Callback)") from None


def _overrides(cb: Any, event: str) -> bool:
    method = getattr(cb, event, None)
    if method is None:
        return False
    base = getattr(Callback, event)
    return getattr(method, "__func__", method) is not base


class CallbackList:
    """Calls each event on the callbacks that define it (others cost nothing)."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = [as_callback(c) for c in callbacks]
        for callback in self.callbacks:
            check_signatures(callback)
        self._by_event = {e: [getattr(c, e) for c in self.callbacks if _overrides(c, e)] for e in EVENTS}
        self._metric_sources = [c.report_metrics for c in self.callbacks if hasattr(c, "report_metrics")]
        #: Some callback adds values to reports (``report_metrics``): most runs have none.
        self.has_metrics = bool(self._metric_sources)

    def has(self, event: str) -> bool:
        return bool(self._by_event[event])

    def call(self, event: str, *args: Any) -> None:
        for method in self._by_event[event]:
            method(*args)

    def keys(self) -> list[str]:
        """Stable names for checkpointed callback state: class name, with an index for repeats."""
        seen: dict[str, int] = {}
        names = []
        for c in self.callbacks:
            base = type(c).__name__
            names.append(base if base not in seen else f"{base}_{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
        return names

    def report_metrics(self) -> dict[str, float]:
        """Extra values for reports and epoch logs from callbacks that define ``report_metrics()``
        (e.g. pruning's sparsity): they reach every ``on_report``/``on_epoch_end`` and metrics.jsonl."""
        values: dict[str, float] = {}
        for source in self._metric_sources:  # found once: most runs have none, and a report then pays nothing
            values.update(source())
        return values

    @contextlib.contextmanager
    def validation_weights(self, model: Any) -> Iterator[None]:
        """Evaluate with the weights a callback's ``validation_weights()`` returns (flat name -> array,
        e.g. an exponential moving average), then put the trained weights back."""
        weights = next((w for c in self.callbacks if hasattr(c, "validation_weights")
                        for w in [c.validation_weights()] if w), None)
        if not weights:
            yield
            return
        trained = dict(tree_flatten(model.parameters()))
        model.load_weights(list(weights.items()), strict=False)
        try:
            yield
        finally:
            model.load_weights(list(trained.items()), strict=False)

    def state(self) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """(JSON state, arrays) of every callback that has state."""
        json_state, arrays = {}, {}
        for key, c in zip(self.keys(), self.callbacks, strict=False):
            if not hasattr(c, "state_dict"):
                continue
            flat = tree_flatten(c.state_dict(), is_leaf=lambda x: isinstance(x, mx.array))
            plain = [(k, v) for k, v in flat if not isinstance(v, mx.array)]
            for k, v in flat:
                if isinstance(v, mx.array):
                    arrays[f"{key}/{k}"] = v
            json_state[key] = {"values": dict(plain), "arrays": [k for k, v in flat if isinstance(v, mx.array)]}
        return json_state, arrays

    def load_state(self, json_state: dict[str, Any], arrays: dict[str, mx.array]) -> None:
        for key, c in zip(self.keys(), self.callbacks, strict=False):
            if key not in json_state or not hasattr(c, "load_state_dict"):
                continue
            entry = json_state[key]
            flat = list(entry["values"].items()) + [(k, arrays[f"{key}/{k}"]) for k in entry["arrays"]]
            c.load_state_dict(tree_unflatten(flat) if flat else {})


class _Monitor:
    """Tracks the best value of one metric."""

    def __init__(self, monitor: str, mode: str, min_delta: float = 0.0) -> None:
        self.monitor, self.mode, self.min_delta = monitor, metric_direction(monitor, mode), abs(min_delta)
        self.best = math.inf if self.mode == "min" else -math.inf

    def value(self, logs: dict[str, Any]) -> float | None:
        if self.monitor not in logs:
            warnings.warn(
                f"{type(self).__name__}: metric '{self.monitor}' is not in the logs "
                f"(available: {', '.join(sorted(logs))}); nothing is monitored this epoch",
                stacklevel=3,
            )
            return None
        return float(logs[self.monitor])

    def improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


class EarlyStopping(Callback, _Monitor):
    """Stop when a monitored metric stops improving, with Keras 3's meanings.

    ``baseline``: training stops if the metric does not beat it within ``patience`` epochs.
    ``start_from_epoch``: epochs to wait before monitoring (a warm-up with no improvement expected).
    ``restore_best_weights``: the model ends training (stopped early or not) with the best epoch's weights.

    Example::

        EarlyStopping(monitor="val_loss", patience=3, min_delta=1e-4, restore_best_weights=True)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "auto",
        restore_best_weights: bool = False,
        baseline: float | None = None,
        start_from_epoch: int = 0,
    ) -> None:
        _Monitor.__init__(self, monitor, mode, min_delta)
        if patience < 0:
            raise ConfigError(f"EarlyStopping patience must be >= 0, got {patience}")
        if start_from_epoch < 0:
            raise ConfigError(f"EarlyStopping start_from_epoch must be >= 0, got {start_from_epoch}")
        self.patience, self.restore_best_weights = patience, restore_best_weights
        self.baseline, self.start_from_epoch = baseline, start_from_epoch
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.best_epoch: int | None = None
        self.best_weights: dict[str, mx.array] | None = None

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        value = self.value(logs)
        if value is None or epoch < self.start_from_epoch:
            return
        self.wait += 1
        if self.improved(value):
            self.best, self.best_epoch = value, epoch
            if self.restore_best_weights:
                # mx arrays are immutable and replaced each step, so keeping references is a snapshot.
                # Only what trains: a LoRA fine-tune keeps megabytes, not a copy of the frozen base.
                self.best_weights = saved_parameters(trainer.model)
            if self.baseline is None or self._beats(value, self.baseline):
                self.wait = 0
                return
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            trainer.stop_training = True
            best = (f"best {self.monitor} {self.best:.4f} at epoch {self.best_epoch + 1}" if self.best_epoch is not None
                    else f"{self.monitor} was never finite")
            trainer.log(f"early stopping at epoch {epoch + 1}: {self.monitor} did not improve for {self.patience} "
                        f"epoch(s); {best}")

    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None:
        # As Keras 3: the best weights end the run whether this callback stopped it or not.
        if self.restore_best_weights and self.best_weights is not None:
            trainer.model.update(tree_unflatten(list(self.best_weights.items())))
            trainer.log(f"restored the weights of epoch {cast(int, self.best_epoch) + 1} "
                        f"(best {self.monitor} {self.best:.4f})")

    def _beats(self, value: float, reference: float) -> bool:
        if self.mode == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"best": self.best, "wait": self.wait, "best_epoch": self.best_epoch,
                                 "stopped_epoch": self.stopped_epoch}
        if self.best_weights is not None:
            state["best_weights"] = dict(self.best_weights)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = state["best"], state["wait"]
        self.best_epoch, self.stopped_epoch = state.get("best_epoch"), state.get("stopped_epoch")
        weights = state.get("best_weights")
        self.best_weights = dict(tree_flatten(weights)) if weights else None


class ReduceLROnPlateau(Callback, _Monitor):
    """Multiply the learning rate by ``factor`` when a metric stops improving (Keras 3's arguments).

    After ``patience`` epochs without improvement the rate becomes ``max(lr * factor, min_lr)``, then
    ``cooldown`` epochs pass before counting again. The rate is optimizer state, so the compiled step
    uses the new value; with a learning-rate schedule the schedule would overwrite it, and that is refused.

    Example::

        ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2, min_lr=1e-6)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
    ) -> None:
        _Monitor.__init__(self, monitor, mode, min_delta)
        if not 0.0 < factor < 1.0:
            raise ConfigError(f"ReduceLROnPlateau factor must be between 0 and 1 (exclusive), got {factor}")
        self.factor, self.patience, self.verbose = factor, patience, verbose
        self.cooldown, self.min_lr = cooldown, min_lr
        self.wait = self.cooldown_counter = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        if "learning_rate" in getattr(trainer.optimizer, "_schedulers", {}):
            raise ConfigError("ReduceLROnPlateau sets the learning rate, but the optimizer follows a schedule that "
                              "would overwrite it: use a constant learning rate, or drop ReduceLROnPlateau")

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        value = self.value(logs)
        if value is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.improved(value):
            self.best, self.wait = value, 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait < self.patience:
            return
        old = cast(float, trainer.optimizer.learning_rate.item())
        if old > cast(float, mx.array(self.min_lr, dtype=mx.float32).item()):  # the rate is float32, as in Keras
            new = max(old * self.factor, self.min_lr)
            trainer.optimizer.learning_rate = new
            self.cooldown_counter, self.wait = self.cooldown, 0
            if self.verbose:
                trainer.log(f"epoch {epoch + 1}: ReduceLROnPlateau reduced the learning rate to {new:.4g}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.cooldown_counter = state["best"], state["wait"], state["cooldown_counter"]


class ModelCheckpoint(Callback, _Monitor):
    """Save the model's weights (safetensors) at the end of an epoch, or only when it improves.

    A model with frozen parameters (a LoRA fine-tune) saves its trainable parameters only: load
    them over the base with ``model.load_weights(path, strict=False)``.

    ``filepath`` may contain ``{epoch}`` and metric placeholders (``{val_loss:.3f}``). Weights are
    written as safetensors, never pickle: a ``.pt``/``.pth``/``.pkl``/``.h5`` suffix is replaced
    by ``.safetensors`` (with a note).

    Example::

        ModelCheckpoint(filepath="best_model.safetensors", monitor="val_loss", save_best_only=True)
    """

    def __init__(
        self,
        filepath: str,
        monitor: str = "val_loss",
        save_best_only: bool = False,
        mode: str = "auto",
        every_n_epochs: int = 1,
    ) -> None:
        _Monitor.__init__(self, monitor, mode)
        root, ext = os.path.splitext(filepath)
        if ext in (".pt", ".pth", ".pkl", ".pickle", ".h5", ".ckpt", ".npz", ""):
            warnings.warn(f"ModelCheckpoint writes safetensors, never pickle: saving to {root}.safetensors",
                          stacklevel=2)
            filepath = root + ".safetensors"
        self.filepath, self.save_best_only, self.every_n_epochs = filepath, save_best_only, every_n_epochs
        self.last_saved: str | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Check, before the first step, that the weights can be written where ``filepath`` says (its fixed
        part: a folder named by a placeholder is made at the save)."""
        from mlx_train.paths import writable_file

        if getattr(trainer, "is_main", True) and "{" not in os.path.dirname(self.filepath):
            writable_file(re.sub(r"\{[^}]*\}", "0", self.filepath), "ModelCheckpoint's filepath")

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        if (epoch + 1) % self.every_n_epochs or not getattr(trainer, "is_main", True):
            return
        if self.save_best_only:
            value = self.value(logs)
            if value is None or not self.improved(value):
                return
            self.best = value
        path = self.filepath.format(epoch=epoch + 1, **logs)
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}.safetensors"
        mx.save_safetensors(tmp, saved_parameters(trainer.model), metadata={"epoch": str(epoch + 1)})
        os.replace(tmp, path)
        self.last_saved = path

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "last_saved": self.last_saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.last_saved = state["best"], state.get("last_saved")


def best_model_checkpoint(run_dir: str | None, overwrite: bool) -> ModelCheckpoint:
    """``fit(save_best=True)``: the best weights by ``val_loss`` in ``RUN_DIR/best_model.safetensors``, or
    without a run directory in the current one, where a file of that name from before is refused rather than
    replaced unless ``overwrite``."""
    best = os.path.join(run_dir or ".", "best_model.safetensors")
    if not (run_dir or overwrite) and os.path.exists(best):
        raise ConfigError(f"fit(save_best=True) would replace {os.path.abspath(best)}, written before this "
                          "run; give the run a place (Trainer(..., run_dir=...)), pass overwrite=True to "
                          "replace it, or save_best=False")
    return ModelCheckpoint(best, monitor="val_loss", save_best_only=True)
