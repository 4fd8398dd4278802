"""Linear-attention layers' fused ops (Gated DeltaNet and its hybrid models):

  gated_delta_rule  the gated delta rule over a sequence from a state, as one op: prefill in
                    the chunked (WY) form, one step the recurrent form; its composite is the
                    scan of rlx_core.ir.recurrence (the definition the kernels are tested on).
  causal_conv1d     the short depthwise causal convolution before q/k/v, from a state of the
                    inputs before this call.
  gated_delta_net   a Gated DeltaNet layer between its projections, as one op: the short conv
                    (silu) of q|k|v, l2norm of q and k, the gates from their logits
                    (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), the rule, the
                    gated RMSNorm rms_norm(o) w silu(z); its composite is those ops (the
                    definition; in f32 for 16-bit data), a kernel runs a decode step of all of
                    it in one launch.

All return their new state(s) beside the output; a decode graph writes it back into its
`state` leaf with `assign`, so a step reads and writes the state where it lives.
"""
from __future__ import annotations

import numpy as np

from .composites import composite, ex, iota
from .dtype import BF16, F16, F32
from .errors import DTypeError, ShapeError
from .numpy_kernels import ACT as ACT_FN, KERNELS, put, up
from .ops import ACT, COUNT, EPS, FLOAT, Level, _float, _same_dim, op
from .recurrence import gated_delta_rule as delta_scan
from .shape import Shape


def _like(t: Shape, ref: Shape, dims: tuple, what: str) -> None:
    if t.dtype is not ref.dtype:
        raise DTypeError(f"{what} is {t.dtype.value}, expected {ref.dtype.value} (like the first input)")
    if t.rank != len(dims):
        raise ShapeError(f"{what} must have dims {tuple(dims)}, got {t}")
    for a, b in zip(t.dims, dims):
        _same_dim(a, b, f"{what} dims {t.dims} vs expected {tuple(dims)}")


@op("gated_delta_rule", ["q", "k", "v", "g", "beta", "state"], Level.FUSED, n_outputs=2,
    attrs={"scale": FLOAT, "chunk": COUNT(64)})
def _m_gated_delta_rule(s, a):
    """Gated DeltaNet over T steps (rlx_core.ir.recurrence.gated_delta_rule's math): q, k
    [B, T, Hk, K]; v [B, T, H, V] with H a multiple of Hk (value head h reads key head
    h // (H / Hk), transformers' repeat_interleave); g (log-decay, <= 0) and beta [B, T, H];
    state [B, H, K, V] before step 0. -> (o [B, T, H, V], the state after step T-1).
    `chunk`: the chunk length of the chunked form (a kernel's tuning; results agree within
    rounding for any chunk)."""
    q, k, v, g, beta, st = s
    _float(q, "gated_delta_rule")
    if q.rank != 4 or v.rank != 4:
        raise ShapeError(f"gated_delta_rule q must be [batch, T, key heads, K] and v [batch, T, heads, V], "
                         f"got q {q}, v {v}")
    b, t, hk, kd = q.dims
    h, vd = v.dims[2], v.dims[3]
    _like(k, q, q.dims, "gated_delta_rule k")
    _like(v, q, (b, t, h, vd), "gated_delta_rule v")
    _like(g, q, (b, t, h), "gated_delta_rule g")
    _like(beta, q, (b, t, h), "gated_delta_rule beta")
    _like(st, q, (b, h, kd, vd), "gated_delta_rule state")
    if isinstance(h, int) and isinstance(hk, int) and (hk == 0 or h % hk):
        raise ShapeError(f"gated_delta_rule: {h} value heads is not a multiple of {hk} key heads")
    if a["chunk"] < 1:
        raise ShapeError(f"gated_delta_rule chunk={a['chunk']}: expected >= 1")
    return (Shape((b, t, h, vd), q.dtype), st)


@op("causal_conv1d", ["x", "w", "state", "bias?"], Level.FUSED, n_outputs=2,
    attrs={"act": ACT("identity")})
def _m_causal_conv1d(s, a):
    """Depthwise causal convolution over time, channels last: x [B, T, C]; w [C, W] (channel
    c's taps, oldest first: HF's Conv1d weight [C, 1, W] squeezed); state [B, C, W - 1], the
    W - 1 inputs before x (zeros at the start of a sequence); bias [C].
    y[b, t, c] = act(bias[c] + sum_i w[c, i] * u[b, t + i, c]) with u = state's steps then x.
    -> (y [B, T, C], the new state [B, C, W - 1]: the last W - 1 steps of u)."""
    x, w, st = s[:3]
    _float(x, "causal_conv1d")
    if x.rank != 3 or w.rank != 2:
        raise ShapeError(f"causal_conv1d x must be [batch, T, channels] and w [channels, width], "
                         f"got x {x}, w {w}")
    b, _, c = x.dims
    width = w.dims[1]
    if isinstance(width, str) or width < 1:
        raise ShapeError(f"causal_conv1d needs a static width >= 1, got w {w}")
    _like(w, x, (c, width), "causal_conv1d w")
    _like(st, x, (b, c, width - 1), "causal_conv1d state")
    if len(s) > 3:
        _like(s[3], x, (c,), "causal_conv1d bias")
    return (Shape(x.dims, x.dtype), st)


def net_heads(x: Shape, state: Shape) -> tuple:
    """(key heads, K, value heads, V) of a gated_delta_net call: V, H and K from the state
    [B, H, K, V]; the key heads from x's channels, 2 Hk K (q, k) + H V (v)."""
    h, kd, vd = state.dims[1], state.dims[2], state.dims[3]
    c = x.dims[2]
    if not all(isinstance(d, int) for d in (c, h, kd, vd)):
        raise ShapeError(f"gated_delta_net needs static channels and state dims, got x {x}, state {state}")
    qk = c - h * vd
    if kd < 1 or qk <= 0 or qk % (2 * kd) or h % (qk // (2 * kd)):
        raise ShapeError(f"gated_delta_net: x's {c} channels are not q and k of key heads of K = {kd} "
                         f"(a divisor of the {h} value heads) then v of {h} heads of V = {vd}")
    return qk // (2 * kd), kd, h, vd


@op("gated_delta_net", ["x", "conv_w", "conv_state", "z", "b", "a", "A_log", "dt_bias", "norm_w", "state"],
    Level.FUSED, n_outputs=3, attrs={"scale": FLOAT, "eps": EPS(1e-6), "chunk": COUNT(64)})
def _m_gated_delta_net(s, a):
    """A Gated DeltaNet layer between its in- and out-projections (flash-linear-attention's
    GatedDeltaNet, the linear attention of hybrid models): x [B, T, C] the projected
    q|k|v (C = 2 Hk K + H V) before the short conv; conv_w [C, W], conv_state [B, C, W - 1]
    (causal_conv1d's, silu); z [B, T, H, V] the output gate; b, a [B, T, H] the logits of beta
    and of the decay; A_log, dt_bias [H]; norm_w [V] the gated RMSNorm's weight (eps); state
    [B, H, K, V] the rule's. q and k are L2-normalized (eps 1e-6), scaled q by `scale`.
    -> (rms_norm(o) norm_w silu(z) [B, T, H, V], the new conv state, the new state)."""
    x, w, cst, z, b_, a_, alog, dtb, nw, st = s
    _float(x, "gated_delta_net")
    if x.rank != 3 or st.rank != 4 or w.rank != 2:
        raise ShapeError(f"gated_delta_net x must be [batch, T, channels], conv_w [channels, width] and "
                         f"state [batch, heads, K, V], got x {x}, conv_w {w}, state {st}")
    bt, t, c = x.dims
    _, kd, h, vd = net_heads(x, st)
    width = w.dims[1]
    if isinstance(width, str) or width < 1:
        raise ShapeError(f"gated_delta_net needs a static conv width >= 1, got conv_w {w}")
    _like(w, x, (c, width), "gated_delta_net conv_w")
    _like(cst, x, (bt, c, width - 1), "gated_delta_net conv_state")
    _like(z, x, (bt, t, h, vd), "gated_delta_net z")
    _like(b_, x, (bt, t, h), "gated_delta_net b")
    _like(a_, x, (bt, t, h), "gated_delta_net a")
    _like(alog, x, (h,), "gated_delta_net A_log")
    _like(dtb, x, (h,), "gated_delta_net dt_bias")
    _like(nw, x, (vd,), "gated_delta_net norm_w")
    _like(st, x, (bt, h, kd, vd), "gated_delta_net state")
    if a["chunk"] < 1:
        raise ShapeError(f"gated_delta_net chunk={a['chunk']}: expected >= 1")
    return (Shape(z.dims, x.dtype), cst, st)


# ----------------------------------------------------------------- NumPy kernels
# The chunked (WY / UT) form of flash-linear-attention's chunk_gated_delta_rule. Within a
# chunk of c steps from state S0, with gamma_i = exp(cum_i) (cum: the chunk's cumulative
# log-decay) and u_i the delta each step writes (S_i = alpha_i S_{i-1} + k_i u_i^T):
#     u_i + sum_{j<i} A_ij u_j = beta_i (v_i - gamma_i S0^T k_i),
#     A_ij = beta_i (k_i . k_j) gamma_i / gamma_j                   (strictly lower),
# so U = (I + A)^-1 V_beta - (I + A)^-1 W S0 with W = beta gamma K: (I + A)^-1 and both
# products need no state, so they are made for all chunks at once before the one
# sequential loop over chunks, which takes U and then
#     o_i = gamma_i S0^T q_i + sum_{j<=i} (q_i . k_j) gamma_i / gamma_j u_j
#     S_c = gamma_c S0 + sum_j (gamma_c / gamma_j) k_j u_j^T.
# Every exponent is a difference cum_i - cum_j <= 0 (j <= i) or cum_i <= 0: no overflow for
# any g <= 0, and a strongly negative g underflows to the decay it means.
def heads_major(x, times: int = 1):
    """[B, T, Hk, D] -> [B, Hk * times, T, D], each head repeated `times` times in place."""
    return np.repeat(x, times, axis=2).transpose(0, 2, 1, 3) if times > 1 else x.transpose(0, 2, 1, 3)


def _lower_solve(a, rhs):
    """X with (I + a) X = rhs, a strictly lower [.., c, c]: forward substitution, row by row."""
    x = rhs.copy()
    for i in range(1, a.shape[-1]):
        x[..., i, :] -= (a[..., i:i + 1, :i] @ x[..., :i, :])[..., 0, :]
    return x


def _pairwise_decay(cum):
    """exp(cum_i - cum_j) where j <= i, else 0: [.., c] -> [.., c, c]."""
    c = cum.shape[-1]
    keep = np.tril(np.ones((c, c), bool))
    with np.errstate(over="ignore", invalid="ignore"):
        diff = cum[..., :, None] - cum[..., None, :]
    return np.exp(np.where(keep, diff, -np.inf))


def delta_chunked(q, k, v, g, beta, s, chunk: int) -> tuple:
    """The gated delta rule, heads-major: q, k [B, H, T, K] (q scaled), v [B, H, T, V],
    g, beta [B, H, T], s [B, H, K, V] -> (o [B, H, T, V], the final state)."""
    b, h, t, kd = q.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t                    # padded steps: g = beta = k = 0 leave the state as it is

    def chunks(x):
        x = np.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)) if pad else x
        return x.reshape((b, h, n, c) + x.shape[3:])
    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = np.cumsum(g, axis=-1)
    gamma = np.exp(cum)
    within = _pairwise_decay(cum)                    # [B, H, N, c, c]
    kt = np.swapaxes(k, -1, -2)
    a = np.tril((beta[..., None] * (k @ kt)) * within, -1)
    attn = (q @ kt) * within
    # (I + A)^-1 V_beta and (I + A)^-1 W: the values' part and the part the chunk's start state scales
    inv = _lower_solve(a, np.broadcast_to(np.eye(c, dtype=a.dtype), a.shape))
    u0, w = inv @ (beta[..., None] * v), inv @ ((beta * gamma)[..., None] * k)
    vd = v.shape[-1]
    qg = q * gamma[..., None]
    tail = np.exp(cum[..., -1:] - cum)[..., None] * k               # gamma_c / gamma_j k_j
    o = np.empty_like(v)
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ s
        o[:, :, i] = qg[:, :, i] @ s + attn[:, :, i] @ u
        s = s * gamma[:, :, i, -1, None, None] + np.swapaxes(tail[:, :, i], -1, -2) @ u
    return o.reshape(b, h, n * c, vd)[:, :, :t], s


def delta_step(q, k, v, g, beta, s) -> tuple:
    """One step of the recurrence, heads-major [B, H, D] (q scaled): decode's form."""
    s = s * np.exp(g)[..., None, None]
    u = beta[..., None] * (v - np.einsum("bhk,bhkv->bhv", k, s))
    s = s + k[..., :, None] * u[..., None, :]
    return np.einsum("bhk,bhkv->bhv", q, s), s


def _k_gated_delta_rule(a, out, q, k, v, g, beta, state):
    times = v.shape[2] // q.shape[2]
    q, k, v, g, beta, s = (up(x) for x in (q, k, v, g, beta, state))
    q = heads_major(q * q.dtype.type(a["scale"]), times)
    k, v = heads_major(k, times), heads_major(v)
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)
    if q.shape[2] == 1:
        o, s = delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], s)
        o = o[:, :, None]
    else:
        o, s = delta_chunked(q, k, v, g, beta, s, a["chunk"])
    put(out[0], o.transpose(0, 2, 1, 3))
    put(out[1], s)


def _k_causal_conv1d(a, out, x, w, state, bias=None):
    t, width = x.shape[1], w.shape[1]
    u = np.concatenate([up(state).transpose(0, 2, 1), up(x)], axis=1)        # [B, W - 1 + T, C]
    w = up(w)
    y = u[:, :t] * w[:, 0]
    tap = np.empty_like(y)                          # one scratch for the taps after the first
    for i in range(1, width):
        y += np.multiply(u[:, i:i + t], w[:, i], out=tap)
    if bias is not None:
        y = y + up(bias)
    put(out[0], ACT_FN[a["act"]](y))
    put(out[1], u[:, u.shape[1] - (width - 1):].transpose(0, 2, 1))


# gated_delta_net has no NumPy kernel: the NumPy and numba backends run its composite (numba's
# conv and rule kernels then write their states in place)
KERNELS.update({"gated_delta_rule": _k_gated_delta_rule, "causal_conv1d": _k_causal_conv1d})


# ----------------------------------------------------------------- composites
L2_EPS = 1e-6        # l2norm's eps (flash-linear-attention's and HF's)


def l2norm(m, x, eps: float = L2_EPS):
    """x * rsqrt(sum(x^2, last axis) + eps) (flash-linear-attention's and HF's l2norm)."""
    last = x.shape.rank - 1
    return x * m.act(m.sum(x * x, (last,), keepdims=True) + eps, "rsqrt")


def softplus(m, x):
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)): no overflow for large x."""
    return m.maximum(x, 0.0) + m.act(m.act(-m.act(x, "abs"), "exp") + 1.0, "log")


def decay_gate(m, a, a_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias): a Gated DeltaNet's log-decay from its logits
    (a [.., H], A_log and dt_bias broadcast over its last axis)."""
    return -m.exp(a_log) * softplus(m, a + dt_bias)


def gated_rms_norm(m, x, w, z, eps: float):
    """w * rms_norm(x) * silu(z): the gated RMSNorm of Gated DeltaNet's output (norm first)."""
    return m.rms_norm(x, w, eps=eps) * m.act(z, "silu")


def repeat_heads(m, x, times: int):
    """[B, T, Hk, K] -> [B, T, Hk * times, K], each head repeated `times` times in place
    (torch's repeat_interleave on dim 2)."""
    if times == 1:
        return x
    b, t, hk, kd = x.dims
    return m.reshape(m.expand(m.reshape(x, (b, t, hk, 1, kd)), (b, t, hk, times, kd)),
                     (b, t, hk * times, kd))


@composite("gated_delta_rule", ex("f32[1,3,2,4]", "f32[1,3,2,4]", "f32[1,3,4,5]", "f32[1,3,4]",
                                  "f32[1,3,4]", "f32[1,4,4,5]", scale=0.5))
def _gated_delta_rule(m, ins, a):
    q, k, v, g, beta, state = ins
    times = v.dims[2] // q.dims[2]
    q, k = (repeat_heads(m, t, times) for t in (q, k))
    return delta_scan(m, q, k, v, g, beta, a["scale"], state)


@composite("causal_conv1d", ex("f32[1,seq,3]", "f32[3,4]", "f32[1,3,3]"),
           ex("f32[2,5,3]", "f32[3,4]", "f32[2,3,3]", "f32[3]", act="silu"))
def _causal_conv1d(m, ins, a):
    x, w, state = ins[:3]
    b, t, c = x.dims
    width = w.dims[1]
    u = m.concat([m.transpose(state, (0, 2, 1)), x], 1)          # [B, W - 1 + T, C]
    steps = iota(m, t, x)
    y = None
    for i in range(width):
        tap = m.gather(u, steps + i, 1) * m.reshape(m.narrow(w, 1, i, 1), (c,))
        y = tap if y is None else y + tap
    if len(ins) > 3:
        y = y + ins[3]
    new_state = m.transpose(m.narrow(u, 1, -(width - 1), width - 1), (0, 2, 1)) if width > 1 else state
    return m.act(y, a["act"]), new_state


@composite("gated_delta_net", ex("f32[1,seq,12]", "f32[12,4]", "f32[1,12,3]", "f32[1,seq,2,4]", "f32[1,seq,2]",
                                 "f32[1,seq,2]", "f32[2]", "f32[2]", "f32[4]", "f32[1,2,2,4]", scale=0.5))
def _gated_delta_net(m, ins, a):
    """Its ops, in f32 for f16 / bf16 data with each output rounded once, as the kernels compute
    (ops rounding each of the ~10 steps to bf16, the decay gate and the carried state among
    them, put a whole row of o off by up to 40% of the output's largest value in 2% of random
    draws at 37 tokens: where the rule's sums cancel, the gated norm scales their rounding up)."""
    dt = ins[0].dtype
    if dt in (F16, BF16):
        outs = _gated_delta_net(m, [m.cast(t, F32) for t in ins], a)
        return tuple(m.cast(t, dt) for t in outs)
    x, w, cst, z, b, alpha, a_log, dt_bias, norm_w, state = ins
    hk, kd, h, vd = net_heads(x.shape, state.shape)
    bt, t = x.dims[0], x.dims[1]
    y, new_cst = m.add("causal_conv1d", (x, w, cst), act="silu")
    q, k = (l2norm(m, m.reshape(m.narrow(y, 2, i * hk * kd, hk * kd), (bt, t, hk, kd))) for i in (0, 1))
    v = m.reshape(m.narrow(y, 2, 2 * hk * kd, h * vd), (bt, t, h, vd))
    g = decay_gate(m, alpha, a_log, dt_bias)
    o, new_state = m.add("gated_delta_rule", (q, k, v, g, m.act(b, "sigmoid"), state), scale=a["scale"],
                         chunk=a["chunk"])
    return gated_rms_norm(m, o, norm_w, z, a["eps"]), new_cst, new_state


__all__ = ["L2_EPS", "decay_gate", "delta_chunked", "delta_step",
           "gated_rms_norm", "heads_major", "l2norm", "net_heads", "repeat_heads", "softplus"]
