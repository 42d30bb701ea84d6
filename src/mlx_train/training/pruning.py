"""Magnitude pruning as a callback: masks chosen by weight magnitude on a schedule, applied in the step.

At the schedule's steps (``on_batch_end``, outside the compiled step) the smallest weights by
magnitude are masked, globally or per tensor, to the schedule's sparsity: polynomial (Zhu & Gupta,
"To prune, or not to prune", 2017: ``s_t = s_f + (s_i - s_f) * (1 - progress) ** 3`` every
``frequency`` steps from ``start_step`` to ``end_step``) or one-shot (all of it at ``start_step``).
The masks live in ``step_state``, which the compiled step captures, and ``in_step`` applies
them to the weights after every update: a pruned weight stays exactly 0, whatever its optimizer
moments say. The moments of pruned weights are zeroed at each mask update (and after every step
with ``zero_moments="step"``, which costs a few elementwise operations per step). New masks are
written into the existing container (the compiled step holds it), never a new one. Masks and the schedule position are
callback state, so a run killed mid-schedule resumes bit for bit.

Example::

    from mlx_train.training import Pruning, Trainer

    pruning = Pruning(sparsity=0.9, start_step=100, end_step=1000, frequency=50)
    trainer.train(data, epochs=10, callbacks=[pruning])
    pruning.sparsity()        # {"sparsity": 0.9, "sparsity/layers.0": 0.93, ...}
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_train.errors import ConfigError
from mlx_train.training.callbacks import Callback
from mlx_train.training.extensions import StepExtension

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer

SCHEDULES = ("polynomial", "one_shot")
SCOPES = ("global", "layer")
# Layers whose ``weight`` is pruned by default: dense and convolution kernels (not biases, norms, embeddings).
PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def trainable_owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every trainable parameter as ``flat name -> (owning module, attribute)``: the compiled step
    replaces parameters through their module, so extensions hold modules, not arrays.

    Example::

        trainable_owners(nn.Linear(2, 3))     # {"weight": (Linear, "weight"), "bias": (Linear, "bias")}
    """
    trainable = {str(flat[0]) for flat in tree_flatten(model.trainable_parameters())}
    owners: dict[str, tuple[nn.Module, str]] = {}
    for module_name, module in model.named_modules():
        for key, value in module.items():
            name = f"{module_name}.{key}" if module_name else key
            if isinstance(value, mx.array) and name in trainable:
                owners[name] = (module, key)
    return owners


def prunable_weights(model: nn.Module, patterns: Sequence[str] | None = None) -> dict[str, tuple[nn.Module, str]]:
    """The trainable parameters pruning applies to: ``flat name -> (owning module, attribute)``.

    By default the ``weight`` of every Linear and convolution layer; with ``patterns`` (shell-style,
    e.g. ``["layers.*.weight"]``) every trainable parameter whose flat name matches one of them.

    Example::

        prunable_weights(MLP(64, (128,), 10))     # {"layers.0.weight": (Linear, "weight"), ...}
    """
    owners = trainable_owners(model)
    if patterns is None:
        chosen = {n: o for n, o in owners.items() if o[1] == "weight" and isinstance(o[0], PRUNABLE)}
        if not chosen:
            raise ConfigError(
                f"Pruning found no trainable Linear or convolution weight in {type(model).__name__}; name the "
                f"parameters to prune with parameters=[...] (trainable: {', '.join(sorted(owners)[:8])})")
        return chosen
    chosen = {}
    for pattern in patterns:
        matched = {n: o for n, o in owners.items() if fnmatch.fnmatchcase(n, pattern)}
        if not matched:
            raise ConfigError(
                f"Pruning parameters pattern '{pattern}' matches no trainable parameter of "
                f"{type(model).__name__}; names look like: {', '.join(sorted(owners)[:8])}")
        chosen.update(matched)
    return chosen


class Pruning(Callback, StepExtension):
    """Magnitude pruning to ``sparsity`` on a schedule; pruned weights stay exactly 0.

    ``schedule``: ``"polynomial"`` (Zhu & Gupta: from ``initial_sparsity`` at ``start_step`` to
    ``sparsity`` at ``end_step``, masks recomputed every ``frequency`` steps, cubic)
    or ``"one_shot"`` (``sparsity`` at once at ``start_step``). ``end_step`` defaults to the run's
    last step. ``scope``: ``"global"`` (one magnitude threshold over all pruned tensors) or
    ``"layer"`` (each tensor to the same sparsity; safer when layers differ in scale, where one global
    threshold can empty a whole layer). ``parameters``: shell-style patterns of flat
    parameter names (default: weights of Linear and convolution layers). Reports and epoch logs
    get ``sparsity`` and ``sparsity/<layer>``. ``zero_moments``: ``"update"`` zeroes the optimizer
    moments of pruned weights when masks change, ``"step"`` after every update as well.

    Example::

        Pruning(sparsity=0.8, start_step=0, end_step=2000, frequency=100, scope="layer")
        Pruning(sparsity=0.5, schedule="one_shot", start_step=500, parameters=["layers.*.weight"])
    """

    def __init__(self, sparsity: float, start_step: int = 0, end_step: int | None = None, frequency: int = 100,
                 schedule: str = "polynomial", scope: str = "global", parameters: Sequence[str] | None = None,
                 initial_sparsity: float = 0.0, zero_moments: str = "update") -> None:
        for label, value in (("sparsity", sparsity), ("initial_sparsity", initial_sparsity)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"Pruning {label} must be in [0, 1), got {value}")
        if schedule not in SCHEDULES:
            raise ConfigError(f"Pruning schedule must be one of {', '.join(SCHEDULES)}, got '{schedule}'")
        if scope not in SCOPES:
            raise ConfigError(f"Pruning scope must be 'global' (one threshold) or 'layer' (each tensor), got '{scope}'")
        if zero_moments not in ("update", "step"):
            raise ConfigError(f"Pruning zero_moments must be 'update' (when masks change) or 'step' (after every "
                              f"update), got '{zero_moments}'")
        if frequency < 1 or start_step < 0:
            raise ConfigError(f"Pruning needs frequency >= 1 and start_step >= 0, got {frequency} and {start_step}")
        if end_step is not None and end_step <= start_step and schedule == "polynomial":
            raise ConfigError(f"Pruning end_step ({end_step}) must come after start_step ({start_step}); "
                              "for pruning at a single step use schedule='one_shot'")
        if isinstance(parameters, str):
            parameters = [parameters]
        self.target, self.start_step, self.end_step, self.frequency = sparsity, start_step, end_step, frequency
        self.schedule, self.scope, self.patterns = schedule, scope, parameters
        self.initial_sparsity, self.zero_moments = initial_sparsity, zero_moments
        #: Captured by the compiled step: ``{"masks": {flat name: bool array}}``, filled in place.
        self.step_state: dict[str, dict[str, mx.array]] = {"masks": {}}
        self.last_update: int | None = None  # the step whose masks are in step_state
        self._owners: dict[str, tuple[nn.Module, str]] = {}
        self._sparsity: dict[str, float] = {}

    # -- the schedule ---------------------------------------------------------------------

    def sparsity_at(self, step: int) -> float | None:
        """The sparsity the schedule sets at ``step``, or None when the masks do not change then.

        Example::

            Pruning(0.9, start_step=0, end_step=100, frequency=10).sparsity_at(50)    # 0.7875
        """
        if step < self.start_step:
            return None
        if self.schedule == "one_shot":
            return self.target if step == self.start_step else None
        end = self._end()
        if step > end or ((step - self.start_step) % self.frequency and step != end):
            return None
        progress = (step - self.start_step) / (end - self.start_step)
        return self.target + (self.initial_sparsity - self.target) * (1.0 - progress) ** 3

    def _end(self) -> int:
        if self.end_step is None:
            raise ConfigError("Pruning with schedule='polynomial' needs an end_step (or a run of known length: "
                              "set epochs on a dataset with a length, or max_steps)")
        return self.end_step

    # -- events ---------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer) -> None:
        self._owners = prunable_weights(trainer.model, self.patterns)
        if self.end_step is None and self.schedule == "polynomial" and trainer.total_steps:
            self.end_step = trainer.total_steps
            if self.end_step <= self.start_step:
                raise ConfigError(f"Pruning start_step ({self.start_step}) is not before the run's last step "
                                  f"({self.end_step}); lower start_step or train longer")
        if self.schedule == "polynomial":
            self._end()  # no end_step and a run of unknown length: say so now, not at start_step
        masks = self.step_state["masks"]
        if masks:  # restored from a checkpoint: same tensors and shapes as this model's
            if set(masks) != set(self._owners):
                raise ConfigError(
                    f"the checkpoint's pruning masks cover {sorted(masks)[:4]}..., this model's pruned parameters "
                    f"are {sorted(self._owners)[:4]}...; resume with the same model and Pruning(parameters=...)")
        else:  # all ones: the compiled step sees one structure from the first step on
            for name, (module, key) in self._owners.items():
                masks[name] = mx.ones(module[key].shape, dtype=mx.bool_)
            mx.eval(masks)
        self._measure()
        self._maybe_update(trainer, trainer.step)

    def on_batch_end(self, trainer: Trainer, step: int) -> None:
        self._maybe_update(trainer, step)

    def in_step(self, model: nn.Module, optimizer: Any) -> None:
        """Inside the compiled update, after the optimizer: zero the pruned weights (and their moments
        with ``zero_moments="step"``)."""
        self._apply(optimizer, moments=self.zero_moments == "step")

    def _apply(self, optimizer: Any, moments: bool) -> None:
        for name, mask in self.step_state["masks"].items():
            module, key = self._owners[name]
            module[key] = mx.where(mask, module[key], 0)
            if moments:
                _mask_moments(optimizer.state, name, mask)

    def report_metrics(self) -> dict[str, float]:
        return self.sparsity()

    def sparsity(self) -> dict[str, float]:
        """Fraction of pruned weights: ``sparsity`` over all pruned tensors, ``sparsity/<layer>`` for each
        (``.weight`` dropped from the name). Read from the masks, so it costs no device sync."""
        return dict(self._sparsity)

    def state_dict(self) -> dict[str, Any]:
        return {"masks": dict(self.step_state["masks"]), "last_update": self.last_update, "end_step": self.end_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masks = self.step_state["masks"]  # the compiled step holds this dict: fill it, never replace it
        masks.clear()
        masks.update(tree_flatten(state.get("masks", {})))
        self.last_update, self.end_step = state.get("last_update"), state.get("end_step", self.end_step)

    # -- mask updates (outside the compiled step) ----------------------------------------

    def _maybe_update(self, trainer: Trainer, step: int) -> None:
        target = self.sparsity_at(step)
        if target is None or step == self.last_update:
            return
        weights = {name: module[key] for name, (module, key) in self._owners.items()}
        masks = _magnitude_masks(weights, target, self.scope)
        self.step_state["masks"].update(masks)
        # Apply at once: reports, validation and a checkpoint taken at this step see the pruned weights.
        self._apply(trainer.optimizer, moments=True)
        mx.eval(trainer.model.parameters(), trainer.optimizer.state)
        self.last_update = step
        self._measure()

    def _measure(self) -> None:
        masks = self.step_state["masks"]
        kept = {name: int(np.array(mask).sum()) for name, mask in masks.items()}
        total = sum(m.size for m in masks.values())
        values = {"sparsity": 1.0 - sum(kept.values()) / total if total else 0.0}
        for name, mask in sorted(masks.items()):
            values[f"sparsity/{name.removesuffix('.weight')}"] = 1.0 - kept[name] / mask.size
        self._sparsity = values


def _magnitude_masks(weights: dict[str, mx.array], sparsity: float, scope: str) -> dict[str, mx.array]:
    """Keep-masks that drop the ``sparsity`` fraction of smallest magnitudes (over all tensors, or each).

    Exactly ``round(sparsity * n)`` entries are dropped (ties broken by position), so the result is
    the same on every run and every rank; weights pruned before are 0 and are dropped again first.
    """
    magnitudes = {name: np.abs(np.array(w.astype(mx.float32))).reshape(-1) for name, w in weights.items()}
    groups = [list(magnitudes)] if scope == "global" else [[name] for name in magnitudes]
    masks = {}
    for names in groups:
        flat = np.concatenate([magnitudes[n] for n in names])
        drop = round(sparsity * flat.size)
        keep = np.ones(flat.size, dtype=bool)
        if drop:
            keep[np.argsort(flat, kind="stable")[:drop]] = False
        offset = 0
        for n in names:
            size = magnitudes[n].size
            masks[n] = mx.array(keep[offset:offset + size].reshape(weights[n].shape))
            offset += size
    return masks


def _mask_moments(state: Any, name: str, mask: mx.array) -> None:
    """Zero the optimizer's per-weight state (Adam's m and v, SGD's momentum) of pruned weights, in place.

    Entries of another shape (Adafactor's factored moments) are left as they are."""
    node = state
    for part in name.split("."):
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, mx.array) and value.shape == mask.shape:
                node[key] = mx.where(mask, value, 0)
