"""Putting a step's state back: MLX's random key and the arrays of a nested state, by slot; the
parameters a checkpoint holds.

Used wherever a step is run and then undone (memory recovery, probing, counting collectives).

Example::

    slots = array_slots(step.state, [])
    saved, key = [c[k] for c, k in slots], rng_key()
    ...                                           # a step that must leave no trace
    for (c, k), value in zip(slots, saved): c[k] = value
    set_rng_key(key)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def rng_key() -> list[int]:
    """The global MLX PRNG key as two Python ints."""
    return [int(v) for v in mx.random.state[0].tolist()]  # type: ignore[index]  # a list; stubs say object


def set_rng_key(key: list[int]) -> None:
    """Set the global MLX PRNG key to exactly ``key`` (seed() maps a 64-bit seed to [hi, lo])."""
    mx.random.seed((int(key[0]) << 32) | int(key[1]))


def array_slots(tree: Any, out: list[Any]) -> list[Any]:
    """``(container, key)`` of every array in the step state, in a fixed order (``mx.random.state`` is
    not a list: its key is saved apart)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        if isinstance(value, mx.array):
            out.append((tree, key))
        elif isinstance(value, (dict, list)):
            array_slots(value, out)
    return out


def has_frozen_parameters(model: Any) -> bool:
    """True when some of the model's parameters are frozen (not trained)."""
    return len(tree_flatten(model.trainable_parameters())) != len(tree_flatten(model.parameters()))


def saved_parameters(model: Any) -> dict[str, mx.array]:
    """The parameters a checkpoint holds: all of them, or only the trainable ones when some are frozen
    (a LoRA fine-tune then saves megabytes, not the whole base model)."""
    tree = model.trainable_parameters() if has_frozen_parameters(model) else model.parameters()
    return dict(tree_flatten(tree))
