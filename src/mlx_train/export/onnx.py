"""Translate a traced MLX graph (see :mod:`mlx_train.export.graph`) into an ONNX model.

Each MLX primitive has a handler in ``HANDLERS`` that emits the equivalent ONNX
nodes. Shapes that a handler writes into the graph (reshape targets, broadcast
shapes, slice ends) come from two traces at consecutive batch sizes, so a
batch-dependent number becomes ``a * batch + c`` computed from the input's
runtime shape: the exported model takes any batch size.

Example::

    from mlx_train.export.graph import trace_pair
    from mlx_train.export.onnx import to_onnx

    first, second, batch = trace_pair(model, [mx.zeros((2, 64))])
    onnx_model = to_onnx(first, second, batch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from mlx_train.export import fused  # noqa: F401  (registers the fused-op handlers)
from mlx_train.export.graph import ExportError, Trace
from mlx_train.export.ops import HANDLERS, OPSET, Builder, Op, _onnx, handles, numpy_dtype, onnx_dtype  # noqa: F401

if TYPE_CHECKING:
    from onnx import ModelProto


# ---------------------------------------------------------------- arithmetic
@handles("NotEqual")
def _not_equal(op: Op) -> None:
    op.emit("Not", [op.b.node("Equal", op.x[:2])])


@handles("Square")
def _square(op: Op) -> None:
    op.emit("Mul", [op.x[0], op.x[0]])


@handles("Sqrt")
def _sqrt(op: Op) -> None:
    recip = bool(op.args and op.args[0])  # rsqrt is Sqrt with recip=True
    op.emit("Reciprocal", [op.b.node("Sqrt", op.x)]) if recip else op.emit("Sqrt", op.x)


@handles("Log")
def _log(op: Op) -> None:
    base = {1: 2.0, 2: 10.0}.get(int(op.args[0]) if op.args else 0)  # MLX's Log base: e, two, ten
    if base is None:
        return op.emit("Log", op.x)
    dtype = numpy_dtype(op.prim.inputs[0][2])
    op.emit("Div", [op.b.node("Log", op.x), op.b.const(np.log(base), dtype)])


@handles("Log1p")
def _log1p(op: Op) -> None:
    one = op.b.const(1, numpy_dtype(op.prim.inputs[0][2]))
    op.emit("Log", [op.b.node("Add", [op.x[0], one])])


@handles("Expm1")
def _expm1(op: Op) -> None:
    one = op.b.const(1, numpy_dtype(op.prim.inputs[0][2]))
    op.emit("Sub", [op.b.node("Exp", op.x), one])


@handles("Select")
def _select(op: Op) -> None:
    op.emit("Where", op.x)


@handles("AsType")
def _astype(op: Op) -> None:
    op.emit("Cast", op.x, to=onnx_dtype(op.args[0]))


@handles("Softmax")
def _softmax(op: Op) -> None:
    op.emit("Softmax", op.x, axis=-1)


@handles("LogSumExp")
def _logsumexp(op: Op) -> None:
    keep = int(len(op.out_shapes[0]) == len(op.in_shapes[0]))
    op.emit("ReduceLogSumExp", [op.x[0], op.b.const([-1], np.int64)], keepdims=keep)


_REDUCE = {2: "ReduceSum", 3: "ReduceProd", 4: "ReduceMin", 5: "ReduceMax"}  # MLX's Reduce::ReduceType


@handles("Reduce")
def _reduce(op: Op) -> None:
    kind, axes = int(op.args[0]), [int(a) for a in op.args[1]]
    keep = int(len(op.out_shapes[0]) == len(op.in_shapes[0]))
    axes_name = op.b.const(axes, np.int64)
    if kind in _REDUCE:
        return op.emit(_REDUCE[kind], [op.x[0], axes_name], keepdims=keep)
    # all / any: reduce the booleans as integers.
    as_int = op.b.node("Cast", op.x, to=onnx_dtype(mx.int32))
    reduced = op.b.node("ReduceMin" if kind == 0 else "ReduceMax", [as_int, axes_name], keepdims=keep)
    op.emit("Cast", [reduced], to=onnx_dtype(mx.bool_))


@handles("ArgReduce")
def _argreduce(op: Op) -> None:
    kind, axis = int(op.args[0]), int(op.args[1])
    keep = int(len(op.out_shapes[0]) == len(op.in_shapes[0]))
    index = op.b.node("ArgMin" if kind == 0 else "ArgMax", op.x, axis=axis, keepdims=keep)
    op.emit("Cast", [index], to=onnx_dtype(op.prim.outputs[0][2]))


@handles("Matmul")
def _matmul(op: Op) -> None:
    op.emit("MatMul", op.x[:2])


@handles("AddMM")
def _addmm(op: Op) -> None:
    alpha, beta = (float(v) for v in op.args[:2])
    dtype = numpy_dtype(op.prim.outputs[0][2])
    product = op.b.node("MatMul", op.x[:2])
    if alpha != 1.0:
        product = op.b.node("Mul", [product, op.b.const(alpha, dtype)])
    bias = op.x[2] if beta == 1.0 else op.b.node("Mul", [op.x[2], op.b.const(beta, dtype)])
    op.emit("Add", [product, bias])


# ---------------------------------------------------------------- shapes
@handles("Reshape", "Flatten", "Unflatten")
def _reshape(op: Op) -> None:
    op.emit("Reshape", [op.x[0], op.out_shape()])


@handles("Broadcast", "BroadcastAxes", "Full")
def _broadcast(op: Op) -> None:
    op.emit("Expand", [op.x[0], op.out_shape()])


@handles("Transpose")
def _transpose(op: Op) -> None:
    op.emit("Transpose", op.x, perm=[int(a) for a in op.args[0]])


@handles("Squeeze")
def _squeeze(op: Op) -> None:
    op.emit("Squeeze", [op.x[0], op.b.const(list(op.args[0]), np.int64)])


@handles("ExpandDims")
def _expand_dims(op: Op) -> None:
    op.emit("Unsqueeze", [op.x[0], op.b.const(list(op.args[0]), np.int64)])


@handles("Slice")
def _slice(op: Op) -> None:
    start, stop, strides = op.args[:3]
    start2, stop2 = (op.args2[0], op.args2[1]) if op.args2 else (None, None)
    axes = op.b.const(list(range(len(start))), np.int64)
    op.emit("Slice", [op.x[0], op.b.ints(start, start2), op.b.ints(stop, stop2), axes,
                      op.b.const(list(strides), np.int64)])


@handles("Concatenate")
def _concatenate(op: Op) -> None:
    op.emit("Concat", op.x, axis=int(op.args[0]))


@handles("Split")
def _split(op: Op) -> None:
    axis = int(op.args[1])
    sizes = [s[axis] for s in op.out_shapes]
    if op.out_shapes2 and [s[axis] for s in op.out_shapes2] != sizes:
        raise ExportError("Split along the batch axis cannot have a dynamic batch; export with dynamic_batch=False")
    op.b.node("Split", [op.x[0], op.b.const(sizes, np.int64)], op.out, axis=axis)


@handles("Arange")
def _arange(op: Op) -> None:
    if op.args2 is not None and list(op.args2) != list(op.args):
        raise ExportError("an arange whose length depends on the batch size cannot be exported with a dynamic "
                          "batch; export with dynamic_batch=False")
    start, stop, step = (float(v) for v in op.args[:3])
    values: np.ndarray = np.arange(start, stop, step).astype(numpy_dtype(op.prim.outputs[0][2]))
    op.emit("Identity", [op.b.const(values, hint="arange")])


@handles("Gather")
def _gather(op: Op) -> None:
    axes, slice_sizes = [int(a) for a in op.args[0]], list(op.args[1])
    source = op.in_shapes[0]
    full = [1 if i in axes else source[i] for i in range(len(source))]
    if len(axes) != 1 or len(op.x) != 2 or list(slice_sizes) != full:
        raise ExportError(f"Gather with axes {axes} and slice sizes {slice_sizes} (indexing several axes at "
                          "once, or taking partial slices) has no ONNX translation here; index one axis at a "
                          "time (x[idx] or mx.take)")
    axis, k = axes[0], len(op.in_shapes[1])
    index = op.b.node("Cast", [op.x[1]], to=onnx_dtype(mx.int64))
    gathered = op.b.node("Gather", [op.x[0], index], axis=axis)
    if axis:  # ONNX puts the index dims at `axis`, MLX first
        perm = list(range(axis, axis + k)) + list(range(axis)) + list(range(axis + k, len(source) - 1 + k))
        gathered = op.b.node("Transpose", [gathered], perm=perm)
    op.emit("Unsqueeze", [gathered, op.b.const([k + axis], np.int64)])


@handles("GatherAxis")
def _gather_axis(op: Op) -> None:
    index = op.b.node("Cast", [op.x[1]], to=onnx_dtype(mx.int64))
    op.emit("GatherElements", [op.x[0], index], axis=int(op.args[0]))


@handles("Convolution")
def _convolution(op: Op) -> None:
    stride, pad_low, pad_high, kernel_dilation, input_dilation, groups, flip = op.args[:7]
    if any(int(d) != 1 for d in input_dilation) or flip:
        raise ExportError("a transposed or flipped convolution (input_dilation != 1 or flip) has no ONNX "
                          "translation here; export models with plain Conv1d/Conv2d/Conv3d")
    rank = len(op.in_shapes[0])
    to_first = [0, rank - 1, *range(1, rank - 1)]  # MLX is channels-last, ONNX channels-first
    to_last = [0, *range(2, rank), 1]
    x = op.b.node("Transpose", [op.x[0]], perm=to_first)
    w = op.b.node("Transpose", [op.x[1]], perm=to_first)
    y = op.b.node("Conv", [x, w], strides=list(stride), pads=[*pad_low, *pad_high],
                  dilations=list(kernel_dilation), group=int(groups))
    op.emit("Transpose", [y], perm=to_last)


def _where_from(trace: Trace, index: int, producers: dict[str, str]) -> str:
    op = trace.primitives[index]
    sources = []
    for value in op.inputs:
        source = producers.get(value[0], "a constant")
        sources.append(f"{source} {tuple(value[1])} {value[2]}")
    return (f"operation {index + 1} of {len(trace.primitives)}, with inputs from: {'; '.join(sources) or 'none'}"
            f" and output shape {tuple(op.outputs[0][1]) if op.outputs else '()'}")


_HINTS = {
    "RandomBits": " (random numbers: dropout or another random layer in training mode; export calls model.eval(), "
                  "so a random op left means the function draws randomness itself)",
}


def check_supported(trace: Trace) -> None:
    """Raise ExportError naming the first primitive of ``trace`` that has no ONNX translation."""
    producers = {value[0]: f"model input {i}" for i, value in enumerate(trace.inputs)}
    for index, prim in enumerate(trace.primitives):
        if prim.name not in HANDLERS:
            raise ExportError(
                f"cannot export the MLX primitive '{prim.name}'{_HINTS.get(prim.name, '')}: it is "
                f"{_where_from(trace, index, producers)}. Supported primitives: {', '.join(sorted(HANDLERS))}"
            )
        for value in prim.outputs:
            producers[value[0]] = f"{prim.name} (operation {index + 1})"


def to_onnx(first: Trace, second: Trace | None, batch: int, name: str = "mlx_model") -> ModelProto:
    """Translate a trace (and, for a dynamic batch, a second one at ``batch + 1``) into an ``onnx.ModelProto``.

    Example::

        model_proto = to_onnx(*trace_pair(model, [x]))
        onnx.save(model_proto, "model.onnx")
    """
    onnx = _onnx()
    helper = onnx.helper
    check_supported(first)
    b = Builder(first, second, batch)
    graph_inputs, graph_outputs = [], []
    for i, (mlx_name, shape, dtype) in enumerate(first.inputs):
        b.names[mlx_name] = f"input_{i}"
        dims = ["batch", *shape[1:]] if second is not None and shape else list(shape)
        graph_inputs.append(helper.make_tensor_value_info(f"input_{i}", onnx_dtype(dtype), dims))
    for mlx_name, array in first.constants.items():
        b.names[mlx_name] = f"w_{mlx_name}"
        b.initializers.append(onnx.numpy_helper.from_array(np.array(array, numpy_dtype(array.dtype)),
                                                            f"w_{mlx_name}"))
    for index, prim in enumerate(first.primitives):
        HANDLERS[prim.name](Op(b, prim, second.primitives[index] if second else None))
        for value in prim.outputs:
            b.names[value[0]] = f"v_{value[0]}"
    for i, (mlx_name, shape, dtype) in enumerate(first.outputs):
        b.node("Identity", [b.names[mlx_name]], [f"output_{i}"])
        batched = second is not None and shape and second.outputs[i][1][0] != shape[0]
        dims = ["batch", *shape[1:]] if batched else list(shape)
        graph_outputs.append(helper.make_tensor_value_info(f"output_{i}", onnx_dtype(dtype), dims))
    graph = helper.make_graph(b.nodes, name, graph_inputs, graph_outputs, b.initializers)
    opsets = [helper.make_opsetid("", OPSET)]
    model: ModelProto = helper.make_model(graph, opset_imports=opsets, producer_name="mlx-train")
    model.ir_version = min(model.ir_version, 10)  # readable by onnxruntime releases of the last two years
    return model


# The fused primitives of GPU traces register their handlers on import.
