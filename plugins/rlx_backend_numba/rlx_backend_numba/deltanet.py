"""numba kernels for the linear-attention ops of rlx_core.ir.deltanet: gated_delta_rule and
causal_conv1d (runner.PREPARE binds them to their nodes).

gated_delta_rule runs one task per (batch row, value head) on numba's threads; a task keeps
its head's state [K, V] in a local array from the first step to the last and writes it out
once. Up to RECURRENT_MAX steps (decode, a few draft tokens) it takes the recurrent form, two
passes over the state a step; longer inputs take the chunked (WY / UT) form of the NumPy
kernel (rlx_core.ir.deltanet: the formulas are written there), one chunk after another, each
as small dense products whose innermost loop runs along a contiguous row of V (or K) values,
so the state's row stays in L1 while the chunk's rows stream past it. f16 and bf16 compute
in f32 (inputs widened, outputs rounded once), f32 in f32, f64 in f64.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from rlx_core.ir.numpy_kernels import put

from .codegen import PAR_MIN, epilogue_step

_OPT = dict(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
RECURRENT_MAX = 4          # steps up to which a call runs the recurrence step by step
NATIVE = (np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------- gated_delta_rule
@njit(**_OPT)
def _steps(q, k, v, g, beta, s, o, b, h, kh, scale):
    """The recurrence step by step (decode): S <- exp(g) S, u = beta (v - S^T k),
    S <- S + k u^T, o = S^T (scale q): one pass to decay and read S^T k, one to write and read."""
    kd, vd = s.shape
    kv = np.empty(vd, s.dtype)
    u = np.empty(vd, s.dtype)
    for t in range(q.shape[1]):
        a, bt = math.exp(g[b, t, h]), beta[b, t, h]
        kt, qt, vt, ot = k[b, t, kh], q[b, t, kh], v[b, t, h], o[b, t, h]
        kv[:] = 0
        for i in range(kd):
            row, ki = s[i], kt[i]
            for j in range(vd):
                row[j] *= a
                kv[j] += ki * row[j]
        for j in range(vd):
            u[j] = bt * (vt[j] - kv[j])
            ot[j] = 0
        for i in range(kd):
            row, ki, qi = s[i], kt[i], qt[i] * scale
            for j in range(vd):
                row[j] += ki * u[j]
                ot[j] += qi * row[j]


@njit(**_OPT)
def _dot(x, y):
    acc = x[0] * 0
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    return acc


@njit(**_OPT)
def _chunk(q, k, v, g, beta, s, o, b, h, kh, scale, t0, n, ks, qs, u, a, p, cum):
    """Steps [t0, t0 + n) in the chunked form (rlx_core.ir.deltanet's formulas), from state
    s, which it leaves as the state after the chunk. ks, qs, u [chunk, V], a, p
    [chunk, chunk], cum [chunk]: the task's scratch."""
    kd, vd = s.shape
    acc = scale * 0
    for i in range(n):
        acc += g[b, t0 + i, h]
        cum[i] = acc
    # K S0 and Q S0, one row of the state at a time
    ks[:n] = 0
    qs[:n] = 0
    for r in range(kd):
        row = s[r]
        for i in range(n):
            ki, qi = k[b, t0 + i, kh, r], q[b, t0 + i, kh, r]
            kr, qr = ks[i], qs[i]
            for j in range(vd):
                kr[j] += ki * row[j]
                qr[j] += qi * row[j]
    # the strictly lower system A and the causal scores P (diagonal included), decays applied
    for i in range(n):
        ki, qi = k[b, t0 + i, kh], q[b, t0 + i, kh]
        bi = beta[b, t0 + i, h]
        for j in range(i + 1):
            d = math.exp(cum[i] - cum[j])
            kj = k[b, t0 + j, kh]
            p[i, j] = scale * d * _dot(qi, kj)
            if j < i:
                a[i, j] = bi * d * _dot(ki, kj)
    # U = (I + A)^-1 beta (V - gamma K S0), row by row
    for i in range(n):
        bi, gi, vi, ui = beta[b, t0 + i, h], math.exp(cum[i]), v[b, t0 + i, h], u[i]
        kr = ks[i]
        for j in range(vd):
            ui[j] = bi * (vi[j] - gi * kr[j])
        for m in range(i):
            c, um = a[i, m], u[m]
            for j in range(vd):
                ui[j] -= c * um[j]
    # o_i = scale gamma_i S0^T q_i + sum_{j <= i} P_ij u_j
    for i in range(n):
        gi, oi, qr = scale * math.exp(cum[i]), o[b, t0 + i, h], qs[i]
        for j in range(vd):
            oi[j] = gi * qr[j]
        for m in range(i + 1):
            c, um = p[i, m], u[m]
            for j in range(vd):
                oi[j] += c * um[j]
    # S = gamma_n S0 + sum_i (gamma_n / gamma_i) k_i u_i^T, one row of the state at a time
    last = cum[n - 1]
    gn = math.exp(last)
    for i in range(n):
        cum[i] = math.exp(last - cum[i])
    for r in range(kd):
        row = s[r]
        for j in range(vd):
            row[j] *= gn
        for i in range(n):
            c, ui = cum[i] * k[b, t0 + i, kh, r], u[i]
            for j in range(vd):
                row[j] += c * ui[j]


@njit(**_OPT)
def _head(task, q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent):
    """One (batch row, value head): its state through every step, written to s1."""
    nh, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    b, h = task // nh, task % nh
    kh = h // (nh // q.shape[2])
    s = s0[b, h].copy()
    if recurrent:
        _steps(q, k, v, g, beta, s, o, b, h, kh, scale)
    else:
        c = min(chunk, q.shape[1])
        ks, qs, u = np.empty((c, vd), s.dtype), np.empty((c, vd), s.dtype), np.empty((c, vd), s.dtype)
        a, p, cum = np.empty((c, c), s.dtype), np.empty((c, c), s.dtype), np.empty(c, s.dtype)
        for t0 in range(0, q.shape[1], c):
            _chunk(q, k, v, g, beta, s, o, b, h, kh, scale, t0, min(c, q.shape[1] - t0), ks, qs, u, a, p, cum)
    s1[b, h] = s


@njit(parallel=True, **_OPT)
def gdn_par(q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent):
    for task in prange(v.shape[0] * v.shape[2]):
        _head(task, q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent)


@njit(**_OPT)
def gdn_ser(q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent):
    for task in range(v.shape[0] * v.shape[2]):
        _head(task, q, k, v, g, beta, s0, o, s1, scale, chunk, recurrent)


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

    def step(a_, out, q, k, v, g, beta, state):
        o, s1 = _target(out[0], dt), _target(out[1], dt)
        kern(*(_operand(x, dt) for x in (q, k, v, g, beta, state)), o, s1, scale, chunk, recurrent)
        for dst, src in zip(out, (o, s1)):
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


def prepare_causal_conv1d(a, outs, protos, op=None):
    """A runner step for causal_conv1d: the taps and bias in a numba kernel over blocks of
    rows, the activation as the generated epilogue (any table activation); None where the
    epilogue cannot be generated for the output (the step keeps the NumPy kernel)."""
    x, w = protos[0], protos[1]
    dt = _compute_dtype(x)
    nb, t, ch = x.shape
    y = _target(outs[0], dt)
    epi = epilogue_step(y, [], a["act"])
    if epi is None or y.size == 0:
        return None
    per = max(1, min(t, PAR_MIN // max(ch * w.shape[1], 1)))        # rows a task
    kern = conv_par if nb * t * ch * w.shape[1] >= PAR_MIN and nb * -(-t // per) > 1 else conv_ser

    def step(a_, out, x, w, state, bias=None):
        xs, st = _operand(x, dt), _operand(state.transpose(0, 2, 1), dt)     # st [B, W - 1, C]
        b = np.zeros(ch, dt) if bias is None else _operand(bias, dt)
        kern(xs, _operand(w.T, dt), st, b, y, per)
        epi()
        if y is not out[0]:
            put(out[0], y)
        _next_state(xs, st, out[1])
    return step


__all__ = ["RECURRENT_MAX", "conv_par", "conv_ser", "gdn_par", "gdn_ser", "prepare_causal_conv1d",
           "prepare_gated_delta_rule"]
