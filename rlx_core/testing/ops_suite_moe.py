"""The op parity suite's cases for rlx_core.ir.moe's ops (pulled into ops_suite): each op
against an independent float64 reference on the kit's backends.

The references loop over tokens and their chosen experts in float64, as the math reads; the
kernels group tokens by expert and the composites run every expert on every token, so
neither shares a line with them."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir.dtype import F16, F32, I32, I64, U8

from .suite_base import SCHEMES, covers, fdtype
from .parity import REF_ACT, Arg, arg, exact, run_parity

ROUTERS = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]
ROUTER_IDS = ["softmax_topk", "softmax_topk-normalize", "topk_softmax"]


# ----------------------------------------------------------------------------- references
def _softmax64(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _ranked(values, k):
    """The k largest of a row, largest first, the lowest index first on ties."""
    return sorted(range(len(values)), key=lambda e: (-values[e], e))[:k]


def ref_moe_route(logits, k, order, normalize):
    z = np.asarray(logits, np.float64)
    rows = z.reshape(-1, z.shape[-1])
    ws, ids = np.zeros((len(rows), k)), np.zeros((len(rows), k), np.int64)
    for t, row in enumerate(rows):
        if order == "topk_softmax":
            ids[t] = _ranked(row, k)
            ws[t] = _softmax64(row[ids[t]])
        else:
            p = _softmax64(row)
            ids[t] = _ranked(p, k)
            ws[t] = p[ids[t]] / (p[ids[t]].sum() if normalize else 1.0)
    lead = z.shape[:-1] + (k,)
    return ws.reshape(lead), ids.reshape(lead)


def ref_moe_experts(x, weights, ids, gate, up, down, act="silu", magnitude=False):
    """y[t] = sum_j w[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, j];
    with `magnitude`, the same sum over absolute values (what rounding errors scale with)."""
    f = (lambda v: np.abs(v)) if magnitude else (lambda v: v)
    xs = x.reshape(-1, x.shape[-1])
    wf, idf = weights.reshape(len(xs), -1), ids.reshape(len(xs), -1)
    y = np.zeros_like(xs, dtype=np.float64)
    for t in range(len(xs)):
        for w, e in zip(wf[t], idf[t]):
            inner = f(REF_ACT[act](gate[e] @ xs[t])) * f(up[e] @ xs[t])
            y[t] += f(w) * (f(down[e]) @ inner if magnitude else down[e] @ inner)
    return y.reshape(x.shape)


# ----------------------------------------------------------------------------- inputs
def separated_logits(rng, lead, experts, dtype, ties=True):
    """Router logits, each row a shuffle of distinct steps of 0.5 (exact in every float
    dtype, so no rounding of the softmax reorders them); with `ties`, the first row's two
    largest equal and its third and fourth too (the lowest id must win each tie)."""
    n = int(np.prod(lead))
    z = np.stack([rng.permutation(experts) for _ in range(n)]) * 0.5 - 2.0
    if ties and experts >= 4:
        order = np.argsort(-z[0])
        z[0, order[1]] = z[0, order[0]]
        z[0, order[3]] = z[0, order[2]]
    return Arg("logits", exact(z.reshape(tuple(lead) + (experts,)), dtype), dtype)


def uneven_ids(rng, tokens, k, experts, dtype=I64):
    """Distinct experts per token with an uneven load: expert 0 in most tokens, the last
    two experts (when k leaves room) in none."""
    usable = experts - 2 if experts - 2 > k else experts
    rows = []
    for _ in range(tokens):
        rest = list(rng.permutation(np.arange(1, usable)))
        first = [0] if rng.random() < 0.8 or k == usable else []
        rows.append((first + rest)[:k] if first else rest[:k])
    return Arg("ids", np.array(rows, dtype.np), dtype)


def expert_args(rng, dims, dtype, schemes=("", "", "")):
    """gate, up [E, I, H] and down [E, H, I] as Args: dense in `dtype`, or packed u8 stacks
    of fresh random weights for the stacks with a scheme. Returns (args, float64 stacks)."""
    from rlx_core.ir.quant import QuantScheme

    e, i, h = dims
    out, dense = [], []
    for name, shp, sch in zip(("gate", "up", "down"), ((e, i, h), (e, i, h), (e, h, i)), schemes):
        w = rng.uniform(-1, 1, shp) / np.sqrt(shp[-1])
        if sch:
            q = QuantScheme.parse(sch)
            raw = q.quantize(w.astype(np.float32)).reshape(shp[0], shp[1], -1)
            out.append(Arg(name, raw, U8))
            dense.append(q.dequantize_reference(raw.reshape(-1, raw.shape[-1]), shp))
        else:
            out.append(Arg(name, exact(w, dtype), dtype))
            dense.append(out[-1].data)
    return out, dense


def run_experts(backend, rng, dtype, tokens, k, dims, schemes=("", "", ""), act="silu", ids_dtype=I64):
    x = arg(rng, "x", tuple(tokens) + (dims[2],), dtype, lo=-1, hi=1)
    n = int(np.prod(tokens))
    ids = uneven_ids(rng, n, k, dims[0], ids_dtype)
    ids = Arg("ids", ids.data.reshape(tuple(tokens) + (k,)), ids_dtype)
    w = arg(rng, "weights", tuple(tokens) + (k,), dtype, lo=0.1, hi=1.0)
    stacks, dense = expert_args(rng, dims, dtype, schemes)

    g, u, d = dense

    def ref(x_, w_, ids_, *_):              # (the packed stacks as their float64 decode)
        return ref_moe_experts(x_, w_, ids_, g, u, d, act=act)

    def magnitude(x_, w_, ids_, *_):
        return np.abs(ref_moe_experts(x_, w_, ids_, g, u, d, act=act, magnitude=True)).max()

    return run_parity(backend, "moe_experts", [x, w, ids] + stacks, {"act": act, "schemes": tuple(schemes)},
                      ref, magnitude=magnitude)


# ----------------------------------------------------------------------------- moe_route
@covers("moe_route")
@fdtype
@pytest.mark.parametrize("order,normalize", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("k", [1, 2, 8], ids=lambda k: f"k{k}")
def test_moe_route(backend, rng, dt, order, normalize, k):
    """Each router variant, k = 1, 2 and E; ties broken towards the lowest expert id."""
    logits = separated_logits(rng, (5,), 8, dt)
    run_parity(backend, "moe_route", [logits], {"k": k, "order": order, "normalize": normalize},
               lambda z: ref_moe_route(z, k, order, normalize))


@pytest.mark.parametrize("order,normalize", ROUTERS, ids=ROUTER_IDS)
def test_moe_route_batched_tokens(backend, rng, order, normalize):
    """Tokens as [batch, seq]: the leading dims are all tokens."""
    logits = separated_logits(rng, (2, 3), 6, F32)
    run_parity(backend, "moe_route", [logits], {"k": 2, "order": order, "normalize": normalize},
               lambda z: ref_moe_route(z, 2, order, normalize))


# ----------------------------------------------------------------------------- moe_experts
@covers("moe_experts")
@fdtype
@pytest.mark.parametrize("k", [1, 2, 6], ids=lambda k: f"k{k}")
def test_moe_experts_dense(backend, rng, dt, k):
    """Dense stacks; uneven load (expert 0 in most tokens, two experts in none unless k = E)."""
    run_experts(backend, rng, dt, (7,), k, (6, 12, 8))


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_tanh"])
def test_moe_experts_activation(backend, rng, act):
    run_experts(backend, rng, F32, (5,), 2, (4, 6, 8), act=act)


def test_moe_experts_batched_tokens_i32_ids(backend, rng):
    """x [batch, seq, H] with i32 ids: the leading dims are the tokens."""
    run_experts(backend, rng, F32, (2, 3), 2, (5, 6, 8), ids_dtype=I32)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_moe_experts_packed(backend, rng, scheme):
    """All three stacks packed (GGUF's ffn_*_exps), H and I each one block of the scheme."""
    from rlx_core.ir.quant import QuantScheme

    b = QuantScheme.parse(scheme).block_size
    run_experts(backend, rng, F32, (4,), 2, (4, b, b), schemes=(scheme,) * 3)


@pytest.mark.parametrize("dt", [F16, F32], ids=lambda d: d.value)
def test_moe_experts_packed_and_dense(backend, rng, dt):
    """Gate and up packed in different schemes, down dense in x's dtype."""
    run_experts(backend, rng, dt, (5,), 2, (4, 32, 64), schemes=("q8_0", "q4_0", ""))


__all__ = [n for n in dir() if n.startswith("test_")]
