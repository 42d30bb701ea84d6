"""The built-in models and datasets that ``mlx-train train`` uses out of the box (and the tests train).

``mlx_train.builtin.models`` (an MLP, a small CNN, a character-level Transformer) and
``mlx_train.builtin.datasets`` (scikit-learn's digits, a text corpus) load MLX and NumPy; this
module only names them, so that ``mlx-train train --help`` can list them without loading either.

Example::

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model

    data = load_dataset("digits")
    model = build_model("mlp", data["info"], hidden_dims=[256])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_train.errors import ConfigError, did_you_mean

# The registries in models.py and datasets.py hold exactly these names (a test checks it).
MODELS: tuple[str, ...] = ("cnn", "mlp", "transformer")
DATASETS: tuple[str, ...] = ("digits", "text")


def _type_error(value: Any, default: Any) -> str | None:
    """Why ``value`` does not fit the type of ``default`` (None when it fits)."""
    if default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "a number"
    if isinstance(default, (tuple, list)):
        ok = isinstance(value, (tuple, list)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
        return None if ok else "a list of integers, e.g. [128, 128]"
    if isinstance(default, str):
        return "a string"
    return None


def check_options(kind: str, name: str, options: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Raise ConfigError for an option not in ``defaults`` or of the wrong type.

    Example::

        check_options("model", "mlp", {"hiden_dims": [64]}, {"hidden_dims": (128,)})
        # ConfigError: unknown option 'hiden_dims' for model 'mlp' (did you mean 'hidden_dims'?) ...
    """
    for key, value in options.items():
        if key not in defaults:
            valid = ", ".join(sorted(defaults)) or "(none)"
            raise ConfigError(
                f"unknown option '{key}' for {kind} '{name}'{did_you_mean(key, defaults)}; "
                f"valid options: {valid}"
            )
        expected = _type_error(value, defaults[key])
        if expected:
            raise ConfigError(
                f"option '{key}' of {kind} '{name}' must be {expected}, got {value!r}"
            )
