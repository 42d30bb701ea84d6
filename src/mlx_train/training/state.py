"""Capture and restore the whole training state (what a checkpoint holds).

Arrays go to safetensors groups (``model``, ``optimizer``, ``trainer``, ``callbacks``); everything
else is JSON (``trainer_state.json``): step, epoch, data position, history, running metrics,
callback state, the config and the versions that wrote it.
"""

from __future__ import annotations

import platform
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.errors import CheckpointError

FORMAT_VERSION = 1


def rng_key() -> list[int]:
    """The global MLX PRNG key as two Python ints."""
    return [int(v) for v in mx.random.state[0].tolist()]


def set_rng_key(key: list[int]) -> None:
    """Set the global MLX PRNG key to exactly ``key`` (seed() maps a 64-bit seed to [hi, lo])."""
    mx.random.seed((int(key[0]) << 32) | int(key[1]))


def capture(trainer: Any, loader: Any, callbacks: Any) -> tuple[dict[str, dict[str, mx.array]], dict]:
    """Return (arrays by group, JSON state) for the trainer at the end of a step."""
    from mlx_train import __version__

    cb_json, cb_arrays = callbacks.state()
    steps = trainer._steps
    arrays = {
        "model": dict(tree_flatten(trainer.model.parameters())),
        "optimizer": dict(tree_flatten(trainer.optimizer.state)),
        "trainer": {"loss_scale": steps.scaler["scale"], "good_steps": steps.scaler["good_steps"]},
    }
    if cb_arrays:
        arrays["callbacks"] = cb_arrays
    state = {
        "format_version": FORMAT_VERSION,
        "step": trainer.step,
        "epoch": loader.epoch if hasattr(loader, "epoch") else trainer.epoch,
        "loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
        "rng_key": rng_key(),
        "history": trainer.history,
        "stop_training": trainer.stop_training,
        "running": {k: float(v.item()) for k, v in trainer._metrics.items()},
        "last_val": trainer._last_val,
        "callbacks": cb_json,
        "config": trainer.config.to_dict(),
        "world_size": steps.world_size,
        "versions": {"mlx_train": __version__, "mlx": mx.__version__, "python": platform.python_version()},
    }
    return arrays, state


def _check_keys(path: str, group: str, saved: dict, expected: dict) -> None:
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
            "Was it written for a different model or optimizer? Build the same model and optimizer it was "
            "trained with, or start without --resume"
        )
    for key, value in expected.items():
        if saved[key].shape != value.shape:
            raise CheckpointError(
                f"checkpoint {path}: {group} entry '{key}' has shape {tuple(saved[key].shape)}, "
                f"the {group} has {tuple(value.shape)}; the checkpoint belongs to a differently sized model"
            )


def load_weights(model: Any, path: str, weights: dict[str, mx.array]) -> None:
    """Load flat weights into ``model`` after checking names and shapes."""
    _check_keys(path, "model", weights, dict(tree_flatten(model.parameters())))
    model.update(tree_unflatten(list(weights.items())))


def restore(trainer: Any, path: str, arrays: dict, state: dict, loader: Any, callbacks: Any) -> None:
    """Put a captured state back, in place (the compiled step keeps the same containers)."""
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {state.get('format_version')}; this mlx-train reads "
            f"version {FORMAT_VERSION}"
        )
    load_weights(trainer.model, path, arrays["model"])
    current = dict(tree_flatten(trainer.optimizer.state))
    _check_keys(path, "optimizer", arrays["optimizer"], current)
    trainer.optimizer.state.update(tree_unflatten(list(arrays["optimizer"].items())))
    trainer._steps.scaler["scale"] = arrays["trainer"]["loss_scale"]
    trainer._steps.scaler["good_steps"] = arrays["trainer"]["good_steps"]
    trainer.step = state["step"]
    trainer.epoch = state["epoch"]
    trainer.history = state["history"]
    trainer.stop_training = state.get("stop_training", False)
    trainer._metrics = {k: mx.array(v) for k, v in state["running"].items()}
    trainer._last_val = state.get("last_val") or {}
    if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state["loader"])
    callbacks.load_state(state.get("callbacks", {}), arrays.get("callbacks", {}))
    set_rng_key(state["rng_key"])
    mx.eval(trainer.model.parameters(), trainer.optimizer.state)
