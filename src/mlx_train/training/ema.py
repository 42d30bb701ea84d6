"""An exponential moving average of the weights, updated inside the compiled step.

``ema = decay * ema + (1 - decay) * weights`` after every optimizer update (``in_step``), kept in
float32 in ``step_state`` (captured by the compiled step, filled in place). Validation uses the
average (``validation_weights``); ``apply_to(model)`` or ``weights()`` give it for export. The
average is callback state: it is saved in checkpoints and a resumed run continues it bit for bit.

Example::

    from mlx_train.training import EMA, Trainer

    ema = EMA(decay=0.999)
    trainer.train(data, val_data, epochs=10, callbacks=[ema])   # val_loss is the average's
    ema.apply_to(model)                                           # export the averaged weights
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_train.checkpointing import load_checkpoint
from mlx_train.errors import CheckpointError, ConfigError
from mlx_train.training.callbacks import Callback
from mlx_train.training.extensions import StepExtension

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer
from mlx_train.training.pruning import trainable_owners

PREFIX = "EMA/weights."  # where a checkpoint's "callbacks" arrays hold the average


class EMA(Callback, StepExtension):
    """Exponential moving average of the trainable weights, used for validation and export.

    ``decay`` in [0, 1): the weight of the old average at each step (0.999 averages over roughly
    the last 1000 steps). ``validate`` (default True) evaluates with the average. With ``pruning``
    (a ``Pruning`` callback of the same run) the average is masked like the weights, so it is as
    sparse as the model.

    Example::

        ema = EMA(decay=0.999)
        trainer.train(data, val_data, callbacks=[ema])
        averaged = ema.weights()          # {"layers.0.weight": ..., ...}
    """

    def __init__(self, decay: float = 0.999, validate: bool = True, pruning: Any = None) -> None:
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"EMA decay must be in [0, 1), got {decay} (0.999 averages over ~1000 steps)")
        self.decay, self.validate, self.pruning = decay, validate, pruning
        #: Captured by the compiled step: ``{"weights": {flat name: float32 array}}``, filled in place.
        self.step_state: dict[str, dict[str, mx.array]] = {"weights": {}}
        self._owners: dict[str, tuple[nn.Module, str]] = {}

    def on_fit_start(self, trainer: Trainer) -> None:
        self._owners = trainable_owners(trainer.model)
        average = self.step_state["weights"]
        if average:  # restored from a checkpoint
            if set(average) != set(self._owners):
                missing = sorted(set(self._owners) - set(average))[:3]
                raise ConfigError(f"the checkpoint's EMA weights do not match this model's trainable parameters "
                                  f"(e.g. missing {missing}); resume with the same model and frozen layers")
            return
        for name, (module, key) in self._owners.items():
            average[name] = module[key].astype(mx.float32) + 0  # a copy: never the parameter itself
        mx.eval(average)

    def in_step(self, model: nn.Module, optimizer: Any) -> None:
        """Inside the compiled update, after the optimizer: move the average towards the new weights."""
        average = self.step_state["weights"]
        masks = self.pruning.step_state["masks"] if self.pruning is not None else {}
        for name, value in average.items():
            module, key = self._owners[name]
            new = self.decay * value + (1.0 - self.decay) * module[key].astype(mx.float32)
            average[name] = mx.where(masks[name], new, 0) if name in masks else new

    def weights(self) -> dict[str, mx.array]:
        """The averaged weights in the model's dtypes: ``flat name -> array``.

        Example::

            mx.save_safetensors("ema.safetensors", ema.weights())
        """
        return {name: value.astype(self._owners[name][0][self._owners[name][1]].dtype) if name in self._owners
                else value for name, value in self.step_state["weights"].items()}

    def apply_to(self, model: nn.Module) -> None:
        """Load the averaged weights into ``model`` (for export or a final evaluation).

        Example::

            ema.apply_to(model); export(model, ...)
        """
        model.load_weights(list(self.weights().items()), strict=False)
        mx.eval(model.parameters())

    def validation_weights(self) -> dict[str, mx.array] | None:
        return self.weights() if self.validate and self.step_state["weights"] else None

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(self.step_state["weights"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        average = self.step_state["weights"]  # the compiled step holds this dict: fill it, never replace it
        average.clear()
        average.update(tree_flatten(state.get("weights", {})))


def checkpoint_ema_weights(path: str) -> dict[str, mx.array]:
    """The EMA weights saved in checkpoint ``path`` (``flat name -> array``), for export from a checkpoint.

    Example::

        model.load_weights(list(checkpoint_ema_weights("runs/a/checkpoints/step-00000400").items()))
    """
    try:
        arrays, _ = load_checkpoint(path, groups=["callbacks"])
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path} holds no callback arrays, so no EMA weights: was it trained "
                              f"with ema_decay set (or callbacks=[EMA(...)])? ({error})") from error
    weights = {k[len(PREFIX):]: v for k, v in arrays["callbacks"].items() if k.startswith(PREFIX)}
    if not weights:
        raise CheckpointError(f"checkpoint {path} holds no EMA weights: it was trained without an EMA; train with "
                              f"--set ema_decay=0.999 (or callbacks=[EMA(...)]), or export without --ema")
    return weights

