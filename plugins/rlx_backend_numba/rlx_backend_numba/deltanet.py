"""numba kernels for the linear-attention ops of rlx_core.ir.deltanet: gated_delta_rule and
causal_conv1d (runner.PREPARE binds them to their nodes).

gated_delta_rule runs one task per (batch row, value head) on numba's threads; a task updates
its head's block [K, V] of the new state from the first step to the last. Up to RECURRENT_MAX
steps (decode, a few draft tokens) it takes the recurrent form, a read-only pass and a
writing pass over the state a step, the first step reading the start state's block (the new
state may be the start state itself: decode in place); longer inputs take the chunked (WY / UT)
form of the NumPy kernel (rlx_core.ir.deltanet: the formulas are written there), one chunk
after another: five dense products a chunk (f32: one cblas_sgemm call each, made by numba's
threads as in cblas.py; else loops), the decays, the forward substitution and the sums
between them in loops. f16 and bf16 compute in f32 (inputs widened, outputs rounded once),
f32 in f32, f64 in f64.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from rlx_core.backends.numpy.blas import single_threaded_blas
from rlx_core.ir.numpy_kernels import put

from .cblas import SGEMM, sgemm
from .codegen import PAR_MIN, epilogue_step

_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
RECURRENT_MAX = 4          # steps up to which a call runs the recurrence step by step
NATIVE = (np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------- gated_delta_rule
@njit(**_OPT)
def _steps(q, k, v, g, beta, s0, s, o, b, h, kh, scale):
    """The recurrence step by step (decode), from s0 into s (which may be s0 itself: a row is
    read before it is written): S' = a S + k u^T with u = beta (v - a S^T k), and
    o = S'^T q = a S^T q + (q . k) u. One read-only pass gives S^T k and S^T q, one pass
    writes S'; the first step reads s0, so the start state is never copied."""
    kd, vd = s.shape
    kv = np.empty(vd, s.dtype)
    qv = np.empty(vd, s.dtype)
    u = np.empty(vd, s.dtype)
    src = s0
    for t in range(q.shape[1]):
        a, bt = math.exp(g[b, t, h]), beta[b, t, h]
        kt, qt, vt, ot = k[b, t, kh], q[b, t, kh], v[b, t, h], o[b, t, h]
        kv[:] = 0
        qv[:] = 0
        qk = kt[0] * 0
        for i in range(kd):
            row, ki, qi = src[i], kt[i], qt[i] * scale
            qk += qi * ki
            for j in range(vd):
                kv[j] += ki * row[j]
                qv[j] += qi * row[j]
        for j in range(vd):
            u[j] = bt * (vt[j] - a * kv[j])
            ot[j] = a * qv[j] + qk * u[j]
        for i in range(kd):
            row, out, ki = src[i], s[i], kt[i]
            for j in range(vd):
                out[j] = a * row[j] + ki * u[j]
        src = s


@njit(**_OPT)
def _mm_loops(a, b, c, ta, tb):
    """c = op(a) @ op(b) in loops (not both transposed): the innermost loop runs along a row
    of b and c, or along rows of a and b for a dot product (tb)."""
    m, n = c.shape
    depth = a.shape[0] if ta else a.shape[1]
    if tb:
        for i in range(m):
            ai = a[i]
            for j in range(n):
                bj = b[j]
                acc = ai[0] * 0
                for r in range(depth):
                    acc += ai[r] * bj[r]
                c[i, j] = acc
        return
    c[:, :] = 0
    for r in range(depth):
        br = b[r]
        for i in range(m):
            x, ci = (a[r, i] if ta else a[i, r]), c[i]
            for j in range(n):
                ci[j] += x * br[j]


def _product(gemm, ilp64, a, b, c, ta, tb):
    """c = op(a) @ op(b): one cblas_sgemm call for f32 where `gemm` (its address) is not 0,
    else _mm_loops."""


@overload(_product, inline="always", jit_options=_OPT)
def _ov_product(gemm, ilp64, a, b, c, ta, tb):
    if c.dtype != types.float32:           # (sgemm types only for float32)
        return lambda gemm, ilp64, a, b, c, ta, tb: _mm_loops(a, b, c, ta, tb)

    def f32(gemm, ilp64, a, b, c, ta, tb):
        if gemm != 0:
            sgemm(gemm, ilp64, a, b, c, ta, tb)
        else:
            _mm_loops(a, b, c, ta, tb)
    return f32


@njit(**_OPT)
def _chunk(q, k, v, g, beta, s, o, b, h, kh, scale, t0, n, scratch, gemm, ilp64):
    """Steps [t0, t0 + n) in the chunked form (rlx_core.ir.deltanet's formulas), from state
    s, which it leaves as the state after the chunk; the products are _product calls.
    scratch: the task's (_scratch)."""
    kq, sq, ap, t, r, u, ds, cum = scratch
    kd, vd = s.shape
    acc = scale * 0
    for i in range(n):
        acc += g[b, t0 + i, h]
        cum[i] = acc
        ki, qi, kr, qr = k[b, t0 + i, kh], q[b, t0 + i, kh], kq[i], kq[n + i]
        for j in range(kd):                                 # rows [0, n): keys, [n, 2n): scaled queries
            kr[j] = ki[j]
            qr[j] = qi[j] * scale
    both, keys = kq[:2 * n], kq[:n]
    _product(gemm, ilp64, both, s, sq[:2 * n], False, False)          # [K S0; Q S0]
    _product(gemm, ilp64, both, keys, ap[:2 * n, :n], False, True)    # [K K^T; Q K^T]
    # (I + A)^-1, A_ij = beta_i (k_i . k_j) exp(cum_i - cum_j) for j < i: forward substitution
    for i in range(n):
        bi, ti = beta[b, t0 + i, h], t[i]
        ti[:n] = 0
        ti[i] = 1
        for m in range(i):
            c, tm = bi * ap[i, m] * math.exp(cum[i] - cum[m]), t[m]
            for j in range(m + 1):
                ti[j] -= c * tm[j]
    # U = (I + A)^-1 R, R = beta (V - gamma K S0)
    for i in range(n):
        bi, gi, vi, ri, ks = beta[b, t0 + i, h], math.exp(cum[i]), v[b, t0 + i, h], r[i], sq[i]
        for j in range(vd):
            ri[j] = bi * (vi[j] - gi * ks[j])
    _product(gemm, ilp64, t[:n, :n], r[:n], u[:n], False, False)
    # o_i = gamma_i S0^T (scale q_i) + sum_{j <= i} (scale q_i . k_j) exp(cum_i - cum_j) u_j
    for i in range(n):
        pi = ap[n + i]
        for m in range(n):
            pi[m] = pi[m] * math.exp(cum[i] - cum[m]) if m <= i else pi[m] * 0
    pu = r                                                   # (R is spent)
    _product(gemm, ilp64, ap[n:2 * n, :n], u[:n], pu[:n], False, False)
    for i in range(n):
        gi, oi, qs, pi = math.exp(cum[i]), o[b, t0 + i, h], sq[n + i], pu[i]
        for j in range(vd):
            oi[j] = gi * qs[j] + pi[j]
    # S = gamma_n S0 + sum_i exp(cum_n - cum_i) k_i u_i^T (the key rows scaled in place)
    last = cum[n - 1]
    for i in range(n):
        d, ki = math.exp(last - cum[i]), kq[i]
        for j in range(kd):
            ki[j] *= d
    _product(gemm, ilp64, keys, u[:n], ds, True, False)
    gn = math.exp(last)
    for rr in range(kd):
        row, dr = s[rr], ds[rr]
        for j in range(vd):
            row[j] = gn * row[j] + dr[j]


@njit(**_OPT)
def _scratch(c, kd, vd, dt):
    """A task's scratch for chunks of up to c steps: kq [2c, K], sq [2c, V], ap [2c, c],
    t [c, c], r, u [c, V], ds [K, V], cum [c]."""
    return (np.empty((2 * c, kd), dt), np.empty((2 * c, vd), dt), np.empty((2 * c, c), dt),
            np.empty((c, c), dt), np.empty((c, vd), dt), np.empty((c, vd), dt), np.empty((kd, vd), dt),
            np.empty(c, dt))


@njit(**_OPT)
def _head(task, q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent, gemm, ilp64):
    """One (batch row, value head): its state through every step, kept in s1 (its
    [K, V] block, contiguous): the recurrent form writes it from s0's block (s1 may be s0:
    decode in place), the chunked one copies s0's block in first."""
    nh, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    b, h = task // nh, task % nh
    kh = h // (nh // q.shape[2])
    s = s1[b, h]
    if recurrent:
        _steps(q, k, v, g, beta, s0[b, h], s, o, b, h, kh, scale)
    else:
        s[:, :] = s0[b, h]
        c = min(chunk, q.shape[1])
        scratch = _scratch(c, kd, vd, s.dtype)
        for t0 in range(0, q.shape[1], c):
            _chunk(q, k, v, g, beta, s, o, b, h, kh, scale, t0, min(c, q.shape[1] - t0), scratch, gemm, ilp64)


@njit(parallel=True, **_OPT)
def gdn_par(q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent, gemm, ilp64):
    for task in prange(v.shape[0] * v.shape[2]):
        _head(task, q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent, gemm, ilp64)


@njit(**_OPT)
def gdn_ser(q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent, gemm, ilp64):
    for task in range(v.shape[0] * v.shape[2]):
        _head(task, q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent, gemm, ilp64)


def _compute_dtype(x: np.ndarray) -> np.dtype:
    return x.dtype if x.dtype in NATIVE else np.dtype(np.float32)


def _operand(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """x as a C-contiguous array of dt (a copy only where it is not one already)."""
    return np.ascontiguousarray(x, dt)


def _target(out: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Where a kernel writes `out`: out itself when it is contiguous dt, else scratch put after."""
    return out if out.dtype == dt and out.flags.c_contiguous else np.empty(out.shape, dt)


def prepare_gated_delta_rule(a, outs, protos, op=None):
    """A runner step for gated_delta_rule: the recurrent form up to RECURRENT_MAX steps, the
    chunked form (chunk = the node's attr) past it; all threads when the work is large."""
    q, v = protos[0], protos[2]
    dt = _compute_dtype(q)
    nb, t, nh, vd = v.shape
    kd = q.shape[3]
    if nb * nh == 0 or t == 0 or kd == 0 or vd == 0:
        return None                       # nothing to run: the NumPy kernel's empty writes
    kern = gdn_par if nb * nh * t * kd * vd >= PAR_MIN and nb * nh > 1 else gdn_ser
    scale, chunk, recurrent = dt.type(a["scale"]), int(a["chunk"]), t <= RECURRENT_MAX
    gemm = SGEMM if SGEMM is not None and dt == np.float32 and not recurrent else (0, False)
    one_blas_thread = single_threaded_blas if gemm[0] else contextlib.nullcontext
    in_place = bool(a.get("in_place"))       # (the runner's: see prepare_causal_conv1d)

    def step(a_, out, q, k, v, g, beta, state):
        o = _target(out[0], dt)
        s1 = state if in_place and state.dtype == dt and state.flags.c_contiguous else _target(out[1], dt)
        with one_blas_thread():                      # (numba's threads make the BLAS calls)
            kern(*(_operand(x, dt) for x in (q, k, v, g, beta, state)), o, s1, scale, chunk, recurrent, *gemm)
        for dst, src in zip((out[0], state if in_place else out[1]), (o, s1)):
            if dst is not src:
                put(dst, src)
    return step


# --------------------------------------------------------------------------- causal_conv1d
@njit(**_OPT)
def _conv_rows(task, x, wt, st, bias, y, per):
    """Rows [t0, t0 + per) of batch row b (task = b * blocks + block): y[t] = bias + sum_i
    wt[i] * u[t + i], u the state's W - 1 steps (st [B, W - 1, C]) then x; wt [W, C]."""
    nt, width = x.shape[1], wt.shape[0]
    blocks = (nt + per - 1) // per
    b, t0 = task // blocks, (task % blocks) * per
    for t in range(t0, min(nt, t0 + per)):
        yr = y[b, t]
        yr[:] = bias
        for i in range(width):
            src = t + i - (width - 1)
            ur = x[b, src] if src >= 0 else st[b, src + width - 1]
            wr = wt[i]
            for c in range(yr.shape[0]):
                yr[c] += wr[c] * ur[c]


@njit(parallel=True, **_OPT)
def conv_par(x, wt, st, bias, y, per):
    for task in prange(x.shape[0] * ((x.shape[1] + per - 1) // per)):
        _conv_rows(task, x, wt, st, bias, y, per)


@njit(**_OPT)
def conv_ser(x, wt, st, bias, y, per):
    for task in range(x.shape[0] * ((x.shape[1] + per - 1) // per)):
        _conv_rows(task, x, wt, st, bias, y, per)


def _next_state(x: np.ndarray, st: np.ndarray, out: np.ndarray) -> None:
    """out [B, C, W - 1] <- the last W - 1 steps of (the state's steps, then x): x [B, T, C],
    st [B, W - 1, C] (a copy, so out may be the state the call read)."""
    keep = out.shape[2]
    t = x.shape[1]
    if t >= keep:
        put(out, x[:, t - keep:].transpose(0, 2, 1))
    else:
        put(out[:, :, :keep - t], st[:, t:].transpose(0, 2, 1))
        put(out[:, :, keep - t:], x.transpose(0, 2, 1))


@njit(**_OPT)
def conv_steps(x, w, st, bias, y, new_st):
    """A few steps (decode) on the operands as the op gives them: x [B, T, C], w [C, W],
    state st [B, C, W - 1]; y[b, t, c] = bias[c] + sum_i w[c, i] u[t + i] (u: the state's
    steps, then x) one tap at a time over all channels, then new_st the last W - 1 steps
    of u (it may be st itself: y has read st, and each step moves down). No copies or
    transposes: at one token these cost more than the taps (77 -> 15 us a layer of 6144
    channels)."""
    nb, nt, ch = x.shape
    keep = w.shape[1] - 1
    for b in range(nb):
        for t in range(nt):
            yr = y[b, t]
            yr[:] = bias
            for i in range(keep + 1):
                src = t + i - keep
                if src >= 0:
                    xr = x[b, src]
                    for c in range(ch):
                        yr[c] += w[c, i] * xr[c]
                else:
                    sb = st[b]
                    for c in range(ch):
                        yr[c] += w[c, i] * sb[c, src + keep]
        sb, nbs = st[b], new_st[b]
        for i in range(keep):
            j = i + nt
            if j < keep:
                for c in range(ch):
                    nbs[c, i] = sb[c, j]
            else:
                xr = x[b, j - keep]
                for c in range(ch):
                    nbs[c, i] = xr[c]


def prepare_causal_conv1d(a, outs, protos, op=None):
    """A runner step for causal_conv1d: up to RECURRENT_MAX steps one compiled call on the
    operands in place (conv_steps; `a["in_place"]`, set by the runner where the new state is
    only assigned back to the state it read: written there); longer inputs the taps and bias
    in a numba kernel over blocks of rows, the activation as the generated epilogue (any
    table activation); None where the epilogue cannot be generated (the NumPy kernel)."""
    x, w = protos[0], protos[1]
    dt = _compute_dtype(x)
    nb, t, ch = x.shape
    y = _target(outs[0], dt)
    epi = epilogue_step(y, [], a["act"])
    if epi is None or y.size == 0:
        return None
    in_place = bool(a.get("in_place"))
    if t <= RECURRENT_MAX and all(p.dtype == dt for p in protos) and outs[1].dtype == dt:
        zero = np.zeros(ch, dt)

        def steps(a_, out, x, w, state, bias=None):
            conv_steps(x, w, state, zero if bias is None else bias, y, state if in_place else out[1])
            epi()
            if y is not out[0]:
                put(out[0], y)
        return steps
    per = max(1, min(t, PAR_MIN // max(ch * w.shape[1], 1)))        # rows a task
    kern = conv_par if nb * t * ch * w.shape[1] >= PAR_MIN and nb * -(-t // per) > 1 else conv_ser

    def step(a_, out, x, w, state, bias=None):
        xs, st = _operand(x, dt), np.array(state.transpose(0, 2, 1), dt)     # st [B, W - 1, C]: a copy
        b = np.zeros(ch, dt) if bias is None else _operand(bias, dt)
        kern(xs, _operand(w.T, dt), st, b, y, per)
        epi()
        if y is not out[0]:
            put(out[0], y)
        _next_state(xs, st, state if in_place else out[1])
    return step


__all__ = ["RECURRENT_MAX", "conv_par", "conv_steps", "conv_ser", "gdn_par", "gdn_ser", "prepare_causal_conv1d",
           "prepare_gated_delta_rule"]
