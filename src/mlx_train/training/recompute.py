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

Only the given instance changes: the recomputation is the model transform ``recompute`` (``auto``:
``recompute_long_rows``) of ``mlx_train.transforms``, which gives each chosen module a subclass of its own
class whose ``__call__`` is checkpointed; the class itself, and every other instance of it in the process,
stay as they were (unlike patching ``type(block).__call__``), and taking it off restores the exact class.
Parameter names and the module tree are unchanged, so checkpoints and optimizer state are not affected.

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

import mlx.nn as nn

from mlx_train import transforms
from mlx_train.errors import ConfigError, did_you_mean
from mlx_train.transforms import AUTO_MIN_TOKENS

__all__ = ["GRANULARITIES", "ATTENTION_NAMES", "AUTO_MIN_TOKENS", "checkpoint", "enable_gradient_checkpointing",
           "disable_gradient_checkpointing", "find_attention", "find_blocks", "is_checkpointed"]

DEFAULT_BLOCKS = ("layers", "model.layers")  # model.layers, or an mlx-lm model's model.model.layers
#: What is recomputed: each block whole, each block's attention module, or that on long rows only.
GRANULARITIES = ("blocks", "attention", "auto")
#: The names a block's attention module goes by (mlx-lm models: self_attn), tried in this order.
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")
_RECOMPUTE = (transforms.RECOMPUTE, transforms.RECOMPUTE_LONG_ROWS)


def is_checkpointed(module: nn.Module) -> bool:
    """True when ``module`` recomputes its activations in the backward pass (with ``granularity="auto"``: on
    long rows)."""
    return any(name in ("recompute", "recompute_long_rows") for name in transforms.transforms_of(module))


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


def checkpoint(model: nn.Module, modules: Sequence[str] | None = None,
               granularity: str = "blocks") -> transforms.TransformStack:
    """Recompute ``model``'s blocks (or their attention modules) in the backward pass, as
    :func:`enable_gradient_checkpointing` says; returns the stack of what it changed, whose ``undo()`` puts
    every module back as it was.

    Example: ``stack = checkpoint(model, granularity="attention"); ...; stack.undo()``.
    """
    if granularity not in GRANULARITIES:
        raise ConfigError(f"gradient checkpointing recomputes one of {', '.join(GRANULARITIES)}, got {granularity!r}"
                          f"{did_you_mean(str(granularity), GRANULARITIES)}")
    stack = transforms.TransformStack(model)
    blocks = find_blocks(model, modules)
    if granularity == "blocks":
        for _, block in blocks:  # recomputing the block recomputes its attention: not twice
            inner = [(path, m) for path, m in block.named_modules() if m is not block]
            for transform in _RECOMPUTE:
                stack.remove(transform, inner)
        targets, transform = blocks, transforms.RECOMPUTE
    elif any(is_checkpointed(block) for _, block in blocks):
        return stack  # whole blocks already: their attention is recomputed with them
    else:
        targets = _attention_of(blocks, granularity)
        transform, other = _RECOMPUTE if granularity == "attention" else _RECOMPUTE[::-1]
        stack.remove(other, targets)  # "attention" and "auto" replace each other
    done = stack.apply(transform, targets)
    if done.skipped:
        path, reason = done.skipped[0]
        stack.undo()
        raise ConfigError(f"cannot checkpoint '{path}': {reason}") from None
    done.paths = [path for path, _ in targets]
    return stack


def enable_gradient_checkpointing(model: nn.Module, modules: Sequence[str] | None = None,
                                  granularity: str = "blocks") -> list[str]:
    """Recompute the activations of ``model``'s blocks in the backward pass; returns the paths of the
    recomputed modules: the blocks, or with ``granularity="attention"`` each block's attention module
    (``"auto"``: the same, in calls on rows of at least ``AUTO_MIN_TOKENS`` tokens).

    Calling it again is harmless; "blocks" after "attention" or "auto" recomputes whole blocks instead (not
    the attention twice), "attention" or "auto" after "blocks" keeps the blocks, and "attention" and "auto"
    replace each other. Other instances of the modules' classes are not changed. These are the model
    transforms ``recompute`` and ``recompute_long_rows`` (``mlx_train.transforms``).

    Example::

        enable_gradient_checkpointing(model)      # ["layers.0", "layers.1", ...]
        enable_gradient_checkpointing(model, granularity="attention")  # ["layers.0.self_attn", ...]
    """
    stack = checkpoint(model, modules, granularity)
    if not stack.applied:
        return [path for path, _ in find_blocks(model, modules)]
    return stack.applied[-1].paths


def disable_gradient_checkpointing(model: nn.Module) -> list[str]:
    """Undo ``enable_gradient_checkpointing`` on every module of ``model``; returns their paths."""
    restored = []
    for path, module in model.named_modules():
        if is_checkpointed(module):
            for transform in _RECOMPUTE:
                transforms.remove(model, transform, [(path, module)])
            restored.append(path)
    return restored
