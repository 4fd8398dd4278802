"""Packed-weight kernels: dequant GEMV (decode), dequant GEMM (prefill) and dequantize, one
OpenCL C template over every `QuantScheme` kind, specialised by a per-kind decode snippet.

A snippet defines `dq_unit(b, u, w)`: the U consecutive elements of unit u of the block at
byte pointer `b` (block layouts: rlx_core/ir/quant.py), decoded in DT (float; double for
f64) with the same operation order as the numpy decoder. A unit is 32 elements (one K-quant
sub-block), or gcd(block, 32) for RLX's int blocks. Every kernel reads weights one unit at a
time, so each weight byte is read once and dequantized straight into local memory, where the
GEMV walks it with x read coalesced and the GEMM multiplies it as a tile.

One program per (scheme, dtypes) holds all three kernels; bias and activation are runtime
arguments, so a model compiles a handful of programs (PoCL spends about a second on each).
"""
from __future__ import annotations

import math

from rlx_core.ir.ops import ACTIVATIONS
from rlx_core.ir.quant import QuantScheme

from . import kernels as K

GEMV_ROWS = 8          # rows of x per GEMV work-group; larger M uses the tiled GEMM

_BYTES = K.source("quant_bytes.cl")

_K_SCALES = K.source("quant_k_scales.cl")

_LEGACY = K.source("quant_legacy.cl")

# (head, element from the low nibble, element from the high nibble)
_LEGACY_KINDS = {
    "q4_0": ("__global const uchar* qs = b + 2;",
             "(DT)((int)(v & 15) - 8) * d", "(DT)((int)(v >> 4) - 8) * d"),
    "q4_1": ("DT m = (DT)f16_at(b + 2); __global const uchar* qs = b + 4;",
             "(DT)(v & 15) * d + m", "(DT)(v >> 4) * d + m"),
    "q5_0": ("uint qh = u32_at(b + 2); __global const uchar* qs = b + 6;",
             "(DT)((int)((v & 15) | (((qh >> l) & 1) << 4)) - 16) * d",
             "(DT)((int)((v >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16) * d"),
    "q5_1": ("DT m = (DT)f16_at(b + 2); uint qh = u32_at(b + 4); __global const uchar* qs = b + 8;",
             "(DT)((v & 15) | (((qh >> l) & 1) << 4)) * d + m",
             "(DT)((v >> 4) | (((qh >> (l + 16)) & 1) << 4)) * d + m"),
}

_SNIPPETS = {
    "q8_0": K.source("quant_q8_0.cl"),
    "q4_k": _K_SCALES + K.source("quant_q4_k.cl"),
    "q5_k": _K_SCALES + K.source("quant_q5_k.cl"),
    "q6_k": K.source("quant_q6_k.cl"),
    "int8": K.source("quant_int8.cl"),
    "int4": K.source("quant_int4.cl"),
}


def _legacy(head: str, lo: str, hi: str) -> str:
    """quant_legacy.cl for one kind: its fields and nibble decoders as the defines it uses."""
    return f"#define LEGACY_HEAD {head}\n#define LEGACY_LO {lo}\n#define LEGACY_HI {hi}\n" + _LEGACY


_SNIPPETS.update({k: _legacy(*parts) for k, parts in _LEGACY_KINDS.items()})

KINDS = frozenset(_SNIPPETS)        # QuantScheme kinds with a kernel here

# x: [M, K] contiguous; w: N rows of RB bytes; y: [M, N] contiguous. The epilogue rounds to
# T_Y, adds the bias (rounded again) and applies activation `act` (index into ACTIVATIONS),
# as fused_matmul_bias_act does.
_TEMPLATE = K.source("quant.cl")


def unit(scheme: QuantScheme) -> int:
    return math.gcd(scheme.block_size, 32)


def _act_fn(dt: str) -> str:
    cases = " ".join(f"case {i}: return {K.act_expr(a, 'v', dt)};" for i, a in enumerate(ACTIVATIONS))
    return f"inline {dt} act_fn(int a, {dt} v) {{ switch (a) {{ {cases} }} return v; }}\n"


def source(scheme: QuantScheme, x_dt, y_dt, bias_dt) -> str:
    """The program (dq_gemv, dq_gemm, dq_rows) for one scheme and dtype signature."""
    dt = K.acc_type(x_dt, y_dt)
    defs = dict(QK=scheme.block_size, BPB=scheme.bytes_per_block, U=unit(scheme), MR=GEMV_ROWS, DT=dt,
                T_X=K.ctype(x_dt), T_Y=K.ctype(y_dt), T_BIAS=K.ctype(bias_dt))
    head = K.prelude([x_dt, y_dt, bias_dt, dt]) + "".join(f"#define {k} {v}\n" for k, v in defs.items())
    head += f"#define TO_Y(v) {K.to(y_dt, 'v')}\n"
    return head + _BYTES + _act_fn(dt) + _SNIPPETS[scheme.kind] + _TEMPLATE


__all__ = ["GEMV_ROWS", "KINDS", "source", "unit"]
