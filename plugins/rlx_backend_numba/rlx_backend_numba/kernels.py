"""Hand-written numba kernels: the row-wise ops (norms, softmax, RoPE), attention and the
small-M GEMV — what needs loops over a row or a reduction rather than one expression.

Each kernel is a per-row function plus two drivers: `*_par` (prange over rows, for large
work) and `*_ser` (one thread; a decode step's rows are too small to pay for a parallel
launch). Scalars arrive typed in the array dtype (`zero`, `eps`, ...) so f32 rows accumulate
in f32 and f64 rows in f64. Reductions may reassociate (`reassoc`, `contract`: vectorized
sums); NaN and infinity keep their IEEE meaning.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .cblas import sgemm
from .simd import LANES, below, exp, fma, hmax, hsum, load_f32, store_lanes, transpose8, vmax, zeros

_FM = {"reassoc", "contract"}
_OPT = dict(cache=True, error_model="numpy", fastmath=_FM)


# --------------------------------------------------------------------------- RMSNorm (+ residual)
# A float32 row of a multiple of 8 elements in unit stride (`vec`, the runner's check) runs
# the *_row_f32 body: 8 lanes at a time, two sums in flight (the scalar loops, numba-typed
# for any dtype and layout, ran a 384-wide residual+LayerNorm row in ~400 ns, this in ~170).
_W2 = 2 * LANES


@njit(**_OPT)
def _rms_row(i, x, r, w, h, o, has_r, has_w, offset, eps, dd):
    n = x.shape[1]
    acc = eps * 0
    if has_r:
        for j in range(n):
            v = x[i, j] + r[i, j]
            h[i, j] = v
            acc += h[i, j] * h[i, j]
    else:
        for j in range(n):
            acc += x[i, j] * x[i, j]
    inv = (eps * 0 + 1) / math.sqrt(acc / dd + eps)
    for j in range(n):
        y = (h[i, j] if has_r else x[i, j]) * inv
        o[i, j] = y * (w[j] + offset) if has_w else y


@njit(inline="always", **_OPT)
def _summed_lanes(x, r, h, j, has_r):
    """Lanes j..j+7 of the norm's input: x, or x + r (the residual sum, stored in h)."""
    v = load_f32(x, j)
    if has_r:
        v = v + load_f32(r, j)
        store_lanes(h, j, v)
    return v


@njit(**_OPT)
def _rms_row_f32(x, r, w, h, o, has_r, has_w, offset, eps, dd):
    n = x.shape[0]
    src = h if has_r else x
    q0, q1 = zeros(), zeros()
    j = 0
    while j < n:                      # (a while loop: numba's stepped range costs ~20% here)
        v = _summed_lanes(x, r, h, j, has_r)
        if j % _W2 == 0:
            q0 = fma(v, v, q0)
        else:
            q1 = fma(v, v, q1)
        j += LANES
    inv = np.float32(1.0) / np.float32(math.sqrt(hsum(q0 + q1) / dd + eps))
    for j in range(0, n, LANES):
        y = load_f32(src, j) * inv
        if has_w:
            y = y * (load_f32(w, j) + offset)
        store_lanes(o, j, y)


def _rms_any(i, x, r, w, h, o, has_r, has_w, offset, eps, dd, vec):
    """Row i: the float32 vector body where `vec`, else the scalar one."""


@overload(_rms_any, inline="always", jit_options=dict(fastmath=_FM))
def _ov_rms_any(i, x, r, w, h, o, has_r, has_w, offset, eps, dd, vec):
    if o.dtype != types.float32:           # (the vector body types only for float32)
        return lambda i, x, r, w, h, o, has_r, has_w, offset, eps, dd, vec: _rms_row(
            i, x, r, w, h, o, has_r, has_w, offset, eps, dd)

    def f32(i, x, r, w, h, o, has_r, has_w, offset, eps, dd, vec):
        if vec:
            _rms_row_f32(x[i], r[i], w, h[i], o[i], has_r, has_w, offset, eps, dd)
        else:
            _rms_row(i, x, r, w, h, o, has_r, has_w, offset, eps, dd)
    return f32


@njit(parallel=True, **_OPT)
def rms_par(x, r, w, h, o, has_r, has_w, offset, eps, dd, vec):
    """RMSNorm of the rows of 3-D arrays [n0, n1, D]: a view's rows need not be evenly spaced
    (q's heads in a fused QKV output), so no copy makes them rows of a matrix first."""
    n1 = x.shape[1]
    for t in prange(x.shape[0] * n1):
        i = t // n1
        _rms_any(t - i * n1, x[i], r[i], w, h[i], o[i], has_r, has_w, offset, eps, dd, vec)


@njit(**_OPT)
def rms_ser(x, r, w, h, o, has_r, has_w, offset, eps, dd, vec):
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            _rms_any(j, x[i], r[i], w, h[i], o[i], has_r, has_w, offset, eps, dd, vec)


# --------------------------------------------------------------------------- LayerNorm (+ residual)
@njit(**_OPT)
def _ln_row(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd):
    n = x.shape[1]
    acc = eps * 0
    if has_r:
        for j in range(n):
            h[i, j] = x[i, j] + r[i, j]
            acc += h[i, j]
    else:
        for j in range(n):
            acc += x[i, j]
    mu = acc / dd
    var = eps * 0
    for j in range(n):
        d = (h[i, j] if has_r else x[i, j]) - mu
        var += d * d
    sd = math.sqrt(var / dd + eps)
    for j in range(n):
        y = ((h[i, j] if has_r else x[i, j]) - mu) / sd
        if has_g:
            y = y * g[j]
        if has_b:
            y = y + b[j]
        o[i, j] = y


@njit(**_OPT)
def _ln_row_f32(x, r, g, b, h, o, has_r, has_g, has_b, eps, dd):
    """Two passes as the scalar row (the mean, then the sum of squared deviations: no
    E[x^2] - mean^2 cancellation), then the scaled row."""
    n = x.shape[0]
    src = h if has_r else x
    s0, s1 = zeros(), zeros()
    j = 0
    while j < n:
        v = _summed_lanes(x, r, h, j, has_r)
        if j % _W2 == 0:
            s0 = s0 + v
        else:
            s1 = s1 + v
        j += LANES
    mu = hsum(s0 + s1) / dd
    s0, s1 = zeros(), zeros()
    for j in range(0, n - LANES, _W2):
        d0, d1 = load_f32(src, j) - mu, load_f32(src, j + LANES) - mu
        s0, s1 = fma(d0, d0, s0), fma(d1, d1, s1)
    if n % _W2:
        d0 = load_f32(src, n - LANES) - mu
        s0 = fma(d0, d0, s0)
    inv = np.float32(1.0) / np.float32(math.sqrt(hsum(s0 + s1) / dd + eps))
    for j in range(0, n, LANES):
        y = (load_f32(src, j) - mu) * inv
        if has_g:
            y = y * load_f32(g, j)
        if has_b:
            y = y + load_f32(b, j)
        store_lanes(o, j, y)


def _ln_any(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec):
    """Row i: the float32 vector body where `vec`, else the scalar one."""


@overload(_ln_any, inline="always", jit_options=dict(fastmath=_FM))
def _ov_ln_any(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec):
    if o.dtype != types.float32:
        return lambda i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec: _ln_row(
            i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd)

    def f32(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec):
        if vec:
            _ln_row_f32(x[i], r[i], g, b, h[i], o[i], has_r, has_g, has_b, eps, dd)
        else:
            _ln_row(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd)
    return f32


@njit(parallel=True, **_OPT)
def ln_par(x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec):
    for i in prange(x.shape[0]):
        _ln_any(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec)


@njit(**_OPT)
def ln_ser(x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec):
    for i in range(x.shape[0]):
        _ln_any(i, x, r, g, b, h, o, has_r, has_g, has_b, eps, dd, vec)


# --------------------------------------------------------------------------- softmax (last axis)
@njit(**_OPT)
def _softmax_row(i, x, o):
    n = x.shape[1]
    if n == 0:
        return
    m = x[i, 0]
    for j in range(1, n):
        if x[i, j] > m:
            m = x[i, j]
    if not math.isfinite(m):
        m = x.dtype.type(0)              # numpy's reference: a row of -inf becomes zeros
    tot = m * 0
    for j in range(n):
        e = math.exp(x[i, j] - m)
        o[i, j] = e
        tot += e
    if tot == 0:
        tot = tot + 1
    for j in range(n):
        o[i, j] = o[i, j] / tot


@njit(parallel=True, **_OPT)
def softmax_par(x, o):
    for i in prange(x.shape[0]):
        _softmax_row(i, x, o)


@njit(**_OPT)
def softmax_ser(x, o):
    for i in range(x.shape[0]):
        _softmax_row(i, x, o)


# --------------------------------------------------------------------------- RoPE
@njit(**_OPT)
def _rope_vec(x, cos, sin, o, interleaved):
    """One head's row: pairs (2i, 2i + 1) or (i, i + half) rotated by cos[i], sin[i]; the
    dims past 2 * half copied."""
    half = cos.shape[0]
    for i in range(half):
        c, sn = cos[i], sin[i]
        j, k = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        x1, x2 = x[j], x[k]
        o[j] = x1 * c - x2 * sn
        o[k] = x2 * c + x1 * sn
    for d in range(2 * half, x.shape[0]):
        o[d] = x[d]


@njit(**_OPT)
def _rope_row_f32(x, cos, sin, o):
    """_rope_vec's half style for float32, 8 pairs at a time (half a multiple of 8, unit
    strides: the runner's `vec`): a 64-wide head row in ~12 ns, the scalar loop's ~70."""
    half = cos.shape[0]
    j = 0
    while j < half:
        c, sn = load_f32(cos, j), load_f32(sin, j)
        x1, x2 = load_f32(x, j), load_f32(x, j + half)
        store_lanes(o, j, x1 * c - x2 * sn)
        store_lanes(o, j + half, x2 * c + x1 * sn)
        j += LANES
    for d in range(2 * half, x.shape[0]):
        o[d] = x[d]


def _rope_lanes(t, x, cos, sin, o):
    """Row t by _rope_row_f32 (float32 only: the runner sets `vec` for nothing else)."""


@overload(_rope_lanes, inline="always", jit_options=dict(fastmath=_FM))
def _ov_rope_lanes(t, x, cos, sin, o):
    if o.dtype != types.float32:
        return lambda t, x, cos, sin, o: None

    def f32(t, x, cos, sin, o):
        b, hh, s, tb = _rope_at(t, x, cos)
        _rope_row_f32(x[b, hh, s], cos[tb, s], sin[tb, s], o[b, hh, s])
    return f32


@njit(**_OPT)
def _rope_at(t, x, cos):
    """Row t of x [B, H, S, D] as (b, h, s) and its table row's batch index."""
    nb, nh, ns, nd = x.shape
    b = t // (nh * ns)
    return b, (t // ns) % nh, t % ns, (b if cos.shape[0] > 1 else 0)


@njit(**_OPT)
def _rope_row(t, x, cos, sin, o, interleaved):
    b, hh, s, tb = _rope_at(t, x, cos)
    _rope_vec(x[b, hh, s], cos[tb, s], sin[tb, s], o[b, hh, s], interleaved)


# (`vec` picks a loop, not a body per row: a flag tested per row kept both bodies' row
# slices alive, 65 us against 23 for a [9, 121, 64] q)
@njit(parallel=True, **_OPT)
def rope_par(x, cos, sin, o, interleaved, vec):
    n = x.shape[0] * x.shape[1] * x.shape[2]
    if vec:
        for t in prange(n):
            _rope_lanes(t, x, cos, sin, o)
    else:
        for t in prange(n):
            _rope_row(t, x, cos, sin, o, interleaved)


@njit(**_OPT)
def rope_ser(x, cos, sin, o, interleaved, vec):
    n = x.shape[0] * x.shape[1] * x.shape[2]
    if vec:
        for t in range(n):
            _rope_lanes(t, x, cos, sin, o)
    else:
        for t in range(n):
            _rope_row(t, x, cos, sin, o, interleaved)


# --------------------------------------------------------------------------- attention
@njit(**_OPT)
def _bounds(qp, sk, causal, window):
    """Keys [lo, hi) a query at position qp may see: causal and sliding-window limits."""
    lo, hi = 0, sk
    if causal:
        hi = min(sk, qp + 1)
        if window > 0:
            lo = max(0, qp - window + 1)
    return lo, max(lo, hi)


@njit(**_OPT)
def _mask_rows(keep, bias, b, h, i):
    """(keep row, its key step, bias row, its key step) of query row i of head h of batch row
    b: `keep` and `bias` are 4-D with each dim 1 (broadcast) or full; a step 0 is one value
    for every key."""
    krow = keep[min(b, keep.shape[0] - 1), min(h, keep.shape[1] - 1), min(i, keep.shape[2] - 1)]
    brow = bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1), min(i, bias.shape[2] - 1)]
    return krow, min(krow.shape[0] - 1, 1), brow, min(brow.shape[0] - 1, 1)


@njit(inline="always", **_OPT)
def nan_max(m, x):
    """The larger of m and x, NaN if either is (numpy's maximum): a running max of scores
    that keeps a NaN, so its softmax row comes out NaN as the reference's does (`x > m`
    alone lets a NaN lose, and a row of NaN looked fully masked: zeros)."""
    return x if (x > m or x != x) else m


def row_max(s, n, ninf):
    """max(s[:n], ninf), NaN if any of s[:n] is (nan_max): eight lanes at a time for f32."""


@overload(row_max, jit_options=dict(fastmath=_FM))
def _row_max(s, n, ninf):
    if s.dtype == types.float32:
        def lanes(s, n, ninf):
            mx, j = zeros() + ninf, 0
            while j + LANES <= n:
                mx = vmax(mx, load_f32(s, j))
                j += LANES
            m = hmax(mx)
            for t in range(j, n):
                m = nan_max(m, s[t])
            return m
        return lanes

    def scalar(s, n, ninf):
        m = ninf
        for t in range(n):
            m = nan_max(m, s[t])
        return m
    return scalar


def exp_shifted(s, n, m):
    """s[:n] = exp(s[:n] - m), returning their sum: eight lanes at a time for f32 (simd.exp),
    libm's exp for f64 (the reference precision)."""


@overload(exp_shifted, jit_options=dict(fastmath=_FM))
def _exp_shifted(s, n, m):
    if s.dtype == types.float32:
        def lanes(s, n, m):
            acc, j = zeros(), 0
            while j + LANES <= n:
                e = exp(load_f32(s, j) - m)
                store_lanes(s, j, e)
                acc = acc + e
                j += LANES
            tot = hsum(acc)
            for i in range(j, n):
                e = math.exp(s[i] - m)
                s[i] = e
                tot += e
            return tot
        return lanes

    def scalar(s, n, m):
        tot = m * 0
        for i in range(n):
            e = math.exp(s[i] - m)
            s[i] = e
            tot += e
        return tot
    return scalar


# A softmax weight below this adds nothing an f32 or f64 sum can hold (the largest weight is
# at least 1 / keys), and its products with the values would be subnormal: one microcode
# assist per lane (Gemma 3's peaked heads ran their prefill attention 3x slower).
P_MIN = 1e-30
ATTN_ROWS = 16            # query rows of one head per task (their buffers allocated once)


@njit(inline="always", **_OPT)
def weighs(p):
    """Whether softmax weight p takes part in the weighted sum: above P_MIN, or NaN (a NaN
    weight must reach the output; `p > P_MIN` alone dropped it)."""
    return not p <= P_MIN


@njit(**_OPT)
def _attn_rows(t, q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
               ninf):
    """Query rows [ATTN_ROWS * c, ...) of head h of batch row b for task t = (b, h, c): per
    row the keys [lo, hi) the causal/window mask leaves, scores, softmax, weighted sum.
    `keep` and `bias` are 4-D with each dim 1 (broadcast) or full, as the graph gives them.
    The query row and the sum live in contiguous buffers and keys are read as rows (dots
    that vectorize); a masked key costs no dot and no value row (a ring cache or padded
    bucket is mostly masked)."""
    nb, nh, sq, d = q.shape
    kvh, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    chunks = (sq + ATTN_ROWS - 1) // ATTN_ROWS
    b, h, c = t // (nh * chunks), (t // chunks) % nh, t % chunks
    kh = h // (nh // kvh)
    zero = scale * 0
    qb = np.empty(d, q.dtype)
    s = np.empty(max(sk, 1), q.dtype)
    acc_o = np.empty(dv, o.dtype)
    for i in range(ATTN_ROWS * c, min(sq, ATTN_ROWS * (c + 1))):
        acc_o[:] = 0
        lo, hi = _bounds(pos[b] + i, sk, causal, window)
        if hi > lo:
            for x in range(d):
                qb[x] = q[b, h, i, x]
            krow, kj, brow, bj = _mask_rows(keep, bias, b, h, i)
            m = ninf
            for j in range(lo, hi):
                if use_keep and not krow[j * kj]:
                    s[j - lo] = ninf
                    continue
                acc = zero
                for x in range(d):
                    acc += qb[x] * k[b, kh, j, x]
                acc *= scale
                if softcap > 0:
                    acc = math.tanh(acc / softcap) * softcap
                if use_bias:
                    acc += brow[j * bj]
                s[j - lo] = acc
                m = nan_max(m, acc)
            if m != ninf:                            # (every key masked: a zero row)
                inv = 1 / exp_shifted(s, hi - lo, m)
                for j in range(lo, hi):
                    p = s[j - lo] * inv
                    if weighs(p):                # (indexed, not a row view: that stays scalar)
                        for x in range(dv):
                            acc_o[x] += p * v[b, kh, j, x]
        for x in range(dv):
            o[b, h, i, x] = acc_o[x]


@njit(parallel=True, **_OPT)
def attention_par(q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias, ninf):
    for t in prange(q.shape[0] * q.shape[1] * ((q.shape[2] + ATTN_ROWS - 1) // ATTN_ROWS)):
        _attn_rows(t, q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                   ninf)


@njit(**_OPT)
def attention_ser(q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias, ninf):
    for t in range(q.shape[0] * q.shape[1] * ((q.shape[2] + ATTN_ROWS - 1) // ATTN_ROWS)):
        _attn_rows(t, q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                   ninf)


@njit(**_OPT)
def _gemm_tile(t, rows, q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
               ninf, gemm, ilp64):
    """Prefill attention as two matrix products (f32), for task t = (tile of `rows` query
    rows, batch row b, kv head kh): the tile's rows of every query head of kh's group stacked
    into one Q [g * rows, d], S = Q K^T over the keys [lo, hi) any of them sees in one
    cblas_sgemm call, each score row masked (causal/window bounds, keep, bias, softcap) and
    softmaxed in place, O = P V in a second call a head, written straight into its rows of o.
    As in _attn_rows, a weight below P_MIN becomes 0, a row with every key masked gives zeros
    and one with a NaN score NaN; unlike it, P V reads every value row in [lo, hi), as the
    NumPy backend reads every key's. q, k, v and o may have strided rows (cblas.sgemm: heads
    read from a fused QKV matmul's rows, the output in the layout the output projection
    reads). Tiles go 0, last, 1, last - 1, ...: numba hands each thread a contiguous range of
    tasks and causal tiles grow with their index."""
    nb, nh, sq, d = q.shape
    kvh, sk = k.shape[1], k.shape[2]
    g, tiles = nh // kvh, (sq + rows - 1) // rows
    c, b, kh = t // (nb * kvh), (t // kvh) % nb, t % kvh
    c = c // 2 if c % 2 == 0 else tiles - 1 - c // 2
    r0, r1 = c * rows, min(sq, (c + 1) * rows)
    m = r1 - r0
    lo = _bounds(pos[b] + r0, sk, causal, window)[0]
    n = max(lo, _bounds(pos[b] + r1 - 1, sk, causal, window)[1]) - lo
    zero, one = scale * 0, q.dtype.type(1)
    if n == 0:                                # no key in reach: zero rows
        for r in range(g * m):
            o[b, kh * g + r // m, r0 + r % m, :] = zero
        return
    qs = np.empty((g * m, d), q.dtype)
    for r in range(g * m):
        qr, dst = q[b, kh * g + r // m, r0 + r % m], qs[r]      # (row views: the copies vectorize)
        for x in range(d):
            dst[x] = qr[x] * scale
    s = np.empty((g * m, n), q.dtype)
    sgemm(gemm, ilp64, qs, k[b, kh, lo:lo + n], s, False, True)
    for r in range(g * m):
        h, i = kh * g + r // m, r0 + r % m
        a, e = _bounds(pos[b] + i, sk, causal, window)
        a, e = a - lo, e - lo
        row, seg = s[r], s[r, a:e]            # (indexed from 0: the loops vectorize)
        krow, kj, brow, bj = _mask_rows(keep, bias, b, h, i)
        if softcap > 0 or use_bias or use_keep:
            mx = ninf
            for j in range(e - a):
                x = seg[j]
                if softcap > 0:
                    x = math.tanh(x / softcap) * softcap
                if use_bias:
                    x += brow[(lo + a + j) * bj]
                if use_keep and not krow[(lo + a + j) * kj]:
                    x = ninf
                seg[j] = x
                mx = nan_max(mx, x)
        else:                                 # scores as they are: the max in vector lanes
            mx = row_max(seg, e - a, ninf)
        if mx == ninf:                        # every key masked: a zero row (its -inf
            row[:] = zero                     # scores times 0 would be NaN)
            continue
        inv = one / exp_shifted(seg, e - a, mx)
        row[:a] = zero
        row[e:] = zero
        for j in range(e - a):
            p = seg[j] * inv
            seg[j] = p if weighs(p) else zero
    for hg in range(g):
        sgemm(gemm, ilp64, s[hg * m:(hg + 1) * m], v[b, kh, lo:lo + n], o[b, kh * g + hg, r0:r1],
              False, False)


ATTN_TILE_BYTES = 512 << 10    # most score bytes of one task of unmasked prefill attention


def attention_tile(rows: int, sq: int, sk: int, tasks_per_tile: int, threads: int, causal: bool) -> int:
    """Query rows per task of the sgemm-tiled attention (_gemm_tile). Causal / windowed:
    `rows` (small tiles balance, as the tiles grow with their index). Otherwise every row sees
    every key, so fewer, larger tiles: each key and value block is packed once per tile, not
    once per `rows` rows, and the two products are larger (16 images x 6 heads x 257 tokens
    of DINOv2-S on one core: 5.1 ms in tiles of 32 rows, 2.1 ms in one tile of 257); at most
    ATTN_TILE_BYTES of scores (in L2), split in equal tiles, and enough tiles that every one
    of `threads` has two tasks (`tasks_per_tile`: batch rows x kv heads)."""
    if causal or sq <= rows:
        return max(1, min(rows, sq))
    tiles = -(-sq // max(rows, ATTN_TILE_BYTES // (4 * max(sk, 1))))
    while tiles * tasks_per_tile < 2 * threads and -(-sq // (tiles * 2)) >= rows:
        tiles *= 2
    return -(-sq // tiles)


@njit(parallel=True, **_OPT)
def attention_gemm_par(q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                       ninf, rows, gemm, ilp64):
    for t in prange(((q.shape[2] + rows - 1) // rows) * q.shape[0] * k.shape[1]):
        _gemm_tile(t, rows, q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                   ninf, gemm, ilp64)


@njit(**_OPT)
def attention_gemm_ser(q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                       ninf, rows, gemm, ilp64):
    for t in range(((q.shape[2] + rows - 1) // rows) * q.shape[0] * k.shape[1]):
        _gemm_tile(t, rows, q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                   ninf, gemm, ilp64)


# --------------------------------------------------------------------------- few query rows: keys split
@njit(**_OPT)
def _key_dot_any(qr, kr):
    acc = qr[0] * 0
    for x in range(qr.shape[0]):
        acc += qr[x] * kr[x]
    return acc


@njit(**_OPT)
def _add_row_any(acc, p, vr):
    for x in range(acc.shape[0]):
        acc[x] += p * vr[x]


def _key_dot(qr, kr, vec):
    """qr . kr for a query row and a key row (1-D, d elements; `vec`: f32, d a multiple of 8)."""


@overload(_key_dot, inline="always", jit_options=dict(fastmath=_FM))
def _ov_key_dot(qr, kr, vec):
    if qr.dtype != types.float32 or kr.dtype != types.float32:
        return lambda qr, kr, vec: _key_dot_any(qr, kr)

    def f32(qr, kr, vec):
        if not vec:
            return _key_dot_any(qr, kr)
        a0, a1, x = zeros(), zeros(), 0
        while x + _W2 <= qr.shape[0]:
            a0 = fma(load_f32(qr, x), load_f32(kr, x), a0)
            a1 = fma(load_f32(qr, x + LANES), load_f32(kr, x + LANES), a1)
            x += _W2
        if x < qr.shape[0]:
            a0 = fma(load_f32(qr, x), load_f32(kr, x), a0)
        return hsum(a0 + a1)
    return f32


def _add_row(acc, p, vr, vec):
    """acc += p * vr (1-D rows of dv elements; `vec`: f32, dv a multiple of 8)."""


@overload(_add_row, inline="always", jit_options=dict(fastmath=_FM))
def _ov_add_row(acc, p, vr, vec):
    if acc.dtype != types.float32 or vr.dtype != types.float32:
        return lambda acc, p, vr, vec: _add_row_any(acc, p, vr)

    def f32(acc, p, vr, vec):
        if not vec:
            _add_row_any(acc, p, vr)
        else:
            for x in range(0, acc.shape[0], LANES):
                store_lanes(acc, x, fma(p, load_f32(vr, x), load_f32(acc, x)))
    return f32


@njit(**_OPT)
def _key_chunk_dots(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep,
                    use_bias, ninf, pm, pl, pa, vec):
    """_key_chunk as one dot product per query row and key (float64, or rows that are no
    multiple of 8 lanes); a masked key costs no dot."""
    nh, sq, d, dv = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    g_n = nh // k.shape[1]
    rows, n = g_n * sq, hi - lo
    qb = np.empty((rows, d), q.dtype)                 # row r: head kh * g_n + r // sq, query r % sq
    for r in range(rows):
        for x in range(d):
            qb[r, x] = q[b, kh * g_n + r // sq, r % sq, x]
    kb, kj = min(b, keep.shape[0] - 1), min(keep.shape[3] - 1, 1)      # (a dim of 1 broadcasts)
    bb, bj = min(b, bias.shape[0] - 1), min(bias.shape[3] - 1, 1)
    s = np.empty((rows, max(n, 1)), q.dtype)
    for i in range(sq):                              # (query rows one after another: the keys of a
        a, e = _bounds(pos[b] + i, k.shape[2], causal, window)      # chunk stay in cache)
        a, e = max(lo, a), max(lo, min(hi, e))
        for g in range(g_n):
            s[g * sq + i, :a - lo] = ninf
            s[g * sq + i, e - lo:n] = ninf
        for j in range(a, e):
            kr = k[b, kh, j]
            for g in range(g_n):
                h, r = kh * g_n + g, g * sq + i
                if use_keep and not keep[kb, min(h, keep.shape[1] - 1), min(i, keep.shape[2] - 1), j * kj]:
                    s[r, j - lo] = ninf
                    continue
                acc = _key_dot(qb[r], kr, vec) * scale
                if softcap > 0:
                    acc = math.tanh(acc / softcap) * softcap
                if use_bias:
                    acc += bias[bb, min(h, bias.shape[1] - 1), min(i, bias.shape[2] - 1), j * bj]
                s[r, j - lo] = acc
    acc_o = np.zeros((rows, dv), q.dtype)
    for i in range(sq):
        for g in range(g_n):
            r = g * sq + i
            m = row_max(s[r], n, ninf)
            tot = exp_shifted(s[r], n, m) if m != ninf else scale * 0
            pm[b, kh * g_n + g, i, c], pl[b, kh * g_n + g, i, c] = m, tot
        a, e = _bounds(pos[b] + i, k.shape[2], causal, window)
        for j in range(max(lo, a), max(lo, min(hi, e))):
            vr = v[b, kh, j]
            for g in range(g_n):
                r = g * sq + i
                p = s[r, j - lo]
                if weighs(p) and pm[b, kh * g_n + g, i, c] != ninf:
                    _add_row(acc_o[r], p, vr, vec)
    for r in range(rows):
        for x in range(dv):
            pa[b, kh * g_n + r // sq, r % sq, c, x] = acc_o[r, x]


@njit(**_OPT)
def _tile_scores(b, kh, lo, n, q, k, scale, s):
    """s[r, j] = scale * q_r . k[b, kh, lo + j] for the query rows r of kv head kh's group
    (row r: head kh * g + r // sq, query r % sq; s's rows past them get 0) and keys j < n
    (up to a multiple of 8: the last key again). Lanes run over 8 query rows: one element of
    a key feeds 8 multiply-adds of 8 keys, no horizontal sums; each 8 keys x 8 rows block is
    transposed into s."""
    sq, d = q.shape[2], q.shape[3]
    g_n = q.shape[1] // k.shape[1]
    rp, n8 = s.shape[0], s.shape[1]
    qt = np.zeros(d * rp, np.float32)                # [d, rp]: q transposed, scaled
    for r in range(g_n * sq):
        qr = q[b, kh * g_n + r // sq, r % sq]
        for x in range(d):
            qt[x * rp + r] = qr[x] * scale
    blk = np.empty(LANES * rp, np.float32)           # [8 keys, rp]
    for j0 in range(0, n, LANES):
        k0, k1 = k[b, kh, lo + j0], k[b, kh, lo + min(j0 + 1, n - 1)]
        k2, k3 = k[b, kh, lo + min(j0 + 2, n - 1)], k[b, kh, lo + min(j0 + 3, n - 1)]
        k4, k5 = k[b, kh, lo + min(j0 + 4, n - 1)], k[b, kh, lo + min(j0 + 5, n - 1)]
        k6, k7 = k[b, kh, lo + min(j0 + 6, n - 1)], k[b, kh, lo + min(j0 + 7, n - 1)]
        for rv in range(0, rp, LANES):
            a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
            a4, a5, a6, a7 = zeros(), zeros(), zeros(), zeros()
            for x in range(d):
                qv = load_f32(qt, x * rp + rv)
                a0, a1 = fma(k0[x], qv, a0), fma(k1[x], qv, a1)
                a2, a3 = fma(k2[x], qv, a2), fma(k3[x], qv, a3)
                a4, a5 = fma(k4[x], qv, a4), fma(k5[x], qv, a5)
                a6, a7 = fma(k6[x], qv, a6), fma(k7[x], qv, a7)
            store_lanes(blk, rv, a0)
            store_lanes(blk, rp + rv, a1)
            store_lanes(blk, 2 * rp + rv, a2)
            store_lanes(blk, 3 * rp + rv, a3)
            store_lanes(blk, 4 * rp + rv, a4)
            store_lanes(blk, 5 * rp + rv, a5)
            store_lanes(blk, 6 * rp + rv, a6)
            store_lanes(blk, 7 * rp + rv, a7)
            transpose8(blk, rv, rp, s, rv * n8 + j0, n8)


KEY_BLOCK = 64            # keys whose value rows one pass of _tile_values keeps in L1


@njit(**_OPT)
def _keys_kept(krow, lo, hi):
    """Whether a key mask row (one value for every key where its length is 1) keeps every
    key in [lo, hi): a piece's mask, checked once a chunk, not once a query row."""
    for j in range(lo, hi):
        if not krow[min(j, krow.shape[0] - 1)]:
            return False
    return True


@njit(**_OPT)
def _tile_values(b, kh, c, lo, n, v, s, rows, sq, pa):
    """pa[b, h, i, c] = sum_j s[r, j] v[b, kh, lo + j] for the query rows r < rows of kv
    head kh's group (as _tile_scores): four rows by two lane groups of values at a time, one
    value row's lanes feeding four multiply-adds each, over KEY_BLOCK keys at a time (their
    value rows read from memory once, then from L1 for the other lane groups and rows)."""
    dv = v.shape[3]
    g_n = pa.shape[1] // v.shape[1]
    acc = np.zeros(s.shape[0] * dv, np.float32)      # [rows up to a multiple of 8, dv]
    for j0 in range(0, n, KEY_BLOCK):
        for r0 in range(0, rows, 4):
            p0, p1, p2, p3 = s[r0], s[r0 + 1], s[r0 + 2], s[r0 + 3]
            for x in range(0, dv, 2 * LANES):
                y = min(x + LANES, dv - LANES)       # (one lane group left: it twice, alike)
                at0, at1, at2, at3 = r0 * dv, (r0 + 1) * dv, (r0 + 2) * dv, (r0 + 3) * dv
                a0, a1, a2, a3 = load_f32(acc, at0 + x), load_f32(acc, at1 + x), load_f32(acc, at2 + x), \
                    load_f32(acc, at3 + x)
                b0, b1, b2, b3 = load_f32(acc, at0 + y), load_f32(acc, at1 + y), load_f32(acc, at2 + y), \
                    load_f32(acc, at3 + y)
                for j in range(j0, min(n, j0 + KEY_BLOCK)):
                    vr = v[b, kh, lo + j]
                    v0, v1 = load_f32(vr, x), load_f32(vr, y)
                    a0, b0 = fma(p0[j], v0, a0), fma(p0[j], v1, b0)
                    a1, b1 = fma(p1[j], v0, a1), fma(p1[j], v1, b1)
                    a2, b2 = fma(p2[j], v0, a2), fma(p2[j], v1, b2)
                    a3, b3 = fma(p3[j], v0, a3), fma(p3[j], v1, b3)
                store_lanes(acc, at0 + y, b0)
                store_lanes(acc, at1 + y, b1)
                store_lanes(acc, at2 + y, b2)
                store_lanes(acc, at3 + y, b3)
                store_lanes(acc, at0 + x, a0)
                store_lanes(acc, at1 + x, a1)
                store_lanes(acc, at2 + x, a2)
                store_lanes(acc, at3 + x, a3)
    for r in range(rows):
        out = pa[b, kh * g_n + r // sq, r % sq, c]
        for x in range(dv):
            out[x] = acc[r * dv + x]


@njit(**_OPT)
def _key_chunk_tiles(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep,
                     use_bias, ninf, pm, pl, pa):
    """_key_chunk in register tiles (f32 rows of a multiple of 8 lanes): every key's score
    for every row (_tile_scores), then each row's bounds, masks and softmax, then the
    weighted values (_tile_values). Single-thread CPU time of 9 heads on 3 kv heads of 64
    over 2,000 keys (L3-warm): a decode row 0.16 ms against 0.30 as dot products, a piece of
    8 queries 0.59 ms against 1.18 as two sgemm calls a kv head."""
    sq = q.shape[2]
    g_n = q.shape[1] // k.shape[1]
    rows, n = g_n * sq, hi - lo
    rp, n8 = -(-rows // LANES) * LANES, -(-n // LANES) * LANES
    s = np.empty((rp, n8), np.float32)
    _tile_scores(b, kh, lo, n, q, k, scale, s)
    each = softcap > 0 or use_bias or (use_keep and (   # a scalar pass over each row's keys
        keep.shape[1] > 1 or keep.shape[2] > 1
        or not _keys_kept(keep[min(b, keep.shape[0] - 1), 0, 0], lo, hi)))
    zero = np.float32(0)
    for r in range(rows):
        h, i = kh * g_n + r // sq, r % sq
        row = s[r]
        a, e = _bounds(pos[b] + i, k.shape[2], causal, window)
        a, e = min(n, max(0, a - lo)), max(0, min(n, e - lo))
        row[:a] = ninf
        row[max(a, e):n] = ninf
        if each and e > a:
            krow, kj, brow, bj = _mask_rows(keep, bias, b, h, i)
            for j in range(a, e):
                x = row[j]
                if softcap > 0:
                    x = math.tanh(x / softcap) * softcap
                if use_bias:
                    x += brow[(lo + j) * bj]
                if use_keep and not krow[(lo + j) * kj]:
                    x = ninf
                row[j] = x
        m = row_max(row, n, ninf)
        pm[b, h, i, c] = m
        if m == ninf:                                # every key masked: no weight
            row[:] = zero
            pl[b, h, i, c] = zero
            continue
        pl[b, h, i, c] = exp_shifted(row, n, m)
        for j in range(n):
            p = row[j]
            row[j] = p if weighs(p) else zero
        row[n:] = zero
    _tile_values(b, kh, c, lo, n, v, s, rows, sq, pa)


def _key_chunk(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep,
               use_bias, ninf, pm, pl, pa, vec):
    """Keys [lo, hi) of kv head kh against every query row of every head of its group (a
    decode step's one row, a prefill piece's few): each key and value row is read once for
    all of them. Per query row, its partial max, sum of exponentials and weighted sum of
    values, in pm, pl, pa[b, h, i, c]; a key outside the row's causal/window bounds or
    masked out scores -inf. `vec`: f32 rows of d and dv a multiple of 8 in unit stride,
    multiplied in register tiles (the indexed loops stay scalar: 2x slower)."""


@overload(_key_chunk, jit_options=dict(fastmath=_FM))
def _ov_key_chunk(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep,
                  use_bias, ninf, pm, pl, pa, vec):
    if pa.dtype != types.float32:                    # (the tiles type only for float32)
        return lambda b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep, \
            use_bias, ninf, pm, pl, pa, vec: _key_chunk_dots(
                b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep,
                use_bias, ninf, pm, pl, pa, vec)

    def f32(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window, use_keep,
            use_bias, ninf, pm, pl, pa, vec):
        if vec:
            _key_chunk_tiles(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window,
                             use_keep, use_bias, ninf, pm, pl, pa)
        else:
            _key_chunk_dots(b, kh, c, lo, hi, q, k, v, keep, bias, pos, scale, softcap, causal, window,
                            use_keep, use_bias, ninf, pm, pl, pa, vec)
    return f32


CHUNK_SCORES = 1 << 16    # most scores of one task of attention_split_keys (256 KiB of f32)


@njit(parallel=True, **_OPT)
def attention_split_keys(q, k, v, keep, bias, pos, o, scale, softcap, causal, window, use_keep, use_bias,
                         ninf, vec, min_chunk, threads):
    """Attention for one or a few query rows per sequence (decode; a prefill piece riding a
    decode step) as flash decoding does it: tasks are (sequence, kv head, chunk of keys), so
    a long cache splits over the threads and each key is read once for all query rows of
    its group of heads (GQA); the chunks' partial softmax sums are merged after. Query row
    i of sequence b sits at position pos[b] + i."""
    nb, nh, sq = q.shape[0], q.shape[1], q.shape[2]
    kvh, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    span = 1
    for b in range(nb):
        first, last = _bounds(pos[b], sk, causal, window)[0], _bounds(pos[b] + sq - 1, sk, causal, window)[1]
        span = max(span, last - first)
    rows = -(-(nh // kvh) * sq // LANES) * LANES      # (a task's scores: at most CHUNK_SCORES)
    chunk = max(min_chunk, min((span + 2 * threads - 1) // (2 * threads), CHUNK_SCORES // rows))
    nc = (span + chunk - 1) // chunk
    pm = np.empty((nb, nh, sq, nc), o.dtype)
    pl = np.empty((nb, nh, sq, nc), o.dtype)
    pa = np.empty((nb, nh, sq, nc, dv), o.dtype)
    for t in prange(nb * kvh * nc):
        b, kh, c = t // (kvh * nc), (t // nc) % kvh, t % nc
        lo = _bounds(pos[b], sk, causal, window)[0]
        hi = max(lo, _bounds(pos[b] + sq - 1, sk, causal, window)[1])
        _key_chunk(b, kh, c, min(hi, lo + c * chunk), min(hi, lo + (c + 1) * chunk), q, k, v, keep, bias, pos,
                   scale, softcap, causal, window, use_keep, use_bias, ninf, pm, pl, pa, vec)
    for b in range(nb):
        for h in range(nh):
            for i in range(sq):
                m = ninf
                for c in range(nc):
                    m = nan_max(m, pm[b, h, i, c])
                tot = scale * 0
                for x in range(dv):
                    o[b, h, i, x] = scale * 0
                if m == ninf:
                    continue                         # every key masked: a zero row
                for c in range(nc):
                    if pm[b, h, i, c] != ninf:
                        w = math.exp(pm[b, h, i, c] - m)
                        tot += w * pl[b, h, i, c]
                        for x in range(dv):
                            o[b, h, i, x] += w * pa[b, h, i, c, x]
                for x in range(dv):
                    o[b, h, i, x] /= tot


# --------------------------------------------------------------------------- packed sequences
@njit(**_OPT)
def _varlen_task(t, q, k, v, starts, lens, o, scale, ninf):
    """Task t = (segment t // H, head t % H): each query row of the segment over the
    segment's keys only (q [T, H, D], k/v [T, KVH, D|Dv]; a kv head serves H/KVH heads).
    The segment's keys, values and each query row are copied into contiguous buffers first:
    the inputs are usually strided views of one fused projection, whose dot products numba
    cannot vectorize in place."""
    nh, kvh, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    seg, h = t // nh, t % nh
    kh = h // (nh // kvh)
    s0, n = starts[seg], lens[seg]
    if n <= 0:
        return
    zero = scale * 0
    kl = np.empty((n, d), q.dtype)
    vl = np.empty((n, dv), q.dtype)
    for j in range(n):
        for c in range(d):
            kl[j, c] = k[s0 + j, kh, c]
        for c in range(dv):
            vl[j, c] = v[s0 + j, kh, c]
    qb = np.empty(d, q.dtype)
    p = np.empty(n, q.dtype)
    acc = np.empty(dv, q.dtype)
    for i in range(s0, s0 + n):
        for c in range(d):
            qb[c] = q[i, h, c]
        m = ninf
        for j in range(n):
            a = zero
            for c in range(d):
                a += qb[c] * kl[j, c]
            a *= scale
            p[j] = a
            m = nan_max(m, a)
        tot = exp_shifted(p, n, m)
        for c in range(dv):
            acc[c] = zero
        for j in range(n):
            pj = p[j]
            if pj <= P_MIN * tot:
                continue
            for c in range(dv):
                acc[c] += pj * vl[j, c]
        for c in range(dv):
            o[i, h, c] = acc[c] / tot


@njit(**_OPT)
def _varlen_task_f32(t, q, k, v, starts, lens, o, scale, ninf):
    """_varlen_task for float32 with Dv a multiple of 8, task t = (segment, KV head). The
    segment's keys go transposed and zero-padded to a multiple of 32 ([D, n32]), its values
    contiguous. A query row's scores are summed 32 keys at a time and its output 32 columns
    at a time in four F32x8 registers, one query element or probability feeding four
    multiply-adds. (The general task takes a horizontal sum per key and keeps its output
    sums in memory: 4.7 GFLOP/s on MiniLM's 18-token texts.)"""
    nh, kvh, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    seg, kh = t // kvh, t % kvh
    s0, n = starts[seg], lens[seg]
    if n <= 0:
        return
    w = 4 * LANES
    n32 = (n + w - 1) // w * w
    n8 = (n + LANES - 1) // LANES * LANES
    kt = np.zeros(d * n32, np.float32)
    vl = np.empty(n * dv, np.float32)
    p = np.empty(n32, np.float32)
    for j in range(n):
        for c in range(d):
            kt[c * n32 + j] = k[s0 + j, kh, c]
        for c in range(dv):
            vl[j * dv + c] = v[s0 + j, kh, c]
    g = nh // kvh
    for h in range(kh * g, (kh + 1) * g):
        for i in range(s0, s0 + n):
            for jb in range(0, n32, w):
                a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
                for c in range(d):
                    qc, at = q[i, h, c], c * n32 + jb
                    a0 = fma(qc, load_f32(kt, at), a0)
                    a1 = fma(qc, load_f32(kt, at + LANES), a1)
                    a2 = fma(qc, load_f32(kt, at + 2 * LANES), a2)
                    a3 = fma(qc, load_f32(kt, at + 3 * LANES), a3)
                store_lanes(p, jb, a0)
                store_lanes(p, jb + LANES, a1)
                store_lanes(p, jb + 2 * LANES, a2)
                store_lanes(p, jb + 3 * LANES, a3)
            mx = zeros() + ninf                        # (vector passes: no scalar store feeds a
            for jb in range(0, n8, LANES):             # vector load)
                x = below(load_f32(p, jb) * scale, n - jb, ninf)     # padding keys: exp gives 0
                store_lanes(p, jb, x)
                mx = vmax(mx, x)
            m = hmax(mx)
            tot = zeros()
            for jb in range(0, n8, LANES):
                e = exp(load_f32(p, jb) - m)
                store_lanes(p, jb, e)
                tot = tot + e
            inv = np.float32(1.0) / hsum(tot)
            orow = o[i, h]
            cb = 0
            while cb + w <= dv:
                a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
                for j in range(n):
                    pj, at = p[j], j * dv + cb
                    a0 = fma(pj, load_f32(vl, at), a0)
                    a1 = fma(pj, load_f32(vl, at + LANES), a1)
                    a2 = fma(pj, load_f32(vl, at + 2 * LANES), a2)
                    a3 = fma(pj, load_f32(vl, at + 3 * LANES), a3)
                store_lanes(orow, cb, a0 * inv)
                store_lanes(orow, cb + LANES, a1 * inv)
                store_lanes(orow, cb + 2 * LANES, a2 * inv)
                store_lanes(orow, cb + 3 * LANES, a3 * inv)
                cb += w
            while cb < dv:
                a0 = zeros()
                for j in range(n):
                    a0 = fma(p[j], load_f32(vl, j * dv + cb), a0)
                store_lanes(orow, cb, a0 * inv)
                cb += LANES


def _varlen_kv_task(t, q, k, v, starts, lens, o, scale, ninf, vec):
    """Task t = (segment, KV head): the heads that KV head serves. `vec` (float32 only: Dv a
    multiple of 8, output rows contiguous) takes _varlen_task_f32, else _varlen_task per head."""


@njit(**_OPT)
def _varlen_heads(t, q, k, v, starts, lens, o, scale, ninf):
    nh, kvh = q.shape[1], k.shape[1]
    seg, kh = t // kvh, t % kvh
    g = nh // kvh
    for h in range(kh * g, (kh + 1) * g):
        _varlen_task(seg * nh + h, q, k, v, starts, lens, o, scale, ninf)


@overload(_varlen_kv_task, jit_options=dict(fastmath=_FM))
def _ov_varlen_kv_task(t, q, k, v, starts, lens, o, scale, ninf, vec):
    if o.dtype != types.float32:           # (the vector body types only for float32)
        return lambda t, q, k, v, starts, lens, o, scale, ninf, vec: _varlen_heads(
            t, q, k, v, starts, lens, o, scale, ninf)

    def f32(t, q, k, v, starts, lens, o, scale, ninf, vec):
        if vec:
            _varlen_task_f32(t, q, k, v, starts, lens, o, scale, ninf)
        else:
            _varlen_heads(t, q, k, v, starts, lens, o, scale, ninf)
    return f32


@njit(parallel=True, **_OPT)
def varlen_par(q, k, v, starts, lens, o, scale, ninf, vec):
    for t in prange(starts.shape[0] * k.shape[1]):
        _varlen_kv_task(t, q, k, v, starts, lens, o, scale, ninf, vec)


@njit(**_OPT)
def varlen_ser(q, k, v, starts, lens, o, scale, ninf, vec):
    for t in range(starts.shape[0] * k.shape[1]):
        _varlen_kv_task(t, q, k, v, starts, lens, o, scale, ninf, vec)


@njit(**_OPT)
def _pool_row(i, x, starts, lens, o, mode, zero):
    """Segment i of x [T, D] into o[i]: mode 0 mean, 1 first token (cls), 2 max (NaN wins)."""
    s0, n, dd = starts[i], lens[i], x.shape[1]
    for c in range(dd):
        o[i, c] = zero
    if n <= 0:
        return
    for c in range(dd):
        r = x[s0, c]
        if mode == 0:
            for j in range(s0 + 1, s0 + n):
                r += x[j, c]
            r = r / n
        elif mode == 2:
            for j in range(s0 + 1, s0 + n):
                y = x[j, c]
                if y > r or y != y:
                    r = y
        o[i, c] = r


@njit(parallel=True, **_OPT)
def pool_par(x, starts, lens, o, mode, zero):
    for i in prange(starts.shape[0]):
        _pool_row(i, x, starts, lens, o, mode, zero)


@njit(**_OPT)
def pool_ser(x, starts, lens, o, mode, zero):
    for i in range(starts.shape[0]):
        _pool_row(i, x, starts, lens, o, mode, zero)


# --------------------------------------------------------------------------- small-M GEMV
# --------------------------------------------------------------------------- KV cache write
@njit(**_OPT)
def kv_write(cache, new, pos):
    """new [B, pre, s, post] into cache [B, pre, n, post] at position pos[b] (or pos[0] for
    every row) of axis 2; returns -1, or the first row whose write would not fit (nothing
    written then)."""
    s = new.shape[2]
    bad = _overflow(cache, s, pos)
    if bad >= 0:
        return bad
    for b in range(cache.shape[0]):
        p = pos[b] if pos.shape[0] > 1 else pos[0]
        for i in range(cache.shape[1]):
            for t in range(s):
                for j in range(cache.shape[3]):
                    cache[b, i, p + t, j] = new[b, i, t, j]
    return -1


@njit(parallel=True, **_OPT)
def kv_write_rows(cache, table, idx, pos):
    """kv_write(cache, gather(table, idx, axis 2), pos) without the gathered copy: rows idx
    of table [B, pre, t, post] into cache [B, pre, n, post] at pos[b] (or pos[0]) on; a
    negative index counts from the end, as gather's. Returns -1, or 0 when an index or
    position is out of range (nothing written then)."""
    s, t = idx.shape[0], table.shape[2]
    if _overflow(cache, s, pos) >= 0:
        return 0
    for j in range(s):
        if idx[j] < -t or idx[j] >= t:
            return 0
    nb, pre = cache.shape[0], cache.shape[1]
    for r in prange(nb * pre * s):            # rows on every thread: a cold cache is memory-bound
        b, i, j = r // (pre * s), (r // s) % pre, r % s
        src, dst = table[b, i, idx[j] % t], cache[b, i, (pos[b] if pos.shape[0] > 1 else pos[0]) + j]
        for c in range(cache.shape[3]):
            dst[c] = src[c]
    return -1


@njit(**_OPT)
def _overflow(cache, s, pos):
    """-1, or the first row b whose s entries at pos[b] (pos[0] for every row) do not fit."""
    for b in range(cache.shape[0]):
        p = pos[b] if pos.shape[0] > 1 else pos[0]
        if p < 0 or p + s > cache.shape[2]:
            return b
    return -1


@njit(**_OPT)
def rope_kv_write(q, k, v, cos, sin, kc, vc, pos, qr, interleaved):
    """What a decode step's attention reads, made in one call: RoPE of q [B, H, 1, D] into
    qr, RoPE of k straight into the K cache at each row's position, v into the V cache.
    Returns -1, or the first row whose position is outside the cache (nothing written)."""
    bad = _overflow(kc, 1, pos)
    if bad >= 0:
        return bad
    for b in range(q.shape[0]):
        p = pos[b] if pos.shape[0] > 1 else pos[0]
        tb = b if cos.shape[0] > 1 else 0
        c, sn = cos[tb, 0], sin[tb, 0]
        for h in range(q.shape[1]):
            _rope_vec(q[b, h, 0], c, sn, qr[b, h, 0], interleaved)
        for h in range(k.shape[1]):
            _rope_vec(k[b, h, 0], c, sn, kc[b, h, p], interleaved)
            for j in range(v.shape[3]):
                vc[b, h, p, j] = v[b, h, 0, j]
    return -1


@njit(inline="always", **_OPT)
def _gemv_row(x, w, o, n):
    for m in range(x.shape[0]):
        acc = x[m, 0] * w[n, 0]
        for c in range(1, x.shape[1]):
            acc += x[m, c] * w[n, c]
        o[m, n] = acc


@njit(parallel=True, **_OPT)
def gemv_nt_par(x, w, o):
    """o[m, n] = x[m, :] . w[n, :] (w in HF layout [N, K]): one output row per task."""
    for n in prange(w.shape[0]):
        _gemv_row(x, w, o, n)


@njit(**_OPT)
def gemv_nt_ser(x, w, o):
    for n in range(w.shape[0]):
        _gemv_row(x, w, o, n)


@njit(parallel=True, **_OPT)
def gemm_par(x, w, o, parts, gemm, ilp64, trans_a, trans_b):
    """o = op(x) @ op(w) (f32, C order; x [K, M] when trans_a, w [N, K] when trans_b): N split
    in `parts`, each one cblas_sgemm call at address gemm on a numba thread (cblas.py says
    why not BLAS's own threads)."""
    n = o.shape[1]
    for p in prange(parts):
        c0, c1 = n * p // parts, n * (p + 1) // parts
        if trans_b:
            sgemm(gemm, ilp64, x, w[c0:c1], o[:, c0:c1], trans_a, True)
        else:
            sgemm(gemm, ilp64, x, w[:, c0:c1], o[:, c0:c1], trans_a, False)


@njit(parallel=True, **_OPT)
def gemm_rows_par(x, w, o, parts, gemm, ilp64, trans_b):
    """o = x @ op(w) as gemm_par, but M split in `parts`: for a product with more rows than
    columns (an encoder's 16 x 257 tokens by 384 to 1536 columns). Each call packs all of
    the weight and its share of x, where a column split packs all of x in every part: the
    smaller operand is the one packed twice (DINOv2-S's four products on 2 loaded cores,
    medians of 12: 20-35% less time than the column split)."""
    m = o.shape[0]
    for p in prange(parts):
        r0, r1 = m * p // parts, m * (p + 1) // parts
        sgemm(gemm, ilp64, x[r0:r1], w, o[r0:r1], False, trans_b)


# --------------------------------------------------------------------------- copy (a yardstick)
@njit(parallel=True, **_OPT)
def copy_par(src, dst):
    """dst[:] = src[:] on every thread: the memory bandwidth this backend's kernels can reach."""
    for i in prange(src.shape[0]):
        dst[i] = src[i]


__all__ = [n for n in dir() if n.endswith(("_par", "_ser"))]
