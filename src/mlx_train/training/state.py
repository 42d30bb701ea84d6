"""The loop state: everything a checkpoint holds, in one object.

``LoopState`` is what the Trainer's loop reads between steps: step and epoch counters, the epoch's
running sums (on the device), history, the last validation, the float16 loss scale, the micro-batch
settings memory recovery settled on, the stop flag and the report window. Only its own methods
change it (the verbs: ``advance`` is the step transition, ``begin_epoch``/``close_window``/
``end_epoch``, ``record_*``, ``request_stop``...); everything else reads it, and
tests/test_loop_state_writers.py fails on a write from anywhere else. The one container written
from outside is ``loss_scale``: the compiled float16 step holds it and updates it in place.

``capture`` turns it (with the model, optimizer, loader and callbacks) into arrays by
group plus a JSON document; ``restore`` puts all of it back **in place**: every array is written
into the container that already holds it, so the compiled step (which captured those
containers) keeps working, and trees of any structure round-trip — frozen or parameterless
submodules leave empty subtrees that a flattened copy would lose. The history reaches a checkpoint
in chunks (``HistoryChunks``), so what a save writes does not grow with the epochs run.

Example::

    state = LoopState()
    state.begin_epoch(0, step.zero_running())
    state.advance(step(state, batch), samples=32)      # the step transition
    arrays, saved = state.capture(model, optimizer, loader, callbacks, config, running)
    ...
    state.restore(path, arrays, saved, model, optimizer, loader, callbacks)
"""

from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train import __version__
from mlx_train.checkpointing.format import salvage_history, write_history_chunk
from mlx_train.checkpointing.storage import split_location
from mlx_train.errors import CheckpointError
from mlx_train.snapshot import has_frozen_parameters as has_frozen_parameters
from mlx_train.snapshot import rng_key as rng_key
from mlx_train.snapshot import saved_parameters as saved_parameters
from mlx_train.snapshot import set_rng_key as set_rng_key
from mlx_train.training.losses import METRIC_PREFIX, WINDOW_PREFIX


class HistoryWarning(UserWarning):
    """A checkpoint's per-epoch history could be read only in part; training state was restored whole."""


FORMAT_VERSION = 4  # 3: the history in chunk files beside the checkpoints; 4: the report window's own sums
RUNNING_KEYS = ("loss_sum", "items")


@lru_cache(maxsize=1)
def zero() -> mx.array:
    """The zero every fresh on-device sum starts from (arrays are immutable: one serves them all), made at its
    first use (not on import: no device work before the program has chosen its device).

    Example::

        running = {"loss_sum": zero(), "items": zero()}
    """
    return mx.array(0.0)


def summed_over_ranks(key: str) -> bool:
    """Whether running value ``key`` is a per-rank sum that reports add up over the ranks (the loss sum, the
    item count, a loss's metric sums, and the same over the report window): rank 0's checkpoint holds the total,
    so other ranks restart it at zero."""
    key = key.removeprefix(WINDOW_PREFIX)
    return key in RUNNING_KEYS or key.startswith(METRIC_PREFIX)

#: History entries (per key) a checkpoint's trainer_state.json holds at most; older ones are in chunk files.
HISTORY_CHUNK = 64


def assign_leaves(tree: Any, flat: dict[str, mx.array]) -> None:
    """Write ``flat`` (``"a.0.b" -> array``) into the existing ``tree`` of dicts and lists, in place.

    Only leaves change: containers, and empty subtrees, stay as they are.
    """
    for key, value in flat.items():
        node, parts = tree, key.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value


def check_keys(path: str, group: str, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Raise a CheckpointError when names or shapes of ``saved`` differ from ``expected``."""
    missing = sorted(set(expected) - set(saved))
    unknown = sorted(set(saved) - set(expected))
    if missing or unknown:
        detail = []
        if missing:
            detail.append(f"missing {len(missing)} (e.g. {', '.join(missing[:3])})")
        if unknown:
            detail.append(f"unexpected {len(unknown)} (e.g. {', '.join(unknown[:3])})")
        raise CheckpointError(
            f"checkpoint {path} does not match this {group}: {'; '.join(detail)}. "
            "Was it written for a different model or optimizer (or with other parameters frozen)? Build the "
            "same model and optimizer it was trained with, or start without --resume"
        )
    for key, value in expected.items():
        if saved[key].shape != value.shape:
            raise CheckpointError(
                f"checkpoint {path}: {group} entry '{key}' has shape {tuple(saved[key].shape)}, "
                f"the {group} has {tuple(value.shape)}; the checkpoint belongs to a differently sized model"
            )


def load_weights(model: Any, path: str, weights: dict[str, mx.array]) -> None:
    """Load flat weights (all parameters, or the trainable ones of a model with frozen parts) into
    ``model`` after checking names and shapes."""
    expected = dict(tree_flatten(model.parameters()))
    if set(weights) != set(expected):
        trainable = dict(tree_flatten(model.trainable_parameters()))
        if set(weights) == set(trainable):
            expected = trainable
    check_keys(path, "model", weights, expected)
    for key, value in weights.items():
        if value.dtype != expected[key].dtype:
            weights[key] = value.astype(expected[key].dtype)
    model.load_weights(list(weights.items()), strict=False)


@dataclass
class HistoryChunks:
    """The part of the history already stored in chunk files beside the checkpoints (see
    ``mlx_train.checkpointing.format``): the newest chunk's name, how many entries of each key the
    chunks hold, and the checkpoint directory they are in.

    Example::

        chunks = HistoryChunks()
        head, tail = chunks.split(history, "runs/a/checkpoints")   # tail: at most HISTORY_CHUNK entries a key
    """

    head: str | None = None
    stored: dict[str, int] = field(default_factory=dict)
    location: str | None = None

    def split(self, history: dict[str, list[Any]], location: str) -> tuple[str | None, dict[str, list[Any]]]:
        """(newest chunk, the entries after it) for a checkpoint saved in ``location``. Once the entries
        after the newest chunk reach ``HISTORY_CHUNK``, they are written as the next chunk first."""
        location = location.rstrip("/")
        if location != self.location:  # a checkpoint names chunks in its own directory
            self.head, self.stored, self.location = None, {}, location
        tail = {key: values[self.stored.get(key, 0):] for key, values in history.items()}
        if max(map(len, tail.values()), default=0) >= HISTORY_CHUNK:
            self.head = write_history_chunk(location, self.head, tail)
            self.stored = {key: len(values) for key, values in history.items()}
            tail = {key: [] for key in history}
        return self.head, tail

    @classmethod
    def restore(cls, path: str, state: dict[str, Any]) -> tuple[HistoryChunks, dict[str, list[Any]]]:
        """(the chunks, the whole history) of the checkpoint at ``path`` with the JSON ``state``."""
        location = split_location(path)[0].rstrip("/")
        head = state.get("history_chunk")
        history, problem = salvage_history(location, head)
        if problem is not None:
            # The history is a record of the epochs, not training state: the run goes on with what was read,
            # and the next checkpoint starts a new chain of chunks holding it.
            kept = max((len(v) for v in history.values()), default=0) + max(
                (len(v) for v in state["history"].values()), default=0)
            warnings.warn(f"checkpoint {path} needs {problem}. Its weights, optimizer and loop state are intact, so "
                          f"training goes on, but the per-epoch history keeps only its newest {kept} entries (the "
                          "older ones were in that file: put a copy back before resuming to keep them)",
                          HistoryWarning, stacklevel=2)
            chunks = cls(None, {}, location)
        else:
            chunks = cls(head, {key: len(values) for key, values in history.items()}, location)
        for key, values in state["history"].items():
            history.setdefault(key, []).extend(values)
        return chunks, history


@dataclass
class LoopState:
    """The Trainer's loop state (see the module docstring).

    ``running`` holds the epoch's on-device sums (``loss_sum``, ``items``, ``grad_norm``) and the
    report window's (``window:loss_sum``, ...), checkpointed so the first report after a resume
    covers the same steps as without the interruption; ``report_base`` the summed
    ``loss_sum``/``items`` at the last report. ``loss_scale`` is the
    container the compiled float16 step reads and writes: it is updated in place, never replaced.
    """

    step: int = 0
    epoch: int = 0
    running: dict[str, mx.array] = field(default_factory=dict)
    history: dict[str, list[Any]] = field(default_factory=dict)
    last_val: dict[str, Any] = field(default_factory=dict)
    report_base: dict[str, float] = field(default_factory=lambda: {"loss_sum": 0.0, "items": 0.0, "step": 0})
    trained_samples: int = 0
    trained_items: float = 0.0  # items the loss averaged over (tokens, for language models), as reported
    epoch_done: bool = False  # the current epoch's end (validation, history) already ran
    stop_training: bool = False
    micro_batch: dict[str, Any] = field(default_factory=dict)  # settings memory recovery settled on
    loss_scale: dict[str, mx.array] = field(default_factory=lambda: {"scale": mx.array(1.0),
                                                                      "good_steps": mx.array(0)})
    base_model: dict[str, Any] | None = None
    history_chunks: HistoryChunks = field(default_factory=HistoryChunks)

    # -- the verbs: the only code that changes the loop state (tests/test_loop_state_writers.py checks it) --

    def begin_epoch(self, epoch: int, zero: dict[str, mx.array]) -> None:
        """Start epoch ``epoch`` with fresh sums ``zero`` (the step's ``zero_running()``)."""
        self.epoch, self.epoch_done = epoch, False
        self.running = dict(zero)
        self.report_base = {"loss_sum": 0.0, "items": 0.0, "step": self.step}

    def advance(self, running: dict[str, mx.array], samples: int) -> None:
        """The step transition: one optimizer step on ``samples`` samples (over all ranks) gave ``running``."""
        self.running = running
        self.step += 1
        self.trained_samples += samples

    def close_window(self, totals: dict[str, float], items: float) -> None:
        """A report read the window (``totals``: the epoch's sums over ranks; ``items`` the window's): the next
        window starts here, its on-device sums back at zero (no sync)."""
        self.trained_items += items
        base = {k: v for k, v in totals.items() if not k.startswith(WINDOW_PREFIX)}
        base["step"] = self.step
        self.report_base = base
        fresh = zero()
        self.running = {k: fresh if k.startswith(WINDOW_PREFIX) else v for k, v in self.running.items()}

    def end_epoch(self, logs: dict[str, Any]) -> None:
        """The epoch's end ran (validation, logs): ``logs`` join the history, the epoch's sums are closed."""
        for key, value in {"epoch": self.epoch, **logs}.items():
            self.history.setdefault(key, []).append(value)
        self.running, self.epoch_done = {}, True

    @property
    def next_epoch(self) -> int:
        """The epoch to train next when the loader does not count epochs (a plain iterable)."""
        return self.epoch + 1 if self.epoch_done else self.epoch

    def record_validation(self, logs: dict[str, Any]) -> None:
        """The last validation's logs (saved with a checkpoint, added to the epoch's logs)."""
        self.last_val = logs

    def record_micro_batch(self, settings: dict[str, Any]) -> None:
        """The micro-batch settings memory recovery settled on (``MemoryGuard.settings()``)."""
        self.micro_batch = dict(settings)

    def set_running(self, values: dict[str, mx.array]) -> None:
        """Replace some running sums (distributed saves: rank 0 holds the totals, the others zero)."""
        self.running = {**self.running, **values}

    def request_stop(self, stop: bool = True) -> None:
        """Stop after the current step (``stop=False`` clears the flag, as a new ``train`` call does)."""
        self.stop_training = bool(stop)

    def set_base_model(self, base: dict[str, Any] | None) -> None:
        """The frozen base a checkpoint of trainable parameters needs (``{"path", "sha256"}``)."""
        self.base_model = base

    def set_loss_scale(self, scale: float) -> None:
        """The float16 loss scale to start from; written into the container the compiled step holds."""
        self.loss_scale["scale"] = mx.array(scale)

    # -- checkpoints ----------------------------------------------------------------------

    def capture(self, model: Any, optimizer: Any, loader: Any, callbacks: Any, config: Any,
                running: dict[str, float], world_size: int = 1,
                directory: str | None = None) -> tuple[dict[str, dict[str, mx.array]], dict[str, Any]]:
        """Return (arrays by group, JSON state). ``running`` holds the epoch's sums over every rank.

        With the checkpoint ``directory`` the state holds only the newest history entries and names
        the chunk file there that holds the others (written first when due); without it, the whole history.
        """
        head, history = self.history_chunks.split(self.history, directory) if directory else (None, self.history)
        cb_json, cb_arrays = callbacks.state()
        arrays = {
            "model": saved_parameters(model),
            "optimizer": dict(tree_flatten(optimizer.state)),
            "trainer": dict(self.loss_scale),
        }
        if cb_arrays:
            arrays["callbacks"] = cb_arrays
        state = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "epoch": loader.epoch if hasattr(loader, "epoch") else self.epoch,
            "loop_epoch": self.epoch,
            "epoch_done": self.epoch_done,
            "loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
            "rng_key": rng_key(),
            "history": history,
            "history_chunk": head,
            "stop_training": self.stop_training,
            "running": running,
            "report_base": self.report_base,
            "trained_samples": self.trained_samples,
            "trained_items": self.trained_items,
            "last_val": self.last_val,
            "micro_batch": self.micro_batch,
            "model_scope": "trainable" if has_frozen_parameters(model) else "all",
            "base_model": self.base_model,
            "callbacks": cb_json,
            "config": config.to_dict(),
            "world_size": world_size,
            "versions": {"mlx_train": __version__,
                         "mlx": mx.__version__,  # type: ignore[attr-defined]  # not in the stubs
                         "python": platform.python_version()},
        }
        return arrays, state

    def restore(self, path: str, arrays: dict[str, Any], state: dict[str, Any], model: Any, optimizer: Any, loader: Any,
                callbacks: Any, rank: int = 0) -> None:
        """Put a captured state back, in place. Off rank 0 the running sums start at zero (rank 0's
        hold the sums over every rank)."""
        if state.get("format_version") not in range(1, FORMAT_VERSION + 1):
            raise CheckpointError(
                f"checkpoint {path} has format version {state.get('format_version')}; this mlx-train reads "
                f"versions 1 to {FORMAT_VERSION}: upgrade mlx-train to read it"
            )
        self._check_base_model(path, state.get("base_model"))
        chunks, history = HistoryChunks.restore(path, state)  # before anything changes: it may be missing
        load_weights(model, path, dict(arrays["model"]))
        current = dict(tree_flatten(optimizer.state))
        check_keys(path, "optimizer", arrays["optimizer"], current)
        assign_leaves(optimizer.state, arrays["optimizer"])
        self.loss_scale["scale"] = arrays["trainer"]["loss_scale" if "loss_scale" in arrays["trainer"] else "scale"]
        self.loss_scale["good_steps"] = arrays["trainer"]["good_steps"]
        self.step = state["step"]
        self.epoch = state.get("loop_epoch", state["epoch"])
        self.epoch_done = state.get("epoch_done", False)
        self.history_chunks, self.history = chunks, history
        self.stop_training = state.get("stop_training", False)
        running = state["running"]
        self.running = {k: mx.array(0.0 if rank and summed_over_ranks(k) else v) for k, v in running.items()}
        self.report_base = state.get("report_base") or {"loss_sum": running.get("loss_sum", 0.0),
                                                        "items": running.get("items", 0.0), "step": self.step}
        if running and state["format_version"] < 4:  # saved before the report window had its own sums
            self.running.update({WINDOW_PREFIX + k: mx.array(0.0 if rank else v - self.report_base.get(k, 0.0))
                                 for k, v in running.items() if summed_over_ranks(k)})
        self.trained_samples = state.get("trained_samples", 0)
        self.trained_items = state.get("trained_items", 0.0)
        self.last_val = state.get("last_val") or {}
        self.micro_batch = state.get("micro_batch") or {}
        if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state["loader"])
        callbacks.load_state(state.get("callbacks", {}), arrays.get("callbacks", {}))
        set_rng_key(state["rng_key"])
        mx.eval(model.parameters(), optimizer.state, self.loss_scale)

    def _check_base_model(self, path: str, saved: dict[str, Any] | None) -> None:
        if not saved or not self.base_model:
            return
        if saved.get("sha256") and self.base_model.get("sha256") and saved["sha256"] != self.base_model["sha256"]:
            raise CheckpointError(
                f"checkpoint {path} was trained on base model {saved.get('path')} (sha256 {saved['sha256'][:12]}…), "
                f"but this run loads {self.base_model.get('path')} (sha256 {self.base_model['sha256'][:12]}…). "
                "The checkpoint holds only the trained parameters, so it needs the same base: load the base it "
                "names, or start without --resume"
            )
