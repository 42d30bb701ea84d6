"""Gradient checkpointing for one model instance: recompute block activations in the backward pass.

Each chosen block keeps only its inputs for the backward pass and runs its forward again there
(``mx.checkpoint``): less memory for about a third more compute. The blocks are ``model.layers``
by default (``model.model.layers`` in mlx-lm models), or the modules named by dotted paths
(``"encoder.layers"``, ``"blocks.3"``).

Only the given instance changes. Its blocks get a subclass of their own class whose
``__call__`` is checkpointed; the class itself, and every other instance of it in the process,
stay as they were (unlike patching ``type(block).__call__``). Parameter names and the module
tree are unchanged, so checkpoints and optimizer state are not affected.

Example::

    from mlx_train.training.recompute import enable_gradient_checkpointing
    enable_gradient_checkpointing(model)                      # model.layers
    enable_gradient_checkpointing(model, ["encoder.layers"])  # or named modules
    # the same through the Trainer: Trainer(model, gradient_checkpointing=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_train.errors import ConfigError, did_you_mean

__all__ = ["enable_gradient_checkpointing", "disable_gradient_checkpointing", "find_blocks", "is_checkpointed"]

_MARK = "_mlx_train_recompute"
DEFAULT_BLOCKS = ("layers", "model.layers")  # model.layers, or an mlx-lm model's model.model.layers
_SUBCLASSES: dict[type, type] = {}  # original class -> its checkpointed subclass


def _checkpointed_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` recomputes in the backward pass (one per class)."""
    if getattr(cls, _MARK, False):
        return cls
    if cls not in _SUBCLASSES:
        original = cls.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            def forward(params: Any, *inner_args: Any, **inner_kwargs: Any) -> Any:
                self.update(params)
                return original(self, *inner_args, **inner_kwargs)

            return mx.checkpoint(forward)(self.trainable_parameters(), *args, **kwargs)

        namespace = {"__call__": __call__, _MARK: True, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return _SUBCLASSES[cls]


def is_checkpointed(module: nn.Module) -> bool:
    """True when ``module`` recomputes its activations in the backward pass."""
    return bool(getattr(type(module), _MARK, False))


def _is_blocks(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, nn.Module) for v in value)


def _children(obj: Any) -> list[str]:
    """Names of the modules and module lists under ``obj`` (lists first: they are what repeats)."""
    if isinstance(obj, dict):
        lists = [k for k, v in obj.items() if _is_blocks(v)]
        return lists + [k for k, v in obj.items() if isinstance(v, nn.Module)]
    return [str(i) for i in range(len(obj))] if isinstance(obj, (list, tuple)) else []


def _lookup(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for depth, part in enumerate(path.split(".")):
        if isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, nn.Module) and not part.startswith("_") and hasattr(obj, part):
            obj = getattr(obj, part)  # a plain attribute: reported below as not a module
        else:
            where = ".".join(path.split(".")[:depth]) or type(model).__name__
            children = _children(obj)
            raise ConfigError(
                f"checkpoint_modules: {type(model).__name__} has no module '{path}' ({where} has no "
                f"'{part}'{did_you_mean(part, children)}; its children: {', '.join(children) or 'none'})"
            )
    return obj


def _has_blocks(model: nn.Module, path: str) -> bool:
    node: Any = model
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return _is_blocks(node)


def find_blocks(model: nn.Module, modules: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` blocks that gradient checkpointing would recompute.

    ``modules`` are dotted paths to a module or to a list of modules (each element is a block);
    empty or None means ``model.layers``, or ``model.model.layers`` where the blocks live there
    (mlx-lm models, whose ``layers`` is a property). Raises ConfigError naming what the model has instead.

    Example::

        find_blocks(model)       # [("layers.0", TransformerBlock), ("layers.1", TransformerBlock)]
    """
    paths = list(modules or [])
    if not paths:
        found = [path for path in DEFAULT_BLOCKS if _has_blocks(model, path)]
        if not found:
            children = _children(model)
            raise ConfigError(
                f"gradient checkpointing recomputes model.layers (model.model.layers in mlx-lm models) by default, "
                f"but {type(model).__name__} has no 'layers'; name its repeated blocks with checkpoint_modules (its "
                f"children: {', '.join(children) or 'none'}), e.g. "
                f"checkpoint_modules=['{children[0] if children else 'blocks'}']"
            )
        paths = found[:1]
    blocks: list[tuple[str, nn.Module]] = []
    for path in paths:
        if not isinstance(path, str) or not path.strip(" ."):
            raise ConfigError(f"checkpoint_modules entries are dotted module paths like 'layers', got {path!r}")
        found = _lookup(model, path)
        if isinstance(found, nn.Module):
            blocks.append((path, found))
        elif _is_blocks(found):
            blocks.extend((f"{path}.{i}", m) for i, m in enumerate(found))
        else:
            raise ConfigError(f"checkpoint_modules: '{path}' of {type(model).__name__} is of type "
                              f"{type(found).__name__}, not a module or a non-empty list of modules")
    return blocks


def enable_gradient_checkpointing(model: nn.Module, modules: Sequence[str] | None = None) -> list[str]:
    """Recompute the activations of ``model``'s blocks in the backward pass; returns their paths.

    Calling it again is harmless. Other instances of the blocks' classes are not changed.

    Example::

        enable_gradient_checkpointing(model)      # ["layers.0", "layers.1", ...]
    """
    blocks = find_blocks(model, modules)
    for path, block in blocks:
        try:
            block.__class__ = _checkpointed_class(type(block))
        except TypeError as error:  # a class with __slots__ or a C++ module
            raise ConfigError(f"cannot checkpoint '{path}' ({type(block).__name__}): {error}") from None
    return [path for path, _ in blocks]


def disable_gradient_checkpointing(model: nn.Module) -> list[str]:
    """Undo ``enable_gradient_checkpointing`` on every block of ``model``; returns their paths."""
    restored = []
    for path, module in model.named_modules():
        if is_checkpointed(module):
            module.__class__ = type(module).__bases__[0]
            restored.append(path)
    return restored
