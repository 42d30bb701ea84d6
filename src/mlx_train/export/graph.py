"""Trace an MLX function into a list of primitive records with ``mx.export_function``.

MLX calls the export callback with the function's inputs, outputs, constants
(the weights) and then every primitive in order, with its inputs, outputs and
arguments. :func:`trace` collects those into a :class:`Trace`. Tracing twice at
batch sizes ``B`` and ``B + 1`` (:func:`trace_pair`) tells which shape numbers
depend on the batch: they differ between the traces, and since they are
linear in the batch size two points fix them (``dim = a * B + c``).

Example::

    trace = trace(lambda x: model(x), mx.zeros((2, 64)))
    [op.name for op in trace.primitives]      # ["Reshape", "Transpose", "Broadcast", "AddMM", ...]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_train.errors import MLXTrainError


class ExportError(MLXTrainError):
    """A model cannot be exported as asked (an unsupported operation, a bad input, a failed check)."""

    exit_code = 8


Value = tuple[str, tuple[int, ...], mx.Dtype]  # (name, shape, dtype) as the export callback gives it


@dataclass
class Primitive:
    """One operation of the traced graph."""

    name: str
    inputs: list[Value]
    outputs: list[Value]
    arguments: list[Any]


@dataclass
class Trace:
    """What ``mx.export_function`` reported for one call of the function."""

    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    constants: dict[str, mx.array] = field(default_factory=dict)
    primitives: list[Primitive] = field(default_factory=list)


def _strip_state(arguments: list[Any]) -> list[Any]:
    # Fused primitives report their fallback function as a leading placeholder (None in Python).
    return arguments[1:] if arguments and arguments[0] is None else list(arguments)


def trace(fn: Callable[..., Any], *inputs: mx.array) -> Trace:
    """Trace ``fn(*inputs)`` on the CPU stream and return its inputs, constants and primitives.

    Example::

        t = trace(model, mx.zeros((2, 8, 8, 1)))
        t.primitives[0].name       # "Convolution"
    """
    result = Trace()

    def callback(record: dict[str, Any]) -> None:
        kind = record["type"]
        if kind == "inputs":
            result.inputs = list(record["inputs"])
        elif kind == "keyword_inputs" and record["keywords"]:
            raise ExportError("export traces positional inputs only; pass the example inputs positionally")
        elif kind == "outputs":
            result.outputs = list(record["outputs"])
        elif kind == "constants":
            result.constants = dict(record["constants"])
        elif kind == "primitive":
            result.primitives.append(Primitive(
                record["name"], list(record["inputs"]), list(record["outputs"]),
                _strip_state(list(record["arguments"])),
            ))

    # The CPU stream gives the decomposed forms of fused ops; the translator also knows the fused ones.
    with mx.stream(mx.cpu):
        mx.export_function(callback, fn, *inputs)
    return result


def with_batch(inputs: Sequence[mx.array], batch: int) -> list[mx.array]:
    """The example inputs repeated (or cut) along axis 0 to ``batch`` rows."""
    resized = []
    for x in inputs:
        reps = -(-batch // x.shape[0])
        resized.append(mx.concatenate([x] * reps, axis=0)[:batch] if reps > 1 else x[:batch])
    return resized


def trace_pair(fn: Callable[..., Any], inputs: Sequence[mx.array],
               check: Callable[[Trace], None] | None = None) -> tuple[Trace, Trace, int]:
    """Trace at batch sizes ``B`` and ``B + 1`` (``B >= 2``) and check both traces have the same ops.

    At batch 1 MLX may skip a broadcast it needs at larger batches, so ``B`` is at least 2.
    ``check`` sees the first trace before the second is taken (its error is the more useful one).
    """
    for i, x in enumerate(inputs):
        if x.ndim == 0 or x.shape[0] == 0:
            raise ExportError(f"example input {i} has shape {tuple(x.shape)}: with dynamic_batch=True every "
                              "input needs a leading batch axis of size >= 1 (or pass dynamic_batch=False)")
    sizes = {x.shape[0] for x in inputs}
    if len(sizes) > 1:
        raise ExportError(f"the example inputs have different batch sizes {sorted(sizes)} along axis 0: with "
                          "dynamic_batch=True all inputs share axis 0 as the batch (or pass dynamic_batch=False)")
    batch = max(2, sizes.pop())
    first = trace(fn, *with_batch(inputs, batch))
    if check is not None:
        check(first)
    second = trace(fn, *with_batch(inputs, batch + 1))
    ops1 = [p.name for p in first.primitives]
    ops2 = [p.name for p in second.primitives]
    if ops1 != ops2 or set(first.constants) != set(second.constants):
        at = next((i for i, (a, b) in enumerate(zip(ops1, ops2, strict=False)) if a != b), min(len(ops1), len(ops2)))
        raise ExportError(
            f"the traced graph changes with the batch size (operation {at}: "
            f"{ops1[at] if at < len(ops1) else 'end'} at batch {batch}, "
            f"{ops2[at] if at < len(ops2) else 'end'} at batch {batch + 1}), so it cannot have a dynamic "
            "batch axis; export with dynamic_batch=False"
        )
    for name, value in first.constants.items():
        other = second.constants[name]
        if value.shape != other.shape or not mx.array_equal(value, other):
            raise ExportError(
                f"a constant of shape {tuple(value.shape)} changes with the batch size (a number computed from "
                "x.shape[0], for example), so the model cannot have a dynamic batch axis; compute it with MLX "
                "ops, or export with dynamic_batch=False"
            )
    return first, second, batch
