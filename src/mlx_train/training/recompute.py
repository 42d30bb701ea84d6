"""Gradient checkpointing for one model instance: recompute block activations in the backward pass.

Each chosen block keeps only its inputs for the backward pass and runs its forward again there
(``mx.checkpoint``): less memory for about a third more compute. The blocks are ``model.layers``
by default (``model.model.layers`` in mlx-lm models), or the modules named by dotted paths
(``"encoder.layers"``, ``"blocks.3"``).

``granularity="attention"`` recomputes only each block's attention module (``self_attn`` in
mlx-lm models; see ``ATTENTION_NAMES``): where attention is not fused (MLX's CPU build runs
``mx.fast.scaled_dot_product_attention`` as plain operations) a trained block otherwise keeps
its ``batch x heads x length x length`` attention probabilities for the backward pass, most of
its activations at long sequence lengths; the recomputation is the attention module's forward
alone (its projections and the attention), a fraction of the block's.

``granularity="auto"`` (``mlx-train finetune``'s default) recomputes each block's attention module the
same way, but only in calls on rows of at least ``AUTO_MIN_TOKENS`` tokens (1024): there its
attention probabilities are most of a block's activations; on shorter rows they are a small part, and
recomputing the module would cost 3-10% of a step to save little. The length is read from the
module's input when the step is traced, so each batch shape gets its own choice.

Only the given instance changes. Its blocks get a subclass of their own class whose
``__call__`` is checkpointed; the class itself, and every other instance of it in the process,
stay as they were (unlike patching ``type(block).__call__``). Parameter names and the module
tree are unchanged, so checkpoints and optimizer state are not affected.

Example::

    from mlx_train.training.recompute import enable_gradient_checkpointing
    enable_gradient_checkpointing(model)                      # model.layers
    enable_gradient_checkpointing(model, ["encoder.layers"])  # or named modules
    enable_gradient_checkpointing(model, granularity="attention")  # model.layers.0.self_attn, ...
    enable_gradient_checkpointing(model, granularity="auto")       # the same, on rows of >= 1024 tokens
    # the same through the Trainer: Trainer(model, gradient_checkpointing=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_train.errors import ConfigError, did_you_mean

__all__ = ["GRANULARITIES", "ATTENTION_NAMES", "AUTO_MIN_TOKENS", "enable_gradient_checkpointing",
           "disable_gradient_checkpointing", "find_attention", "find_blocks", "is_checkpointed"]

_MARK = "_mlx_train_recompute"
DEFAULT_BLOCKS = ("layers", "model.layers")  # model.layers, or an mlx-lm model's model.model.layers
_SUBCLASSES: dict[tuple[type, bool], type] = {}  # (original class, long rows only) -> its checkpointed subclass
#: What is recomputed: each block whole, each block's attention module, or that on long rows only.
GRANULARITIES = ("blocks", "attention", "auto")
#: ``granularity="auto"``: the shortest rows (tokens, the second-to-last axis of the module's input) whose
#: attention is recomputed. At 1024 tokens a SmolLM2 block's attention probabilities (9 heads) match the rest
#: of its activations; at 256 they are a quarter of them.
AUTO_MIN_TOKENS = 1024
#: The names a block's attention module goes by (mlx-lm models: self_attn), tried in this order.
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")


def _rows_are_long(args: tuple[Any, ...]) -> bool:
    """Whether a call's input (its first argument, ``[..., tokens, features]``) has ``AUTO_MIN_TOKENS`` tokens or
    more; an input of another kind counts as long."""
    x = args[0] if args else None
    if not isinstance(x, mx.array) or x.ndim < 2:
        return True
    return x.shape[-2] >= AUTO_MIN_TOKENS


def _checkpointed_class(cls: type, long_only: bool = False) -> type:
    """A subclass of ``cls`` whose ``__call__`` recomputes in the backward pass (one per class and kind);
    ``long_only``: only in calls on rows of at least ``AUTO_MIN_TOKENS`` tokens."""
    if getattr(cls, _MARK, False):
        cls = cls.__bases__[0]
    if (cls, long_only) not in _SUBCLASSES:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if long_only and not _rows_are_long(args):
                return cls.__call__(self, *args, **kwargs)

            def forward(params: Any, *inner_args: Any, **inner_kwargs: Any) -> Any:
                self.update(params)
                return cls.__call__(self, *inner_args, **inner_kwargs)  # looked up now: the class's current call

            return mx.checkpoint(forward)(self.trainable_parameters(), *args, **kwargs)

        namespace = {"__call__": __call__, _MARK: True, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        _SUBCLASSES[cls, long_only] = type(cls.__name__, (cls,), namespace)
    return _SUBCLASSES[cls, long_only]


def is_checkpointed(module: nn.Module) -> bool:
    """True when ``module`` recomputes its activations in the backward pass (with ``granularity="auto"``: on
    long rows)."""
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


def find_attention(block: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, module)`` of ``block``'s attention module (the first of ``ATTENTION_NAMES`` it has), or None.

    Example: ``find_attention(model.model.layers[0])`` -> ``("self_attn", Attention)`` for an mlx-lm llama.
    """
    for name in ATTENTION_NAMES:
        child = block.get(name)
        if isinstance(child, nn.Module):
            return name, child
    return None


def _attention_of(blocks: list[tuple[str, nn.Module]], granularity: str) -> list[tuple[str, nn.Module]]:
    """The attention modules of the blocks that have one (a hybrid model's other blocks are left
    alone); ConfigError when none has."""
    found = [(f"{path}.{attention[0]}", attention[1]) for path, block in blocks
             if (attention := find_attention(block)) is not None]
    if not found:
        path, block = blocks[0]
        children = _children(block)
        raise ConfigError(
            f"gradient_checkpointing: {granularity} recomputes each block's attention module (a child named "
            f"{', '.join(ATTENTION_NAMES)}), but '{path}' ({type(block).__name__}) and the other blocks have none "
            f"(its children: {', '.join(children) or 'none'}); recompute whole blocks instead "
            "(gradient_checkpointing: true) or nothing (false)")
    return found


def _restore(module: nn.Module) -> None:
    module.__class__ = type(module).__bases__[0]


def enable_gradient_checkpointing(model: nn.Module, modules: Sequence[str] | None = None,
                                  granularity: str = "blocks") -> list[str]:
    """Recompute the activations of ``model``'s blocks in the backward pass; returns the paths of the
    recomputed modules: the blocks, or with ``granularity="attention"`` each block's attention module
    (``"auto"``: the same, in calls on rows of at least ``AUTO_MIN_TOKENS`` tokens).

    Calling it again is harmless; "blocks" after "attention" or "auto" recomputes whole blocks instead (not
    the attention twice), "attention" or "auto" after "blocks" keeps the blocks, and "attention" and "auto"
    replace each other. Other instances of the modules' classes are not changed.

    Example::

        enable_gradient_checkpointing(model)      # ["layers.0", "layers.1", ...]
        enable_gradient_checkpointing(model, granularity="attention")  # ["layers.0.self_attn", ...]
    """
    if granularity not in GRANULARITIES:
        raise ConfigError(f"gradient checkpointing recomputes one of {', '.join(GRANULARITIES)}, got {granularity!r}"
                          f"{did_you_mean(str(granularity), GRANULARITIES)}")
    blocks = find_blocks(model, modules)
    if granularity != "blocks":
        if any(is_checkpointed(block) for _, block in blocks):
            return [path for path, _ in blocks]  # whole blocks already: their attention is recomputed with them
        targets = _attention_of(blocks, granularity)
    else:
        for _, block in blocks:  # recomputing the block recomputes its attention: not twice
            for _, inner in block.named_modules():
                if inner is not block and is_checkpointed(inner):
                    _restore(inner)
        targets = blocks
    for path, module in targets:
        try:
            module.__class__ = _checkpointed_class(type(module), long_only=granularity == "auto")
        except TypeError as error:  # a class with __slots__ or a C++ module
            raise ConfigError(f"cannot checkpoint '{path}' ({type(module).__name__}): {error}") from None
    return [path for path, _ in targets]


def disable_gradient_checkpointing(model: nn.Module) -> list[str]:
    """Undo ``enable_gradient_checkpointing`` on every module of ``model``; returns their paths."""
    restored = []
    for path, module in model.named_modules():
        if is_checkpointed(module):
            _restore(module)
            restored.append(path)
    return restored
