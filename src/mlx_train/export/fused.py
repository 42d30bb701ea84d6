"""ONNX handlers for MLX's fused primitives: RMSNorm, LayerNorm, RoPE, ScaledDotProductAttention.

A trace taken on the GPU stream contains these as single primitives (on the CPU they
come decomposed into the ops :mod:`mlx_train.export.onnx` translates); each is
written out here as the equivalent ONNX subgraph. Their arguments are MLX's
primitive state: ``[eps]``, ``[dims, traditional, base, scale, forward]`` and
``[scale, do_causal, has_sinks, output_logsumexp, force_fused]``.

Example::

    from mlx_train.export.ops import HANDLERS
    "RoPE" in HANDLERS        # True once mlx_train.export.onnx is imported
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_train.export.graph import ExportError
from mlx_train.export.ops import Op, handles, numpy_dtype, onnx_dtype


def _rsqrt_mean_square(op: Op, x: str, eps: float, dtype: type) -> str:
    mean = op.b.node("ReduceMean", [op.b.node("Mul", [x, x]), op.b.const([-1], np.int64)], keepdims=1)
    return op.b.node("Reciprocal", [op.b.node("Sqrt", [op.b.node("Add", [mean, op.b.const(eps, dtype)])])])


@handles("RMSNorm")
def _rms_norm(op: Op) -> None:
    dtype = numpy_dtype(op.prim.inputs[0][2])
    scale = _rsqrt_mean_square(op, op.x[0], float(op.args[0]), dtype)
    op.emit("Mul", [op.b.node("Mul", [op.x[0], scale]), op.x[1]])


@handles("LayerNorm")
def _layer_norm(op: Op) -> None:
    dtype = numpy_dtype(op.prim.inputs[0][2])
    mean = op.b.node("ReduceMean", [op.x[0], op.b.const([-1], np.int64)], keepdims=1)
    centred = op.b.node("Sub", [op.x[0], mean])
    scale = _rsqrt_mean_square(op, centred, float(op.args[0]), dtype)
    op.emit("Add", [op.b.node("Mul", [op.b.node("Mul", [centred, scale]), op.x[1]]), op.x[2]])


@handles("RoPE")
def _rope(op: Op) -> None:
    dims, traditional, base, scale, forward = op.args[:5]
    dims, shape, b = int(dims), op.in_shapes[0], op.b
    if len(op.in_shapes[1]) != 0:
        raise ExportError("RoPE with one offset per batch row has no ONNX translation here; use a scalar offset")
    half, length = dims // 2, shape[-2]
    if len(op.x) > 2:  # custom frequencies
        inv_freq = b.node("Reciprocal", [op.x[2]])
    else:
        inv_freq = b.const(base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims), np.float32)
    offset = b.node("Cast", [op.x[1]], to=onnx_dtype(mx.float32))
    positions = b.node("Add", [b.const(np.arange(length), np.float32), offset])
    positions = b.node("Mul", [b.node("Unsqueeze", [positions, b.const([1], np.int64)]), b.const(scale, np.float32)])
    theta = b.node("Mul", [positions, inv_freq])  # [L, dims/2]
    to = onnx_dtype(op.prim.inputs[0][2])
    cos, sin = b.node("Cast", [b.node("Cos", [theta])], to=to), b.node("Cast", [b.node("Sin", [theta])], to=to)
    if not forward:
        sin = b.node("Neg", [sin])
    axis = b.const([-1], np.int64)

    def take(start: int, stop: int, step: int = 1) -> str:  # x[..., start:stop:step]
        bounds = [b.const([v], np.int64) for v in (start, stop)]
        return b.node("Slice", [op.x[0], *bounds, axis, b.const([step], np.int64)])

    x1, x2 = (take(0, dims, 2), take(1, dims, 2)) if traditional else (take(0, half), take(half, dims))
    out1 = b.node("Sub", [b.node("Mul", [x1, cos]), b.node("Mul", [x2, sin])])
    out2 = b.node("Add", [b.node("Mul", [x1, sin]), b.node("Mul", [x2, cos])])
    if traditional:  # interleave the pairs back
        pairs = b.node("Concat", [b.node("Unsqueeze", [o, b.const([-1], np.int64)]) for o in (out1, out2)], axis=-1)
        shape2 = op.in_shapes2[0] if op.in_shapes2 else None
        rotated = b.node("Reshape", [pairs, b.ints([*shape[:-1], dims], [*shape2[:-1], dims] if shape2 else None)])
        parts = [rotated]
    else:
        parts = [out1, out2]
    if dims < shape[-1]:
        parts.append(take(dims, shape[-1]))
    op.emit("Concat", parts, axis=-1) if len(parts) > 1 else op.emit("Identity", parts)


@handles("ScaledDotProductAttention")
def _attention(op: Op) -> None:
    scale, causal, has_sinks, logsumexp = (op.args + [False] * 4)[:4]
    if has_sinks or logsumexp:
        raise ExportError("ScaledDotProductAttention with attention sinks or a logsumexp output has no ONNX "
                          "translation here")
    b, (q_shape, k_shape) = op.b, op.in_shapes[:2]
    heads, kv_heads, length, keys = q_shape[1], k_shape[1], q_shape[2], k_shape[2]
    dtype = numpy_dtype(op.prim.inputs[0][2])
    q, k, v, mask = op.x[0], op.x[1], op.x[2], (op.x[3] if len(op.x) > 3 else None)
    grouped = heads != kv_heads
    if grouped:  # grouped KV heads: [B, Hkv, repeats, L, D] queries against [B, Hkv, 1, S, D] keys
        repeats, batch2 = heads // kv_heads, op.in_shapes2[0][0] if op.in_shapes2 else None

        def split(shape: tuple[int, ...], n: int, last: int) -> str:  # [B, H, n, last] -> [B, Hkv, repeats, n, last]
            later = None if batch2 is None else [batch2, kv_heads, repeats, n, last]
            return b.ints([shape[0], kv_heads, repeats, n, last], later)

        q = b.node("Reshape", [q, split(q_shape, length, q_shape[3])])
        k, v = (b.node("Unsqueeze", [t, b.const([2], np.int64)]) for t in (k, v))
        if mask is not None:
            mask_shape = op.in_shapes[3]
            if len(mask_shape) == 4 and mask_shape[1] == heads:
                mask = b.node("Reshape", [mask, split(mask_shape, length, keys)])
            elif len(mask_shape) == 4:
                mask = b.node("Unsqueeze", [mask, b.const([2], np.int64)])
    k_t = b.node("Transpose", [k], perm=[0, 1, 2, 4, 3] if grouped else [0, 1, 3, 2])
    scores = b.node("Mul", [b.node("MatMul", [q, k_t]), b.const(scale, dtype)])
    if causal:  # lower-right aligned, like MLX's mask="causal"
        allowed = np.tril(np.ones((length, keys), bool), keys - length)
        scores = b.node("Where", [b.const(allowed), scores, b.const(-np.inf, dtype)])
    if mask is not None:
        mask_is_bool = op.prim.inputs[3][2] == mx.bool_
        scores = b.node("Where", [mask, scores, b.const(-np.inf, dtype)]) if mask_is_bool \
            else b.node("Add", [scores, mask])
    out = b.node("MatMul", [b.node("Softmax", [scores], axis=-1), v])
    op.emit("Reshape", [out, op.out_shape()]) if grouped else op.emit("Identity", [out])
