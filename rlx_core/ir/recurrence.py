"""Linear recurrences of state-space and linear-attention layers, written with `scan`: they
run on every backend that runs scan, and reverse-mode AD reaches them through scan's VJP.

selective_scan (Mamba, Gu & Dao 2023; mamba_ssm's selective_scan_ref), per batch b, step t,
channel d, state n:
    h[d, n] = exp(delta[t, d] * A[d, n]) * h[d, n] + delta[t, d] * B[t, n] * u[t, d]
    y[t, d] = sum_n C[t, n] * h[d, n]  (+ D[d] * u[t, d])  (* silu(z[t, d]))
delta is taken as given (Mamba applies softplus(delta + bias) before the scan).

gated_delta_rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks:
Improving Mamba2 with Delta Rule"; the recurrent form of transformers'
torch_recurrent_gated_delta_rule), per batch b, head h, step t, state S [K, V]:
    S = exp(g[t]) * S                                (gated decay; g <= 0 is a log-gate)
    S = S + k[t] (beta[t] * (v[t] - S^T k[t]))^T     (the delta rule: write the correction)
    o[t] = S^T (scale * q[t])                        (scale defaults to 1 / sqrt(K))
i.e. S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t k_t v_t^T with alpha_t = exp(g_t)
in the key-major layout. q and k are used as given (models L2-normalize them first where they need it).
"""
from __future__ import annotations

import math

from .errors import ShapeError


def _check(op: str, named: dict, want: dict, dtype) -> None:
    """Each argument's dims against the expected (symbols allowed) and its dtype against `dtype`."""
    for name, v in named.items():
        if v is None:
            continue
        dims = want[name]
        if v.dtype is not dtype:
            raise ShapeError(f"{op}: {name} is {v.shape}, expected dtype {dtype.value} (like the first input)")
        if len(v.dims) != len(dims) or any(a != b for a, b in zip(v.dims, dims)):
            raise ShapeError(f"{op}: {name} is {v.shape}, expected dims {tuple(dims)}")


def _time_major(m, x):
    return m.transpose(x, (1, 0) + tuple(range(2, x.shape.rank)))


def _zeros(m, dims, dtype):
    return m.expand(m.constant(0.0, dtype), dims)


def selective_scan(m, u, delta, A, B, C, D=None, z=None, h0=None) -> tuple:
    """Mamba's selective scan: u, delta [batch, L, d]; A [d, n]; B, C [batch, L, n]; D [d];
    z [batch, L, d]; h0 [batch, d, n] (zeros if None). Returns (y [batch, L, d], h [batch, d, n])."""
    if u.shape.rank != 3 or A.shape.rank != 2:
        raise ShapeError(f"selective_scan: u must be [batch, L, d] and A [d, n], got u {u.shape}, A {A.shape}")
    b, length, d = u.dims
    n = A.dims[1]
    _check("selective_scan", dict(delta=delta, A=A, B=B, C=C, D=D, z=z, h0=h0),
           dict(delta=u.dims, A=(d, n), B=(b, length, n), C=(b, length, n), D=(d,), z=u.dims, h0=(b, d, n)),
           u.dtype)

    def step(s, a, h, u_t, dt_t, b_t, c_t):
        decay = s.exp(s.reshape(dt_t, (b, d, 1)) * a)
        h = decay * h + s.reshape(dt_t * u_t, (b, d, 1)) * s.reshape(b_t, (b, 1, n))
        return h, s.sum(h * s.reshape(c_t, (b, 1, n)), (2,))

    (h,), (ys,) = m.scan(step, init=(h0 if h0 is not None else _zeros(m, (b, d, n), u.dtype),),
                         xs=tuple(_time_major(m, x) for x in (u, delta, B, C)), consts=(A,))
    y = _time_major(m, ys)
    if D is not None:
        y = y + u * D
    if z is not None:
        y = y * m.silu(z)
    return y, h


def gated_delta_rule(m, q, k, v, g, beta, scale: float | None = None, s0=None) -> tuple:
    """Gated DeltaNet's recurrence: q, k [batch, L, heads, K]; v [batch, L, heads, V]; g
    (log-decay) and beta [batch, L, heads]; s0 [batch, heads, K, V] (zeros if None).
    Returns (o [batch, L, heads, V], S [batch, heads, K, V])."""
    if q.shape.rank != 4 or v.shape.rank != 4:
        raise ShapeError(f"gated_delta_rule: q must be [batch, L, heads, K] and v [batch, L, heads, V], "
                         f"got q {q.shape}, v {v.shape}")
    b, length, h, kd = q.dims
    vd = v.dims[3]
    _check("gated_delta_rule", dict(k=k, v=v, g=g, beta=beta, s0=s0),
           dict(k=q.dims, v=(b, length, h, vd), g=(b, length, h), beta=(b, length, h), s0=(b, h, kd, vd)),
           q.dtype)
    scale = 1.0 / math.sqrt(kd) if scale is None else float(scale)

    def step(s, state, q_t, k_t, v_t, g_t, beta_t):
        col = s.reshape(k_t, (b, h, kd, 1))
        state = state * s.reshape(s.exp(g_t), (b, h, 1, 1))
        delta = (v_t - s.sum(state * col, (2,))) * s.reshape(beta_t, (b, h, 1))
        state = state + col * s.reshape(delta, (b, h, 1, vd))
        return state, s.sum(state * s.reshape(q_t * scale, (b, h, kd, 1)), (2,))

    (state,), (o,) = m.scan(step, init=(s0 if s0 is not None else _zeros(m, (b, h, kd, vd), q.dtype),),
                            xs=tuple(_time_major(m, x) for x in (q, k, v, g, beta)))
    return _time_major(m, o), state


__all__ = ["selective_scan", "gated_delta_rule"]
