"""Model transforms: named, reversible changes to how one model instance's modules compute, each checked
against the classes it was validated on, applied and undone as a stack, and reported.

A transform gives a module a subclass of its own class whose ``__call__`` is the transform's: only that
instance changes (the class itself, every other instance, parameter names and checkpoints stay as they
are). A module's transforms form a stack: those that replace the class's computation
(``block_attention``, ``lean_swiglu``) sit at the bottom, those that wrap whatever is below
(``recompute``, ``recompute_long_rows``) on top. Taking one off rebuilds the module's class from the ones
left, so each undo puts back exactly the class the module had (the classes made here are recorded, never
guessed from ``__bases__``).

- ``block_attention``: causal attention one block of queries at a time on the CPU (:func:`causal_blocks`),
  for the attention classes of ``ARCHITECTURES``;
- ``lean_swiglu``: a SwiGLU whose backward pass keeps only its two inputs (:func:`swiglu`), for the gated
  MLP classes of ``ARCHITECTURES``;
- ``recompute``: the module's activations recomputed in the backward pass (any module; what
  ``training.recompute.enable_gradient_checkpointing`` puts on blocks or attention modules);
- ``recompute_long_rows``: the same, in calls on rows of at least ``AUTO_MIN_TOKENS`` tokens only.

The two mlx-lm transforms apply to a module whose class is exactly one of the classes they were validated
on (``ARCHITECTURES``, tested on mlx-lm ``VALIDATED_MLX_LM``), with the attributes they use; anything else
(another class, a subclass, another mlx-lm release) is left as it is and the reason is reported
(:meth:`Applied.describe`; ``mlx-train finetune`` logs it at start-up).

Example::

    from mlx_train import transforms
    stack = transforms.TransformStack(model)
    stack.apply("block_attention")      # Applied: block_attention on 30 modules (llama.Attention)
    stack.apply("lean_swiglu")
    print("\\n".join(stack.describe()))
    stack.undo()                        # every module's class as before, in reverse order
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["ARCHITECTURES", "AUTO_MIN_TOKENS", "FAST_PATHS", "MAX_BLOCKS", "MIN_BLOCK", "TRANSFORMS",
           "VALIDATED_MLX_LM", "Applied", "Architecture", "Transform", "TransformStack", "apply", "apply_fast_paths",
           "block_size", "blocked_sdpa",
           "causal_blocks", "has_plain_head", "head_reason", "is_blocked", "is_lean", "remove", "swiglu",
           "transforms_of", "use_block_attention", "use_lean_swiglu"]

# ---------------------------------------------------------------------------------------------------------
# Causal attention in blocks of queries.
#
# MLX's CPU backend runs mx.fast.scaled_dot_product_attention as its unfused fallback: the whole
# queries x keys score matrix, the causal mask applied to it, a softmax over every row, whose exponentials
# cost more there than the matrix products (SmolLM2-135M at 2048 tokens: about half of a LoRA step), and
# half of the scores are masked out. In blocks, each block sees only the keys up to its own last position
# (MLX aligns a causal mask to the last key): (n + 1) / 2n of the scores for n blocks. Each row's softmax
# has the same terms (a masked score's exponential is exactly 0): values and gradients to float rounding.

MIN_BLOCK = 64  # tokens: smaller blocks save little and add operations
MAX_BLOCKS = 8  # blocks per call: the scores computed fall to 56% of the matrix; more add operations to trace
_SDPA = "scaled_dot_product_attention"


def block_size(length: int) -> int:
    """Queries per block for ``length`` tokens.

    Example: ``block_size(256)`` -> ``64``; ``block_size(2048)`` -> ``256``.
    """
    return max(MIN_BLOCK, -(-length // MAX_BLOCKS))


def causal_blocks(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal self-attention (``queries [B, Hq, L, D]``, ``keys``/``values [B, Hkv, L, D]``) one block of
    queries at a time, each over the keys up to its last position.

    Example: ``causal_blocks(q, k, v, scale=64 ** -0.5)`` equals ``mx.fast.scaled_dot_product_attention(q, k, v,
    scale=64 ** -0.5, mask="causal")`` to float rounding.
    """
    length = queries.shape[2]
    block = block_size(length)
    outputs = [mx.fast.scaled_dot_product_attention(queries[:, :, start:start + block],
                                                    keys[:, :, :start + block], values[:, :, :start + block],
                                                    scale=scale, mask="causal")
               for start in range(0, length, block)]
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


def blocked_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask, ...)``, in blocks
    (:func:`causal_blocks`) for a causal mask without a cache on the CPU, else ``original`` as it is (a GPU's
    fused kernel already skips masked blocks; an array mask, a cache or attention sinks go through as before).

    Example: ``sdpa = blocked_sdpa(mlx_lm.models.base.scaled_dot_product_attention)``.
    """
    def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any = None,
                                     scale: float = 1.0, mask: Any = None, **options: Any) -> mx.array:
        length = queries.shape[2]
        if (cache is None and isinstance(mask, str) and mask == "causal" and options.get("sinks") is None
                and keys.shape[2] == length and length > MIN_BLOCK and mx.default_device().type == mx.cpu):
            return causal_blocks(queries, keys, values, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **options)

    return scaled_dot_product_attention


def _blocked_call(cls: type) -> Callable[..., Any]:
    """``cls.__call__``'s own code, run over a copy of its module's names in which mlx-lm's attention function
    is :func:`blocked_sdpa`'s (the module itself is not changed)."""
    call = cls.__call__
    names = dict(call.__globals__)
    names[_SDPA] = blocked_sdpa(names[_SDPA])
    blocked = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__, call.__closure__)
    blocked.__kwdefaults__ = call.__kwdefaults__
    blocked.__qualname__, blocked.__doc__ = call.__qualname__, call.__doc__
    return blocked


# ---------------------------------------------------------------------------------------------------------
# A SwiGLU whose backward pass keeps only its two inputs. Differentiated as written, silu(gate) * up keeps
# sigmoid(gate) and silu(gate) beside gate and up: two more tokens x intermediate arrays per trained block
# (SmolLM2-135M: 50 MB at 4 x 256 tokens over 8 trained blocks). Its own gradient forms the sigmoid again
# from gate (elementwise: no matrix product is recomputed).

@partial(mx.compile, shapeless=True)
def _swiglu_forward(gate: mx.array, up: mx.array) -> mx.array:
    out: mx.array = nn.silu(gate) * up  # one fused kernel, as mlx-lm's swiglu
    return out


@mx.custom_function
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``, whose backward pass needs only ``gate`` and ``up``.

    Example: ``swiglu(mx.array([1.0]), mx.array([2.0]))`` -> ``[1.4621]``.
    """
    out: mx.array = _swiglu_forward(gate, up)
    return out


@swiglu.vjp
def _swiglu_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array, mx.array]:
    gate, up = primals
    sigmoid = mx.sigmoid(gate)
    # d silu(g)/dg = s + g s (1 - s) = s (1 + g (1 - s))
    return cotangent * up * sigmoid * (1 + gate * (1 - sigmoid)), cotangent * gate * sigmoid


def _lean_call(self: Any, x: mx.array) -> mx.array:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------
# Recomputation: the module keeps only its inputs for the backward pass and runs its forward again there.

#: ``recompute_long_rows``: the shortest rows (tokens, the second-to-last axis of the module's input) that
#: are recomputed. At 1024 tokens a SmolLM2 block's attention probabilities (9 heads) match the rest of its
#: activations; at 256 they are a quarter of them.
AUTO_MIN_TOKENS = 1024


def _rows_are_long(args: tuple[Any, ...]) -> bool:
    """Whether a call's input (its first argument, ``[..., tokens, features]``) has ``AUTO_MIN_TOKENS`` tokens or
    more; an input of another kind counts as long."""
    x = args[0] if args else None
    if not isinstance(x, mx.array) or x.ndim < 2:
        return True
    return x.shape[-2] >= AUTO_MIN_TOKENS


def _recomputed_call(cls: type, long_only: bool) -> Callable[..., Any]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if long_only and not _rows_are_long(args):
            return cls.__call__(self, *args, **kwargs)

        def forward(params: Any, *inner_args: Any, **inner_kwargs: Any) -> Any:
            self.update(params)
            return cls.__call__(self, *inner_args, **inner_kwargs)  # looked up now: the class's current call

        return mx.checkpoint(forward)(self.trainable_parameters(), *args, **kwargs)

    return __call__


# ---------------------------------------------------------------------------------------------------------
# What the mlx-lm transforms were validated on.

#: The mlx-lm releases (first and last minor series, inclusive) on which the entries of ``ARCHITECTURES`` were
#: tested (tests/test_transforms.py on 0.29.1, 0.30.7, 0.31.3 and 0.32.2; an entry's ``since`` can start later).
#: Outside them nothing is switched, and the report says so.
VALIDATED_MLX_LM = ((0, 29), (0, 32))


@dataclass(frozen=True)
class Architecture:
    """Classes of one ``mlx_lm.models.<name>`` module: ``attention`` calls mlx-lm's
    ``scaled_dot_product_attention``; ``mlp`` is the plain gated MLP ``down_proj(swiglu(gate_proj(x),
    up_proj(x)))``; ``head``: ``Model``'s logits are ``lm_head`` (or the tied embedding's ``as_linear``) of
    ``self.model(...)``, so the loss may project them in chunks. None / False: not validated. ``since``: the
    first mlx-lm release (major, minor) it was validated on, where later than ``VALIDATED_MLX_LM``'s."""

    attention: str | None
    mlp: str | None = None
    head: bool = False
    since: tuple[int, int] = VALIDATED_MLX_LM[0]


#: mlx-lm model modules whose classes the transforms were validated on (mlx-lm loads ``mistral`` models as
#: ``llama``; ``smollm3`` builds its blocks from ``llama``'s classes).
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("Attention", "MLP", head=True),
    "smollm3": Architecture(None, head=True),
    "qwen2": Architecture("Attention", "MLP", head=True),
    "qwen2_moe": Architecture("Attention", "MLP", head=True),
    "qwen3": Architecture("Attention", "MLP", head=True),
    # before 0.32 its experts' gradient fails on this MLX (gather_axis VJP), with or without transforms
    "qwen3_moe": Architecture("Attention", head=True, since=(0, 32)),
    "gemma": Architecture("Attention"),
    "gemma3_text": Architecture("Attention"),
    "phi3": Architecture("Attention", head=True),
    "phimoe": Architecture("Attention", head=True),
    "starcoder2": Architecture("Attention", head=True),
    "olmo2": Architecture("Attention", "MLP", head=True),
    "granite": Architecture("Attention", "MLP"),
    "cohere": Architecture("Attention", "MLP"),
    "internlm3": Architecture("Attention", "MLP", head=True),
    "glm4": Architecture("Glm4Attention", head=True),
    "helium": Architecture("HeliumAttention", "HeliumMLP", head=True),
    "ernie4_5": Architecture("Attention", "MLP", head=True),
    "mimo": Architecture("Attention", "MLP", head=True),
    "seed_oss": Architecture("Attention", "MLP"),
    "hunyuan_v1_dense": Architecture("Attention", "MLP"),
    "nemotron": Architecture("Attention", head=True),
    "mixtral": Architecture("MixtralAttention"),
    "deepseek": Architecture("DeepseekAttention", "DeepseekMLP", head=True),
    "ministral3": Architecture("Attention", "MLP", head=True),
    "olmo3": Architecture("Olmo3Attention", "Olmo3MLP", head=True),
    "exaone4": Architecture("Attention", "MLP", head=True),
    "stablelm": Architecture("Attention", "MLP"),
    "minicpm": Architecture("Attention", "MLP"),
}


def _mlx_lm_version() -> tuple[int, ...] | None:
    """The installed mlx-lm's version as numbers (None when it cannot be read)."""
    module = sys.modules.get("mlx_lm")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as installed

            version = installed("mlx-lm")
        except Exception:  # noqa: BLE001 - not installed, or no metadata: treated as unknown
            return None
    numbers = []
    for part in str(version).split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def _version_reason(architecture: str) -> str | None:
    """Why the installed mlx-lm is outside the releases ``architecture``'s classes were validated on (None when
    it is inside)."""
    version = _mlx_lm_version()
    low, high = max(VALIDATED_MLX_LM[0], ARCHITECTURES[architecture].since), VALIDATED_MLX_LM[1]
    if version is not None and low <= version[:2] <= high:
        return None
    span = f"{low[0]}.{low[1]}-{high[0]}.{high[1]}"
    if version is None:
        return f"the installed mlx-lm's version cannot be read (validated on mlx-lm {span})"
    shown = ".".join(map(str, version))
    return (f"mlx-lm {shown} is outside the releases this was validated on for {architecture} ({span}); the model "
            "computes as mlx-lm writes it. Install a validated mlx-lm to have it")


def _declared(role: str) -> dict[type, str]:
    """The validated classes of ``role`` ("attention", "mlp") among mlx-lm's loaded model modules, each with
    its architecture (a module that is not loaded has no instance to transform)."""
    found = {}
    for name, architecture in ARCHITECTURES.items():
        module, class_name = sys.modules.get(f"mlx_lm.models.{name}"), getattr(architecture, role)
        cls = getattr(module, class_name, None) if class_name else None
        if isinstance(cls, type):
            found[cls] = name
    return found


def has_plain_head(model: nn.Module) -> bool:
    """True when ``model`` is an mlx-lm ``Model`` whose logits are its head of ``model.model(...)``
    (``ARCHITECTURES[...].head``), on a validated mlx-lm: the loss may project them in chunks.

    Example: ``has_plain_head(mlx_lm.models.llama.Model(args))`` -> ``True``.
    """
    return head_reason(model) is None


def logits_head(model: nn.Module) -> nn.Module | None:
    """The module that gives the logits of an mlx-lm model with a plain head (:func:`has_plain_head`) from
    ``model.model(...)``: its ``lm_head``, or the tied token embedding; None for other models.

    Example: ``logits_head(model) is model.lm_head``
    """
    if not type(model).__module__.startswith("mlx_lm.models.") or not isinstance(model.get("model"), nn.Module):
        return None
    if not has_plain_head(model):
        return None
    if "lm_head" in model and not getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        head: nn.Module = model["lm_head"]
        return head
    embedding = model["model"].get("embed_tokens")
    return embedding if isinstance(embedding, nn.Module) else None


def head_reason(model: nn.Module) -> str | None:
    """Why the loss cannot project ``model``'s logits in chunks (None when it can: :func:`has_plain_head`)."""
    cls = type(model)
    name = cls.__module__.removeprefix("mlx_lm.models.")
    architecture = ARCHITECTURES.get(name)
    if cls.__module__ == name or architecture is None or not architecture.head or cls.__name__ != "Model" \
            or getattr(sys.modules.get(cls.__module__), "Model", None) is not cls:
        return (f"{cls.__module__}.{cls.__qualname__} is not among the mlx-lm models whose logits are known to "
                "be their head of model.model(...): the loss computes the full logits")
    return _version_reason(name)


# ---------------------------------------------------------------------------------------------------------
# Transforms, and the stack of them on each module.

Check = Callable[[nn.Module, type], "str | None"]


@dataclass(frozen=True, eq=False)
class Transform:
    """A named change of a module's ``__call__``.

    ``make_call(cls)`` is the ``__call__`` of the subclass made from ``cls`` (the class below it in the
    module's stack); ``check(module, base)`` says why a module (``base``: its class without any transform)
    is not one to change, or None; ``find(model)`` lists the modules the transform is for when none are
    named; ``wraps``: it wraps whatever is below (goes above the transforms that replace the computation).
    ``validated``: where it was validated, for the report.
    """

    name: str
    summary: str
    make_call: Callable[[type], Callable[..., Any]]
    check: Check = field(default=lambda module, base: None)
    find: Callable[[nn.Module], list[tuple[str, nn.Module]]] | None = None
    wraps: bool = False
    validated: str = "any module"


def _modules_of(role: str) -> Callable[[nn.Module], list[tuple[str, nn.Module]]]:
    def find(model: nn.Module) -> list[tuple[str, nn.Module]]:
        declared = tuple(_declared(role))
        return [(str(path), module) for path, module in model.named_modules()
                if isinstance(module, nn.Module) and isinstance(module, declared)]

    return find


def _check_declared(role: str, needs: Callable[[nn.Module, type], str | None]) -> Check:
    def check(module: nn.Module, base: type) -> str | None:
        declared = _declared(role)
        if base not in declared:
            parent = next((_short(cls) for cls in declared if issubclass(base, cls)), None)
            return (f"{base.__module__}.{base.__qualname__} is a subclass of {parent}, which may compute otherwise"
                    if parent else f"{base.__module__}.{base.__qualname__} is not among the classes it was "
                    "validated on")
        return _version_reason(declared[base]) or needs(module, base)

    return check


def _needs_sdpa(module: nn.Module, base: type) -> str | None:
    call = base.__call__
    mlx_lm_base = sys.modules.get("mlx_lm.models.base")
    if not isinstance(call, types.FunctionType) or call.__globals__.get(_SDPA) is not getattr(mlx_lm_base, _SDPA, 0):
        return f"{base.__module__} does not bind {_SDPA} to mlx_lm.models.base's"
    return None


def _needs_projections(module: nn.Module, base: type) -> str | None:
    missing = [name for name in ("gate_proj", "up_proj", "down_proj") if not isinstance(module.get(name), nn.Module)]
    return f"it has no module {', '.join(missing)}" if missing else None


def _validated_on(role: str) -> str:
    (low_major, low_minor), (high_major, high_minor) = VALIDATED_MLX_LM
    return f"mlx-lm {low_major}.{low_minor}-{high_major}.{high_minor}, ARCHITECTURES' {role} classes"


BLOCK_ATTENTION = Transform(
    "block_attention", "causal attention in blocks of queries on the CPU", _blocked_call,
    _check_declared("attention", _needs_sdpa), _modules_of("attention"), validated=_validated_on("attention"))
LEAN_SWIGLU = Transform(
    "lean_swiglu", "a SwiGLU whose backward pass keeps only its inputs", lambda cls: _lean_call,
    _check_declared("mlp", _needs_projections), _modules_of("mlp"), validated=_validated_on("mlp"))
RECOMPUTE = Transform("recompute", "activations recomputed in the backward pass",
                      partial(_recomputed_call, long_only=False), wraps=True)
RECOMPUTE_LONG_ROWS = Transform("recompute_long_rows", f"activations recomputed in the backward pass on rows of "
                                f">= {AUTO_MIN_TOKENS} tokens", partial(_recomputed_call, long_only=True), wraps=True)
#: Every transform, by name.
TRANSFORMS: dict[str, Transform] = {t.name: t for t in (BLOCK_ATTENTION, LEAN_SWIGLU, RECOMPUTE, RECOMPUTE_LONG_ROWS)}

_BELOW: dict[type, tuple[type, Transform]] = {}  # a class made here -> (the class it was made from, its transform)
_MADE: dict[tuple[type, str], type] = {}  # (class, transform name) -> the subclass made from it


def _stack_of(module: nn.Module) -> tuple[type, list[Transform]]:
    """``(the module's class without transforms, its transforms from the bottom up)``."""
    cls, stack = type(module), []
    while cls in _BELOW:
        cls, transform = _BELOW[cls]
        stack.append(transform)
    return cls, stack[::-1]


def _subclass(cls: type, transform: Transform) -> type:
    if (cls, transform.name) not in _MADE:
        namespace = {"__call__": transform.make_call(cls), "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        made = type(cls.__name__, (cls,), namespace)
        _MADE[cls, transform.name], _BELOW[made] = made, (cls, transform)
    return _MADE[cls, transform.name]


def _rebuild(module: nn.Module, base: type, stack: Sequence[Transform]) -> None:
    cls = base
    for transform in sorted(stack, key=lambda t: t.wraps):  # stable: replacing ones first, each group in order
        cls = _subclass(cls, transform)
    module.__class__ = cls


def transforms_of(module: nn.Module) -> list[str]:
    """Names of the transforms on ``module``, from the bottom up.

    Example: ``transforms_of(model.model.layers[0].self_attn)`` -> ``["block_attention", "recompute_long_rows"]``.
    """
    return [t.name for t in _stack_of(module)[1]]


def _resolve(transform: Transform | str) -> Transform:
    if isinstance(transform, Transform):
        return transform
    if transform not in TRANSFORMS:
        from mlx_train.errors import ConfigError, did_you_mean

        raise ConfigError(f"unknown model transform {transform!r}{did_you_mean(transform, TRANSFORMS)}; known: "
                          f"{', '.join(TRANSFORMS)}")
    return TRANSFORMS[transform]


@dataclass
class Applied:
    """What one :func:`apply` (or :func:`remove`) did: the modules it changed (``paths``), those it left
    alone and why (``skipped``: ``(path, reason)``). ``undo()`` puts the changed modules back as they were."""

    transform: Transform
    model: nn.Module
    paths: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    removed: bool = False
    _changed: list[tuple[nn.Module, int]] = field(default_factory=list, repr=False)  # module, its place in the stack

    def undo(self) -> None:
        """Take this transform off the modules it was put on (put it back where it was taken off)."""
        for module, place in reversed(self._changed):
            base, stack = _stack_of(module)
            if self.removed:
                stack.insert(place, self.transform)
            elif self.transform in stack:
                stack.remove(self.transform)
            _rebuild(module, base, stack)
        self._changed.clear()

    def describe(self) -> str:
        """One line: what was changed, or why nothing was.

        Example: ``"block_attention (causal attention in blocks of queries on the CPU): 30 modules
        (llama.Attention)"``.
        """
        head = f"{self.transform.name} ({self.transform.summary})"
        if self.removed:
            return f"{head}: taken off {len(self.paths)} modules"
        reasons = sorted({reason for _, reason in self.skipped})
        if self.paths:
            classes = sorted({_short(type(m)) for _, m in _named(self.model, self.paths)})
            line = f"{head}: {len(self.paths)} modules ({', '.join(classes)})"
            return line + (f"; left alone: {len(self.skipped)} ({'; '.join(reasons)})" if self.skipped else "")
        if self.skipped:
            return f"{head}: not applied: {'; '.join(reasons)}"
        return (f"{head}: not applied: {_short(type(self.model))} has no module of the classes it was validated on "
                f"({self.transform.validated})")


def _short(cls: type) -> str:
    base = cls
    while base in _BELOW:
        base = _BELOW[base][0]
    return f"{base.__module__.removeprefix('mlx_lm.models.')}.{base.__qualname__}"


def _named(model: nn.Module, paths: Iterable[str]) -> list[tuple[str, nn.Module]]:
    wanted = set(paths)
    return [(p, m) for p, m in model.named_modules() if p in wanted]


def _model_order(paths: list[str]) -> list[str]:
    return sorted(paths, key=lambda p: [(0, int(part), "") if part.isdigit() else (1, 0, part)
                                        for part in p.split(".")])


def apply(model: nn.Module, transform: Transform | str,
          modules: Sequence[tuple[str, nn.Module]] | None = None) -> Applied:
    """Put ``transform`` on ``modules`` (``(path, module)`` pairs; default: the ones it is for in ``model``)
    that pass its check; a module that has it already is left as it is. Returns the undo handle.

    Example: ``apply(model, "lean_swiglu").paths`` -> ``["model.layers.0.mlp", ...]``.
    """
    transform = _resolve(transform)
    targets = list(modules) if modules is not None else (transform.find(model) if transform.find else [])
    done = Applied(transform, model)
    for path, module in targets:
        base, stack = _stack_of(module)
        if transform in stack:
            continue
        reason = transform.check(module, base)
        if reason is None:
            try:
                _rebuild(module, base, [*stack, transform])
            except TypeError as error:  # a class with __slots__, or one made in C++
                reason = f"its class cannot be switched ({error})"
        if reason is not None:
            done.skipped.append((path, reason))
            continue
        done.paths.append(path)
        done._changed.append((module, len(stack)))
    done.paths = _model_order(done.paths)
    return done


def remove(model: nn.Module, transform: Transform | str,
           modules: Sequence[tuple[str, nn.Module]] | None = None) -> Applied:
    """Take ``transform`` off ``modules`` (default: every module of ``model``), wherever it sits in each
    module's stack; the transforms above it stay. Returns the handle whose ``undo()`` puts it back.

    Example: ``remove(model, "recompute").paths`` -> ``["model.layers.0", ...]``.
    """
    transform = _resolve(transform)
    done = Applied(transform, model, removed=True)
    for path, module in (list(modules) if modules is not None else model.named_modules()):
        base, stack = _stack_of(module)
        if transform in stack:
            done._changed.append((module, stack.index(transform)))
            stack.remove(transform)
            _rebuild(module, base, stack)
            done.paths.append(path)
    done.paths = _model_order(done.paths)
    return done


class TransformStack:
    """The transforms applied to one model, undone in reverse order.

    Example::

        stack = TransformStack(model)
        stack.apply("block_attention"); stack.apply("lean_swiglu")
        log("\\n".join(stack.describe()))
        stack.undo()
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.applied: list[Applied] = []

    def apply(self, transform: Transform | str, modules: Sequence[tuple[str, nn.Module]] | None = None) -> Applied:
        """:func:`apply` ``transform``, kept for :meth:`undo`."""
        done = apply(self.model, transform, modules)
        self.applied.append(done)
        return done

    def remove(self, transform: Transform | str, modules: Sequence[tuple[str, nn.Module]] | None = None) -> Applied:
        """:func:`remove` ``transform``, kept for :meth:`undo` (which puts it back)."""
        done = remove(self.model, transform, modules)
        self.applied.append(done)
        return done

    def undo(self) -> None:
        """Undo everything applied or removed through this stack, the last first."""
        while self.applied:
            self.applied.pop().undo()

    def describe(self) -> list[str]:
        """One line per transform applied through this stack (see :meth:`Applied.describe`)."""
        return [done.describe() for done in self.applied]


def use_block_attention(model: nn.Module) -> list[str]:
    """Apply ``block_attention`` to ``model``; returns the paths switched now (none the second time). Recomputing
    a module later (``enable_gradient_checkpointing``) recomputes the blocked call.

    Example: ``use_block_attention(model)`` -> ``["model.layers.0.self_attn", ...]`` for an mlx-lm llama.
    """
    return apply(model, BLOCK_ATTENTION).paths


def use_lean_swiglu(model: nn.Module) -> list[str]:
    """Apply ``lean_swiglu`` to ``model``; returns the paths switched now (none for a model without a validated
    gated MLP, e.g. one that is not an mlx-lm model).

    Example: ``use_lean_swiglu(model)`` -> ``["model.layers.0.mlp", ...]`` for an mlx-lm llama.
    """
    return apply(model, LEAN_SWIGLU).paths


def is_blocked(module: nn.Module) -> bool:
    """True when ``module`` computes its attention in blocks (``block_attention``)."""
    return BLOCK_ATTENTION in _stack_of(module)[1]


def is_lean(module: nn.Module) -> bool:
    """True when ``module`` is an MLP switched to the lean :func:`swiglu` (``lean_swiglu``)."""
    return LEAN_SWIGLU in _stack_of(module)[1]


#: What ``mlx-train finetune`` applies to every model it trains (:func:`apply_fast_paths`).
FAST_PATHS = ("block_attention", "lean_swiglu")


def apply_fast_paths(model: nn.Module, log: Callable[[str], Any] = print) -> TransformStack:
    """Apply ``FAST_PATHS`` to ``model`` where they were validated and log, one line each, what was applied and
    what was not and why, and whether the loss can project the logits in chunks. Returns the stack (``undo()``
    puts the model back).

    Example: ``apply_fast_paths(model)`` logs ``model transform block_attention (...): 30 modules
    (llama.Attention)``, ...
    """
    stack = TransformStack(model)
    for name in FAST_PATHS:
        log(f"model transform {stack.apply(name).describe()}")
    reason = head_reason(model)
    log(f"loss: the output projection in chunks ({_short(type(model))})" if reason is None else f"loss: {reason}")
    return stack
