"""Routed experts (`moe_experts`) on numba's threads: dense f32 or packed expert stacks; and
the router (`moe_route`, route_rows) as one serial pass a token.

A step routes first: the (token, slot) pairs are counting-sorted by expert, so each expert's
tokens form one group of consecutive rows. Then, reading an expert's weight bytes once per
group:
  up    h[s] = act(gate[e] @ x[t]) * (up[e] @ x[t])   for every sorted pair s = (t, e)
  down  ys[s] = down[e] @ h[s]
and a combine sums each token's rows of ys with the route's weights into the output.
The passes run one of two ways, chosen per call from the groups' mean size:
- GEMV (decode: a token or a few per expert): ONE parallel region (each launch of numba's
  workers costs tens of microseconds, milliseconds on a busy machine) over (group, slice of
  the expert width) tasks, each running both passes for its slice: packed rows dotted with
  the group's rows as they are read (the formats' `dot`, or `idot` on int8 blocks), h's
  slice rounded where int8_h, and the slice's share of every down row into ys[slice] (the
  combine sums the slices: no task waits for another); on one thread where small
  (GEMV_PAR_MIN);
- GEMM (prefill: many tokens per expert): with int8 x and h and every stack packed, ONE
  region over (group, slice) tasks taken one at a time (`igemm_step`: the formats' int8
  GEMM per task, on its thread, for gate, up and the slice of down; q4_k's from moe_igemm,
  whose panels cost a quarter of the build: OLMoE's 128-token step 140 -> 83 ms a core);
  otherwise two, threads
  over parts of the (group, row tile) tasks split by cost, each tile of weight rows decoded
  once into the part's scratch (`rows_ser`) and multiplied with the group's rows by
  one-thread cblas_sgemm on numba's workers (as quant_kernels' rows_gemm; dense f32 tiles
  in place), or a pass's int8 GEMMs group by group (`_igemm_groups`).
With `[precision] activations = "int8"` (x arrives from a fake_quantize to int8_b32; the
runner sets int8_x) the up pass multiplies x's int8 blocks with the packed integers, as
llama.cpp's q8 activations; the op's `int8_h` (set by the same opt-in where down is packed)
does the same for the down pass, h rounded through int8_b32 here.
The formats' decoders are quant_kernels' generated ones; a module generated here per
(gate, up, down format, activation) binds them. Steps it does not cover (f16/bf16/f64, a
format without numba kernels) keep the NumPy backend's kernel.
"""
from __future__ import annotations

import functools
import re
import types

import numba
import numpy as np
from numba import njit, prange

from rlx_core.backends.numpy.blas import single_threaded_blas
from rlx_core.ir.dtype import F32
from rlx_core.ir.errors import ModelError
from rlx_core.ir.quant import QuantScheme

from . import moe_igemm, quant_kernels
from .cblas import SGEMM
from .codegen import ACT, PAR_MIN, SWIGLU_HEAD, as_step, bindable, load_source
from .quant_kernels import BLOCK, F16, FORMATS
from .simd import hsum, load_f32

GEMV_PAR_MIN = 1 << 18      # multiply-adds of a GEMV pass from which it runs on every thread (below:
                            # ~100 us of work; a tiny layer's step on 2 busy cores: 3.2 ms parallel,
                            # 0.06 ms on one thread, the workers waiting for a core at each launch)
GROUP_GEMM = 8.0            # mean tokens per expert group from which the passes run as GEMMs (OLMoE's
                            # layer, q4_k, 2 AMD EPYC cores: GEMV 72 / 97 / 187 ms, GEMM 160 / 99 / 128
                            # ms at a mean group of 2 / 8 / 16 tokens)
GROUP_GEMM_INT8 = 12.0      # the same with x's int8 blocks (int8_x): OLMoE's layer, q4_k, int8 up and down,
                            # one loaded AMD EPYC Zen 5 core: GEMV 98 / 183 ms, GEMM 136 / 147 ms at 8 / 16
TILE_FLOATS = 1 << 18       # floats of a weight tile (1 MB): OLMoE's 128-token prefill, 2 loaded AMD
                            # EPYC cores: 15 GFLOP/s at 1 << 16 (sgemm's N too narrow), 22 at 1 << 18
DECODE_COST = 4             # a tile's decode, in tokens' products (the GEMM tasks' cost split)
_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})


# --------------------------------------------------------------------------- routing
@njit(cache=True)
def route(ids, n_experts, weights):
    """The pairs (t, j) counting-sorted by expert: tok[s] and wt[s] the token and route weight
    of sorted pair s, slot[t, j] = s, experts the ids with any pair and starts[g] where group
    g (expert experts[g]) begins (starts[-1] = T k). bad: the first pair t k + j whose id is
    outside [0, n_experts), else -1 (the arrays are then meaningless)."""
    t_, k = ids.shape
    count = np.zeros(n_experts + 1, np.int64)
    for t in range(t_):
        for j in range(k):
            e = np.int64(ids[t, j])
            if e < 0 or e >= n_experts:
                return (np.empty(0, np.int64), np.empty(0, np.float32), np.empty((0, 0), np.int64),
                        np.empty(0, np.int64), np.empty(0, np.int64), np.int64(t * k + j))
            count[e + 1] += 1
    active = 0
    for e in range(n_experts):
        active += count[e + 1] > 0
        count[e + 1] += count[e]
    experts, starts = np.empty(active, np.int64), np.empty(active + 1, np.int64)
    g = 0
    for e in range(n_experts):
        if count[e + 1] > count[e]:
            experts[g], starts[g] = e, count[e]
            g += 1
    starts[active] = t_ * k
    tok, wt, slot = np.empty(t_ * k, np.int64), np.empty(t_ * k, np.float32), np.empty((t_, k), np.int64)
    for t in range(t_):
        for j in range(k):
            e = np.int64(ids[t, j])
            s = count[e]
            count[e] += 1
            tok[s], wt[s], slot[t, j] = t, weights[t, j], s
    return tok, wt, slot, experts, starts, np.int64(-1)


@njit(cache=True, error_model="numpy")
def _above(v, u):
    """v ranks above u: larger, or u is NaN and v is not (NaN ranks last, as in a sort)."""
    return v > u or (u != u and v == v)


@njit(cache=True, error_model="numpy")
def route_rows(z, topk_softmax, normalize, w, ids):
    """moe_route over the rows of z [T, E] into w, ids [T, k] (rlx_core.ir.moe's spec): each
    row's k largest logits, largest first, the lowest id first on ties (softmax is monotone,
    so they are the k largest probabilities too), weighted by the softmax over the row
    (topk_softmax: over the k; normalize: rescaled to sum 1), computed in float64. One
    serial pass a row: a decode token's route is ~1 us, where the NumPy kernel's dozen
    array calls cost 15-30 us (more on a busy machine), twice a token in a 2-layer model."""
    t_, e_ = z.shape
    k = w.shape[1]
    top = np.empty(k, np.float64)
    for t in range(t_):
        n = 0
        for e in range(e_):
            v = np.float64(z[t, e])
            if n == k and not _above(v, top[k - 1]):
                continue
            pos = n if n < k else k - 1
            while pos > 0 and _above(v, top[pos - 1]):
                top[pos], ids[t, pos] = top[pos - 1], ids[t, pos - 1]
                pos -= 1
            top[pos], ids[t, pos] = v, e
            n = min(n + 1, k)
        m = top[0] if np.isfinite(top[0]) else 0.0
        s = 0.0
        if topk_softmax:
            for j in range(k):
                s += np.exp(top[j] - m)
        else:
            for e in range(e_):
                s += np.exp(np.float64(z[t, e]) - m)
        s = s if s != 0 else 1.0
        picked = 0.0
        for j in range(k):
            picked += np.exp(top[j] - m) / s
        for j in range(k):
            p = np.exp(top[j] - m) / s
            w[t, j] = p / picked if normalize and not topk_softmax else p


def prepare_moe_route(a, outs, protos, op=None):
    """A runner step for `moe_route` over f32 or f64 logits [..., E] (route_rows), or None
    (f16/bf16: the NumPy backend's kernel runs it)."""
    z, (w, ids) = protos[0], outs
    if (z.dtype not in (np.float32, np.float64) or w.dtype != z.dtype or ids.dtype != np.int64 or w.size == 0
            or not (z.flags.c_contiguous and w.flags.c_contiguous and ids.flags.c_contiguous)):
        return None
    e, k = z.shape[-1], a["k"]
    flags = (a["order"] == "topk_softmax", bool(a["normalize"]))
    w2, ids2 = w.reshape(-1, k), ids.reshape(-1, k)
    return as_step(bindable(route_rows, lambda z: (z.reshape(-1, e), *flags, w2, ids2)))


@njit(**_OPT)
def _combine_token(ys, slot, wt, out, t):
    """out[t] = sum over j of the route weight times ys[:, slot[t, j]] (the sum of its slices)."""
    o = out[t]
    o[:] = 0
    for j in range(slot.shape[1]):
        s = slot[t, j]
        w = wt[s]
        for p in range(ys.shape[0]):
            y = ys[p, s]
            for c in range(o.shape[0]):
                o[c] += w * y[c]


@njit(parallel=True, **_OPT)
def combine_par(ys, slot, wt, out):
    for t in prange(slot.shape[0]):
        _combine_token(ys, slot, wt, out, t)


@njit(**_OPT)
def combine_ser(ys, slot, wt, out):
    """combine_par on one thread: a decode step's few rows (a parallel launch costs more)."""
    for t in range(slot.shape[0]):
        _combine_token(ys, slot, wt, out, t)


@njit(parallel=True, **_OPT)
def gather_rows(x, tok, xg):
    """xg[s] = x[tok[s]]: each group's tokens as consecutive rows (the GEMMs' operand)."""
    for s in prange(tok.shape[0]):
        xg[s] = x[tok[s]]


@njit(cache=True)
def split_tasks(starts, tiles, parts):
    """bounds[p]..bounds[p + 1]: part p's run of the (group, tile) tasks, task g * tiles + i
    costing the group's tokens plus a tile's decode, runs of about equal cost."""
    groups = starts.shape[0] - 1
    total = 0
    for g in range(groups):
        total += (starts[g + 1] - starts[g] + DECODE_COST) * tiles
    bounds = np.empty(parts + 1, np.int64)
    bounds[0] = 0
    p, acc = 1, 0
    for task in range(groups * tiles):
        g = task // tiles
        acc += starts[g + 1] - starts[g] + DECODE_COST
        while p < parts and acc * parts >= total * p:
            bounds[p] = task + 1
            p += 1
    while p <= parts:
        bounds[p] = groups * tiles
        p += 1
    return bounds


# --------------------------------------------------------------------------- dense rows
# A dense f32 stack reads through the same names as a packed format's driver module
# (quant_kernels.drivers): `dot` of a row with x, `ahead` (a prefetch; none here).
@njit(**_OPT)
def dense_dot(r, x, xs, tab):
    acc = np.float32(0)
    for i in range(x.shape[0]):
        acc += r[i] * x[i]
    return acc


@njit(**_OPT)
def dense_ahead(w, n):
    pass


@njit(**_OPT)
def block_sums(x, xs):
    """xs[c] = the sum of x's block c of 32 (as quant_kernels.sums32, into xs)."""
    for c in range(xs.shape[0]):
        v = load_f32(x, 32 * c) + load_f32(x, 32 * c + 8) + load_f32(x, 32 * c + 16) + load_f32(x, 32 * c + 24)
        xs[c] = hsum(v)


# --------------------------------------------------------------------------- generated
_IMPORTS = {
    "packed": ("from {mod} import dot as {w}_dot, idot as {w}_idot, ahead as {w}_ahead, iahead as {w}_iahead, "
               "rows_ser as {w}_rows\n"),
    "dense": "from rlx_backend_numba.moe import dense_dot as {w}_dot, dense_ahead as {w}_ahead\n",
}
_TILE = {
    "packed": """
@njit(**_OPT)
def {w}_tile(w, r0, nr, buf, tab):
    \"\"\"Rows r0 .. r0 + nr of packed w decoded into buf.\"\"\"
    {w}_rows(w, r0, buf[:nr], tab)
    return buf[:nr]
""",
    "dense": """
@njit(**_OPT)
def {w}_tile(w, r0, nr, buf, tab):
    \"\"\"Rows r0 .. r0 + nr of dense w, in place.\"\"\"
    return w[r0:r0 + nr]
""",
}
_SPAN = """
@njit(**_OPT)
def {w}_span(r, i0, i1):
    \"\"\"Columns i0 .. i1 of row r (whole blocks of {elems} values, {nbytes} bytes each).\"\"\"
    return r[i0 // {elems} * {nbytes}:i1 // {elems} * {nbytes}]
"""

# The GEMV form, one parallel region a step (decode: each launch of numba's workers costs
# tens of microseconds on a VM, more on a busy machine, so up, down and the rounding between
# them run in one): tasks of (group, slice of the expert width I), each computing its slice
# of h for the group's pairs (gate and up rows i0..i1), rounding it, and its part of the down
# product (columns i0..i1 of every down row) into ys[slice]; the combine sums the slices. A
# task needs no other task's h, so there is no barrier. Generated per (up, down) mode: "f"
# f32 x / h (the formats' `dot`, x's and h's sums of 32), "i" their int8_b32 blocks (`idot`,
# as llama.cpp's q8 activations; x arrives rounded by a fake_quantize, h is rounded here);
# and twice: parallel, and on one thread (`_ser`: a small step).
_GEMV = """@njit({parallel}**_OPT)
def gemv_{mode}{sfx}(x, tok, experts, starts, gate, up, down, h, hq, hd, hs, ys, slices, tab):
    \"\"\"ys[p, s] = down[e][:, slice p] @ h[s, slice p], h[s] = inner(gate[e] @ x[t], up[e] @ x[t])
    for every pair s = (t, e) of each group (expert experts[g], pairs starts[g] ..); hq, hd,
    hs: h's int8 blocks, scales and sums (of 32) as the down pass reads them.\"\"\"
    ni, nh = h.shape[1], ys.shape[2]
{x_prep}
    step = ni // slices
    for task in {loop}(experts.shape[0] * slices):
        g, p = task // slices, task % slices
        e, s0, s1 = experts[g], starts[g], starts[g + 1]
        i0, i1 = step * p, step * (p + 1)
        c0, c1 = i0 // 32, i1 // 32
        wg, wu, wd = gate[e], up[e], down[e]
        for n in range(i0, i1):
            gate_{up_ahead}(wg, n + PF)
            up_{up_ahead}(wu, n + PF)
            for s in range(s0, s1):
                t = tok[s]
                h[s, n] = inner({gate_dot}, {up_dot})
        for s in range(s0, s1):
            {h_prep}
        for n in range(nh):
            down_{down_ahead}(wd, n + PF)
            r = down_span(wd[n], i0, i1)
            for s in range(s0, s1):
                ys[p, s, n] = {down_dot}


"""
_X_PREP = {
    "f": """    xs = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    for t in range(x.shape[0]):
        block_sums(x[t], xs[t])""",
    "i": """    xq, xd, xs = np.empty(x.shape, np.int8), np.empty((x.shape[0], x.shape[1] // 32), np.float32), np.empty(
        (x.shape[0], x.shape[1] // 32), np.float32)
    for t in range(x.shape[0]):
        quantize_x(x[t], xq[t], xd[t], xs[t])""",
}
_UP_DOT = {"f": "{w}_dot(w{c}[n], x[t], xs[t], tab)", "i": "{w}_idot(w{c}[n], xq[t], xd[t], xs[t], tab)"}
_H_PREP = {"f": "block_sums(h[s, i0:i1], hs[s, c0:c1])",
           "i": "quantize_x(h[s, i0:i1], hq[s, i0:i1], hd[s, c0:c1], hs[s, c0:c1])"}
_DOWN_DOT = {"f": "down_dot(r, h[s, i0:i1], hs[s, c0:c1], tab)",
             "i": "down_idot(r, hq[s, i0:i1], hd[s, c0:c1], hs[s, c0:c1], tab)"}


# The int8 GEMM form (prefill under `[precision] activations = "int8"`, every stack packed):
# one parallel region a step, as the GEMV's, over (group, slice of I) tasks taken one at a
# time (groups differ in size): each runs the formats' igemm (on the task's thread) for its
# slice of gate and up, the inner, h's rounding, and its slice of the down product.
_IGEMM_STEP = """
from rlx_backend_numba.moe import serial
from rlx_backend_numba.quant_kernels import quantize_rows as _quantize_rows
{matmuls}
quantize_rows = serial(_quantize_rows)

DSUB = {dsub}                # down's sub-block (h's sums)


@njit(parallel=True, **_OPT)
def igemm_step(gq, gd, gs, gi, uq, ud, us, ui, experts, starts, gate, up, down, h, c, hq, hq4, hd, hs, hi, ys,
               slices, tab):
    \"\"\"ys[p, s] = down[e][:, slice p] @ h[s, slice p] and h as gemv_ii's, the pairs' rows of x as
    int8 blocks (quant_kernels.quantize_rows: gq.. for gate's sub-blocks, uq.. for up's);
    c: up's products; hq (int8; hq4 its words), hd, hs, hi: h's blocks.\"\"\"
    step = h.shape[1] // slices
    for task in prange(experts.shape[0] * slices):
        g, p = task // slices, task % slices
        e, s0, s1 = experts[g], starts[g], starts[g + 1]
        i0, i1 = step * p, step * (p + 1)
        hv, cv = h[s0:s1, i0:i1], c[s0:s1, i0:i1]
        gate_mm(gq[s0:s1], gd[s0:s1], gs[s0:s1], gi[s0:s1], gate[e, i0:i1], 0, hv, tab)
        up_mm(uq[s0:s1], ud[s0:s1], us[s0:s1], ui[s0:s1], up[e, i0:i1], 0, cv, tab)
        for a in range(s1 - s0):
            for n in range(i1 - i0):
                hv[a, n] = inner(hv[a, n], cv[a, n])
        b0, b1 = i0 // DSUB, i1 // DSUB
        quantize_rows(hv, hq[s0:s1, i0:i1], hd[s0:s1, i0 // 32:i1 // 32], hs[s0:s1, b0:b1], hi[s0:s1, b0:b1])
        down_mm(hq4[s0:s1, i0 // 4:i1 // 4], hd[s0:s1, i0 // 32:i1 // 32], hs[s0:s1, b0:b1], hi[s0:s1, b0:b1],
                down[e], i0 // {delems} * {dbytes}, ys[p, s0:s1], tab)
"""

# Each stack's one-thread int8 GEMM in igemm_step: `{w}_mm(x4, xd, xs, xi, w, col, out, tab)`
# multiplies the rows of w from byte col (K = 4 x4.shape[1] columns); q4_k's through
# moe_igemm (its panels built at a quarter of the cost), the other formats' through their
# igemm's one-thread copy.
_MM = {
    "q4_k": """
from {q4k} import igemm_q4_k as {w}_mm
""",
    "": """
from {mod} import igemm as _{w}_igemm
_{w}_igemm_ser = serial(_{w}_igemm)


@njit(**_OPT)
def {w}_mm(x4, xd, xs, xi, w, col, out, tab):
    _{w}_igemm_ser(x4, xd, xs, xi, w[:, col:col + 4 * x4.shape[1] // {elems} * {nbytes}], out, tab, 1)
""",
}


def _mm_source(w: str, kind: str) -> str:
    """The generated `{w}_mm` of one stack of igemm_step (the modules it imports loaded here:
    load_source cannot be entered from a module it is importing)."""
    elems, nbytes = BLOCK[kind]
    if kind == "q4_k":
        return _MM["q4_k"].format(w=w, q4k=moe_igemm.module().__name__)
    return _MM[""].format(w=w, mod=quant_kernels.drivers(kind).__name__, elems=elems, nbytes=nbytes)


@functools.lru_cache(maxsize=None)
def serial(kernel):
    """A copy of the njit kernel (parallel=True) compiled for one thread, under its name +
    "_ser" (its own cache entry): igemm_step's tasks call the formats' igemm and quantize_rows
    on their own threads; the parallel kernels, called there, would each start a nested
    team of workers."""
    f = kernel.py_func
    name = f.__name__ + "_ser"
    g = types.FunctionType(f.__code__.replace(co_name=name, co_qualname=name), f.__globals__, name,
                           f.__defaults__, f.__closure__)
    g.__qualname__, g.__module__ = name, f.__module__
    return njit(**_OPT)(g)


def _gemv_source(up: str, down: str) -> str:
    """The GEMV step of one (up, down) mode, parallel and on one thread."""
    ahead = {"f": "ahead", "i": "iahead"}          # the int8 dots' prefetch (a q4_k idot asks as it reads)
    fill = dict(mode=up + down, x_prep=_X_PREP[up], gate_dot=_UP_DOT[up].format(w="gate", c="g"),
                up_dot=_UP_DOT[up].format(w="up", c="u"), h_prep=_H_PREP[down], down_dot=_DOWN_DOT[down],
                up_ahead=ahead[up], down_ahead=ahead[down])
    return "".join(_GEMV.format(parallel=par, sfx=sfx, loop=loop, **fill)
                   for par, sfx, loop in (("parallel=True, ", "", "prange"), ("", "_ser", "range")))


_KERNELS = """
import numpy as np
from numba import njit, prange
from rlx_backend_numba.cblas import sgemm
from rlx_backend_numba.moe import block_sums
from rlx_backend_numba.quant_kernels import quantize_x

_OPT = dict(cache=True, error_model="numpy", fastmath={{"reassoc", "contract"}})
PF = {ahead}
{imports}
{tiles}

@njit(**_OPT)
def inner(g, u):
    \"\"\"The gated MLP's hidden value: act(gate . x) * (up . x).\"\"\"
    return ({act}) * u


{gemvs}@njit(parallel=True, **_OPT)
def gemm_up(xg, experts, starts, gate, up, h, tab, tr, gbuf, ubuf, cbuf, bounds, gemm, ilp64):
    \"\"\"gemv_up for groups of many rows: part p runs tasks bounds[p] .., a task a group and a
    tile of tr rows of gate and up, packed ones decoded into gbuf[p] and ubuf[p], multiplied
    with the group's rows of xg (cblas_sgemm at `gemm`) into h and cbuf[p].\"\"\"
    ni = h.shape[1]
    tiles = (ni + tr - 1) // tr
    for p in prange(bounds.shape[0] - 1):
        for task in range(bounds[p], bounds[p + 1]):
            g, i = task // tiles, task % tiles
            e, s0, s1 = experts[g], starts[g], starts[g + 1]
            r0 = tr * i
            nr = min(tr, ni - r0)
            xs = xg[s0:s1]
            hv, c = h[s0:s1, r0:r0 + nr], cbuf[p, :s1 - s0, :nr]
            sgemm(gemm, ilp64, xs, gate_tile(gate[e], r0, nr, gbuf[p], tab), hv, False, True)
            sgemm(gemm, ilp64, xs, up_tile(up[e], r0, nr, ubuf[p], tab), c, False, True)
            for a in range(s1 - s0):
                for n in range(nr):
                    hv[a, n] = inner(hv[a, n], c[a, n])


@njit(parallel=True, **_OPT)
def inner_rows(h, c):
    \"\"\"h = inner(h, c) elementwise (gate's and up's products of a group, rows of h and c).\"\"\"
    for a in prange(h.shape[0]):
        for n in range(h.shape[1]):
            h[a, n] = inner(h[a, n], c[a, n])


@njit(parallel=True, **_OPT)
def gemm_down(h, experts, starts, down, ys, tab, tr, dbuf, bounds, gemm, ilp64):
    \"\"\"gemv_down for groups of many rows, as gemm_up: tiles of tr rows of down (into dbuf[p]).\"\"\"
    nh = ys.shape[1]
    tiles = (nh + tr - 1) // tr
    for p in prange(bounds.shape[0] - 1):
        for task in range(bounds[p], bounds[p + 1]):
            g, i = task // tiles, task % tiles
            e, s0, s1 = experts[g], starts[g], starts[g + 1]
            r0 = tr * i
            nr = min(tr, nh - r0)
            sgemm(gemm, ilp64, h[s0:s1], down_tile(down[e], r0, nr, dbuf[p], tab), ys[s0:s1, r0:r0 + nr],
                  False, True)
"""


def _kind(scheme: str) -> str:
    """A stack's format: "" (dense) or its quant kind."""
    return QuantScheme.parse(scheme).kind if scheme else ""


@functools.lru_cache(maxsize=None)
def kernels(kinds: tuple, act: str):
    """The generated module of one (gate, up, down) format triple ("" dense f32) and
    activation: the GEMV steps gemv_<up><down>[_ser] (up "f", and "i" where int8_up(kinds);
    down "f", and "i" where down is packed), gemm_up, gemm_down, inner_rows; igemm_step
    where every stack is packed."""
    imports, tiles = [], []
    for w, kind in zip(("gate", "up", "down"), kinds):
        how = "packed" if kind else "dense"
        mod = quant_kernels.drivers(kind).__name__ if kind else ""
        imports.append(_IMPORTS[how].format(mod=mod, w=w))
        tiles.append(_TILE[how].format(w=w))
    elems, nbytes = BLOCK[kinds[2]] if kinds[2] else (1, 1)
    tiles.append(_SPAN.format(w="down", elems=elems, nbytes=nbytes))
    gemvs = "".join(_gemv_source(u, d) for u in "fi"[:1 + int8_up(kinds)] for d in "fi"[:1 + bool(kinds[2])])
    src = _KERNELS.format(ahead=quant_kernels.AHEAD_ROWS, imports="".join(imports),
                          tiles="".join(tiles), act=re.sub(r"\bx\b", "g", ACT[act][F32]), gemvs=gemvs)
    if all(kinds):
        mms = "".join(_mm_source(w, k) for w, k in zip(("gate", "up", "down"), kinds))
        src += _IGEMM_STEP.format(dsub=quant_kernels.SUB.get(kinds[2], 32), delems=elems, dbytes=nbytes, matmuls=mms)
    return load_source(SWIGLU_HEAD + src)


def int8_up(kinds: tuple) -> bool:
    """The up pass can multiply int8 blocks of x: gate and up are both packed."""
    return bool(kinds[0] and kinds[1])


def _tile_rows(k: int) -> int:
    """Weight rows of a GEMM tile of K columns: TILE_FLOATS of them, 16 to 256 rows."""
    return max(16, min(256, TILE_FLOATS // max(k, 1) // 16 * 16))


def _scratch(kind: str, parts: int, rows: int, k: int) -> np.ndarray:
    """Decode scratch for a packed stack's tiles (a dense stack's tiles need none)."""
    return np.empty((parts, rows, k) if kind else (parts, 0, 0), np.float32)


def run_moe_experts(mod, kinds: tuple, x, weights, ids, gate, up, down, out, int8_x: bool = False,
                    int8_h: bool = False) -> None:
    """out = moe_experts(x, weights, ids, gate, up, down) through the module `mod` (kernels()),
    all f32 but the packed stacks (u8 rows of their formats) and the int ids. `int8_x` (only
    where int8_up(kinds)): x holds int8_b32-rounded values, and the up pass multiplies its
    int8 blocks with the packed integers; `int8_h` (only where down is packed): h is rounded
    through int8_b32 and the down pass multiplies its int8 blocks."""
    n_experts = gate.shape[0]
    x = np.ascontiguousarray(x)
    tok, wt, slot, experts, starts, bad = route(ids, n_experts, weights)
    if bad >= 0:
        t, j = divmod(int(bad), ids.shape[1])
        raise ModelError(f"moe_experts: expert id {int(ids[t, j])} of token {t} (slot {j}; tokens "
                         f"counted over x's leading dims) is outside "
                         f"[0, {n_experts}) (the {n_experts} experts of the gate/up/down stacks)")
    pairs, inter, hidden = tok.shape[0], gate.shape[1], down.shape[1]
    h = np.empty((pairs, inter), np.float32)
    gemm = pairs >= (GROUP_GEMM_INT8 if int8_x else GROUP_GEMM) * len(experts)
    if gemm and int8_x and int8_h:
        ys = _igemm_step(mod, kinds, x, tok, experts, starts, gate, up, down, h)
    elif SGEMM is None or not gemm:
        ys = _gemv(mod, kinds, x, tok, experts, starts, gate, up, down, h, int8_x, int8_h)
    else:
        ys = np.empty((1, pairs, hidden), np.float32)
        _gemms(mod, kinds, x, tok, experts, starts, gate, up, down, h, ys[0], int8_x, int8_h)
    (combine_par if ys.size >= PAR_MIN else combine_ser)(ys, slot, wt, out)


def _gemv(mod, kinds, x, tok, experts, starts, gate, up, down, h, int8_x: bool, int8_h: bool) -> np.ndarray:
    """The GEMV step (one parallel region, or one thread where small): ys [slices, pairs, H],
    the down products of each slice of the expert width."""
    pairs, inter, hidden = h.shape[0], h.shape[1], down.shape[1]
    par = pairs * inter * hidden >= GEMV_PAR_MIN
    slices = gemv_slices(len(experts), numba.get_num_threads() if par else 1, inter, kinds[2])
    ys = np.empty((slices, pairs, hidden), np.float32)
    hq = np.empty((pairs, inter) if int8_h else (0, 0), np.int8)
    hd, hs = np.empty((pairs if int8_h else 0, inter // 32), np.float32), np.empty((pairs, inter // 32), np.float32)
    step = getattr(mod, f"gemv_{'i' if int8_x else 'f'}{'i' if int8_h else 'f'}{'' if par else '_ser'}")
    step(x, tok, experts, starts, gate, up, down, h, hq, hd, hs, ys, slices, F16)
    return ys


def _igemm_step(mod, kinds, x, tok, experts, starts, gate, up, down, h) -> np.ndarray:
    """The int8 GEMM step (x and h as int8 blocks, every stack packed): ys [slices, pairs, H]."""
    pairs, inter, hidden = h.shape[0], h.shape[1], down.shape[1]
    xg = np.empty((pairs, x.shape[1]), np.float32)
    gather_rows(x, tok, xg)
    blocks = _int8_blocks(xg, kinds[:2])
    dsub = quant_kernels.SUB.get(kinds[2], 32)
    hq = np.empty((pairs, inter), np.int8)
    hd, hs, hi = (np.empty((pairs, inter // 32), np.float32), np.empty((pairs, inter // dsub), np.float32),
                  np.empty((pairs, inter // dsub), np.int32))
    slices = gemv_slices(len(experts), numba.get_num_threads(), inter, kinds[2])
    ys = np.empty((slices, pairs, hidden), np.float32)
    chunk = numba.set_parallel_chunksize(1)         # tasks taken one at a time: groups differ in size
    try:
        mod.igemm_step(*blocks[quant_kernels.SUB.get(kinds[0], 32)], *blocks[quant_kernels.SUB.get(kinds[1], 32)],
                       experts, starts, gate, up, down, h, np.empty_like(h), hq, hq.view(np.int32), hd, hs, hi, ys,
                       slices, F16)
    finally:
        numba.set_parallel_chunksize(chunk)
    return ys


def gemv_slices(groups: int, threads: int, inter: int, down_kind: str) -> int:
    """Slices of the expert width I the GEMV's tasks split each group into: the count (a
    divisor of I's blocks of down's format, or of 32) whose (group, slice) tasks keep the
    busiest thread shortest (in groups' work; the fewest slices on a tie: each slice reads
    every down row again, in shorter runs)."""
    block = BLOCK[down_kind][0] if down_kind else 32
    most = inter // block if inter % block == 0 else 1
    return min((p for p in range(1, most + 1) if most % p == 0), key=lambda p: (-(-groups * p // threads) / p, p))


def _gemms(mod, kinds, x, tok, experts, starts, gate, up, down, h, ys, int8_x: bool = False,
           int8_h: bool = False) -> None:
    """The up and down passes as tiles of decoded weight rows times each group's rows (BLAS);
    `int8_x` / `int8_h`: that pass as each group's int8 GEMMs (_igemm_groups)."""
    xg = np.empty((tok.shape[0], x.shape[1]), np.float32)
    gather_rows(x, tok, xg)
    threads = numba.get_num_threads()
    with single_threaded_blas():
        if int8_x:
            c = np.empty_like(h)
            blocks = _int8_blocks(xg, kinds[:2])
            _igemm_groups(kinds[0], blocks, gate, experts, starts, h)
            _igemm_groups(kinds[1], blocks, up, experts, starts, c)
            mod.inner_rows(h, c)
        else:
            tu = _tile_rows(x.shape[1])
            pu = max(1, min(threads, len(experts) * -(-h.shape[1] // tu)))
            bu = split_tasks(starts, -(-h.shape[1] // tu), pu)
            group_max = int(np.diff(starts).max())
            mod.gemm_up(xg, experts, starts, gate, up, h, F16, tu, _scratch(kinds[0], pu, tu, x.shape[1]),
                        _scratch(kinds[1], pu, tu, x.shape[1]), np.empty((pu, group_max, tu), np.float32),
                        bu, *SGEMM)
        if int8_h:
            _igemm_groups(kinds[2], _int8_blocks(h, kinds[2:]), down, experts, starts, ys)
        else:
            td = _tile_rows(h.shape[1])
            pd = max(1, min(threads, len(experts) * -(-ys.shape[1] // td)))
            bd = split_tasks(starts, -(-ys.shape[1] // td), pd)
            mod.gemm_down(h, experts, starts, down, ys, F16, td, _scratch(kinds[2], pd, td, h.shape[1]), bd, *SGEMM)


def _int8_blocks(rows: np.ndarray, kinds) -> dict:
    """rows rounded to int8_b32 blocks as the formats' igemm reads them (quantize_rows): sub-block
    size (32, or q6_k's 16) -> (values as words of four, block scales, sub-block scale * sums, sums)."""
    out = {}
    m, k = rows.shape
    for sub in dict.fromkeys(quant_kernels.SUB.get(kind, 32) for kind in kinds):
        xq = np.empty((m, k), np.int8)
        xd, xs, xi = np.empty((m, k // 32), np.float32), np.empty((m, k // sub), np.float32), np.empty((m, k // sub), np.int32)
        quant_kernels.quantize_rows(rows, xq, xd, xs, xi)
        out[sub] = (xq.view(np.int32), xd, xs, xi)
    return out


def _igemm_groups(kind: str, blocks: dict, stack, experts, starts, dst) -> None:
    """dst[s0:s1] = rows s0:s1 @ stack[e]^T for each group (expert e, rows s0:s1), the rows as
    int8 blocks (_int8_blocks): the format's igemm, its threads over panels of the expert's rows."""
    x4, xd, xs, xi = blocks[quant_kernels.SUB.get(kind, 32)]
    igemm = quant_kernels.drivers(kind).igemm
    parts = max(1, min(numba.get_num_threads(), -(-dst.shape[1] // quant_kernels.IGEMM_COLS)))
    for g in range(len(experts)):
        s0, s1 = starts[g], starts[g + 1]
        igemm(x4[s0:s1], xd[s0:s1], xs[s0:s1], xi[s0:s1], stack[experts[g]], dst[s0:s1], F16, parts)


def _format_of(dtype, ndim: int, scheme: str) -> str | None:
    """The kernel format of a stack of this dtype, rank and scheme, or None (no kernel here)."""
    if ndim != 3:
        return None
    if not scheme:
        return "" if dtype == np.float32 else None
    kind = _kind(scheme)
    return kind if kind in FORMATS and dtype == np.uint8 else None


def _step_kinds(dtypes: tuple, x_rank: int, o_size: int, ids_int: bool, stacks: list, schemes,
                int8_h) -> tuple | None:
    """The stacks' kernel formats where a step here runs moe_experts: f32 x, weights and output
    (`dtypes`), x of rank >= 2, integer ids, a format for every stack ((dtype, rank) each), and
    down packed where h is rounded (a dense down leaves that rounding to the NumPy kernel);
    else None. One test for the step (prepare_moe_experts, on arrays) and the plan
    (rounds_x_itself, on the graph's shapes)."""
    if x_rank < 2 or any(d != np.float32 for d in dtypes) or o_size == 0 or not ids_int:
        return None
    kinds = tuple(_format_of(dt, rank, s) for (dt, rank), s in zip(stacks, schemes))
    return None if None in kinds or (int8_h and not kinds[2]) else kinds


def rounds_x_itself(g, node) -> bool:
    """The step prepare_moe_experts builds for `moe_experts` node `node` of the static graph g
    rounds x through int8_b32 itself when x comes from such a rounding (every form quantizes
    x's rows: quantize_x in the GEMV, quantize_rows in the GEMMs), so that fake_quantize is
    redundant (quant_kernels.redundant_roundings). The stacks' layout is checked again when
    the step is made."""
    x, weights, ids, *stacks = (g.shape_of(r) for r in node.inputs)
    o = node.outs[0]
    kinds = _step_kinds((x.dtype.np, weights.dtype.np, o.dtype.np), x.rank, o.nbytes(), ids.dtype.is_int,
                        [(w.dtype.np, w.rank) for w in stacks], node.a["schemes"], node.a["int8_h"])
    return kinds is not None and int8_up(kinds)


def prepare_moe_experts(a, outs, protos, op=None):
    """A runner step for `moe_experts` over f32 x [..., H] with dense f32 or packed stacks (a
    format of quant_kernels), or None (the NumPy backend's kernel runs it). `a["int8_x"]` (set
    by the runner where x comes from a fake_quantize to int8_b32): the up pass multiplies x's
    int8 blocks, where gate and up are packed; `a["int8_h"]` (the op's): h is rounded and the
    down pass multiplies its int8 blocks, where down is packed."""
    x, weights, ids, *stacks = protos
    o = outs[0]
    if not (o.flags.c_contiguous and all(w.flags.c_contiguous for w in stacks)):
        return None
    kinds = _step_kinds((x.dtype, weights.dtype, o.dtype), x.ndim, o.size, ids.dtype.kind in "iu",
                        [(w.dtype, w.ndim) for w in stacks], a["schemes"], a["int8_h"])
    if kinds is None:
        return None
    mod = kernels(kinds, a["act"])
    hidden, k = x.shape[-1], ids.shape[-1]
    out = o.reshape(-1, hidden)
    int8_x = bool(a.get("int8_x")) and int8_up(kinds)
    int8_h = bool(a["int8_h"])

    def step(a_, o_, x, weights, ids, gate, up, down):        # tokens: every leading dim
        run_moe_experts(mod, kinds, x.reshape(-1, hidden), weights.reshape(-1, k), ids.reshape(-1, k),
                        gate, up, down, out, int8_x, int8_h)
    step.rounds_x = int8_x        # x's int8 blocks made here: the fake_quantize before is redundant
    return step


__all__ = ["GROUP_GEMM", "GROUP_GEMM_INT8", "gemv_slices", "kernels", "prepare_moe_experts",
           "prepare_moe_route", "rounds_x_itself", "route", "route_rows", "run_moe_experts"]
