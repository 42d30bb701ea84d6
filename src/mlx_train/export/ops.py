"""The pieces every ONNX handler uses: the graph ``Builder``, the ``Op`` a handler receives, the
``HANDLERS`` table and the ``handles`` decorator that fills it, and the dtype maps.

Example::

    from mlx_train.export.ops import Op, handles

    @handles("Negative")
    def _negative(op: Op) -> None:
        op.out(op.b.node("Neg", [op.arg(0)]))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, overload

import mlx.core as mx
import numpy as np

from mlx_train.export.graph import ExportError, Primitive, Trace, Value

if TYPE_CHECKING:
    from onnx import NodeProto, TensorProto

OPSET = 18

_NUMPY_TYPES = {
    mx.float32: np.float32, mx.float16: np.float16, mx.float64: np.float64, mx.bool_: np.bool_,
    mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64,
    mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64,
}


def _onnx() -> ModuleType:
    try:
        import onnx
    except ImportError:
        raise ExportError("ONNX export needs the onnx package: pip install 'mlx-train[export]'") from None
    return onnx


def numpy_dtype(dtype: mx.Dtype) -> type:
    """The numpy type of an MLX dtype, or ExportError (bfloat16 has none)."""
    if dtype not in _NUMPY_TYPES:
        raise ExportError(f"ONNX export does not handle {dtype} tensors: cast the model to float32 first "
                          "(model.set_dtype(mx.float32))")
    return _NUMPY_TYPES[dtype]


def onnx_dtype(dtype: mx.Dtype) -> int:
    return int(_onnx().helper.np_dtype_to_tensor_dtype(np.dtype(numpy_dtype(dtype))))


class Builder:
    """Collects ONNX nodes and initializers; maps MLX value names to ONNX names."""

    def __init__(self, first: Trace, second: Trace | None, batch: int) -> None:
        self.first, self.second, self.batch = first, second, batch
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.names: dict[str, str] = {}
        self._count = 0
        self._batch_tensor: str | None = None

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: np.ndarray | float | Sequence[float], dtype: Any = None, hint: str = "const") -> str:
        """An initializer holding ``value``; returns its name."""
        array = np.asarray(value, dtype=dtype)
        name = self.fresh(hint)
        self.initializers.append(_onnx().numpy_helper.from_array(array, name))
        return name

    @overload
    def node(self, op: str, inputs: Sequence[str], outputs: Literal[1] = 1, **attrs: Any) -> str: ...
    @overload
    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | int, **attrs: Any) -> str | list[str]: ...

    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | int = 1, **attrs: Any) -> str | list[str]:
        """Add an ONNX node; returns its output name (or the list when there are several)."""
        names = [self.fresh(op.lower()) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        self.nodes.append(_onnx().helper.make_node(op, list(inputs), names, **attrs))
        return names[0] if len(names) == 1 else names

    def name(self, value: Value) -> str:
        return self.names[value[0]]

    def batch_size(self) -> str:
        """A 1-element int64 tensor holding the batch size of the model's first input at run time."""
        if self._batch_tensor is None:
            shape = self.node("Shape", [self.names[self.first.inputs[0][0]]], start=0, end=1)
            self._batch_tensor = shape
        return self._batch_tensor

    def ints(self, first: Sequence[int], second: Sequence[int] | None) -> str:
        """An int64 vector of shape numbers; entries that differ between the traces follow the batch size."""
        first = [int(v) for v in first]
        if second is None or list(second) == first:
            return self.const(first, np.int64, "shape")
        # the two traces' batch sizes differ by 1
        slope = np.array([int(b) - int(a) for a, b in zip(first, second, strict=False)], np.int64)
        offset = np.array(first, np.int64) - slope * self.batch
        scaled = self.node("Mul", [self.batch_size(), self.const(slope, hint="slope")])
        return self.node("Add", [scaled, self.const(offset, hint="offset")])


class Op:
    """One primitive as seen by a handler: ONNX input names, shapes in both traces, arguments."""

    def __init__(self, builder: Builder, first: Primitive, second: Primitive | None) -> None:
        self.b = builder
        self.prim = first
        self.x = [builder.name(v) for v in first.inputs]
        self.out = [f"v_{v[0]}" for v in first.outputs]
        self.args = first.arguments
        self.args2 = second.arguments if second else None
        self.in_shapes = [tuple(v[1]) for v in first.inputs]
        self.in_shapes2 = [tuple(v[1]) for v in second.inputs] if second else None
        self.out_shapes = [tuple(v[1]) for v in first.outputs]
        self.out_shapes2 = [tuple(v[1]) for v in second.outputs] if second else None

    def out_shape(self, i: int = 0) -> str:
        return self.b.ints(self.out_shapes[i], self.out_shapes2[i] if self.out_shapes2 else None)

    def emit(self, op: str, inputs: Sequence[str], **attrs: Any) -> None:
        self.b.node(op, inputs, [self.out[0]], **attrs)


Handler = Callable[[Op], None]
HANDLERS: dict[str, Handler] = {}

_BINARY = {
    "Add": "Add", "Subtract": "Sub", "Multiply": "Mul", "Divide": "Div", "Maximum": "Max",
    "Minimum": "Min", "Power": "Pow", "Equal": "Equal", "Less": "Less", "LessEqual": "LessOrEqual",
    "Greater": "Greater", "GreaterEqual": "GreaterOrEqual", "LogicalAnd": "And", "LogicalOr": "Or",
}
_UNARY = {
    "Abs": "Abs", "Negative": "Neg", "Exp": "Exp", "Sin": "Sin", "Cos": "Cos", "Tan": "Tan",
    "Tanh": "Tanh", "Sinh": "Sinh", "Cosh": "Cosh", "ArcTan": "Atan", "ArcSin": "Asin", "ArcCos": "Acos",
    "Sigmoid": "Sigmoid", "Erf": "Erf", "Floor": "Floor", "Ceil": "Ceil", "Sign": "Sign",
    "Round": "Round", "LogicalNot": "Not", "Copy": "Identity", "StopGradient": "Identity",
}
def _elementwise(onnx_op: str, arity: int) -> Handler:
    def handler(op: Op) -> None:
        op.emit(onnx_op, op.x[:arity])
    return handler


for _mlx, _onnx_op in _BINARY.items():
    HANDLERS[_mlx] = _elementwise(_onnx_op, 2)
for _mlx, _onnx_op in _UNARY.items():
    HANDLERS[_mlx] = _elementwise(_onnx_op, 1)


def handles(*names: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = handler
        return handler
    return register


