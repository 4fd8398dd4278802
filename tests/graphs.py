"""Standard transformer blocks written with the HIR builder, and random params for them,
shared by the fusion and planner tests."""
from __future__ import annotations

import math

import attrs
import numpy as np
from hypothesis import strategies as st

from rlx_core.ir.graph import Graph


@attrs.frozen
class Cfg:
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 48
    layers: int = 2
    vocab: int = 50
    eps: float = 1e-6
    rot: int = 8             # rotary dims (R <= head_dim)
    style: str = "half"
    batch: object = 1        # an int or a symbol name
    seq: object = "seq"


def _heads(m, x, n, cfg):
    b, s = cfg.batch, cfg.seq
    return m.transpose(m.reshape(x, (b, s, n, cfg.head_dim)), (0, 2, 1, 3))


def llama_layer(m, x, i: int, cfg: Cfg, cos, sin, prefix="model.layers."):
    """Pre-norm LLaMA layer: RMSNorm, q/k/v projections, RoPE, causal GQA attention,
    o projection, residual, RMSNorm, SwiGLU MLP, residual."""
    pre = f"{prefix}{i}."
    d, hd = cfg.hidden, cfg.head_dim
    p = lambda name, shape: m.param(pre + name, shape)  # noqa: E731
    h = m.rms_norm(x, p("input_layernorm.weight", (d,)), eps=cfg.eps)
    q = _heads(m, m.linear(h, p("self_attn.q_proj.weight", (cfg.heads * hd, d))), cfg.heads, cfg)
    k = _heads(m, m.linear(h, p("self_attn.k_proj.weight", (cfg.kv_heads * hd, d))), cfg.kv_heads, cfg)
    v = _heads(m, m.linear(h, p("self_attn.v_proj.weight", (cfg.kv_heads * hd, d))), cfg.kv_heads, cfg)
    q, k = m.rope(q, cos, sin, cfg.style), m.rope(k, cos, sin, cfg.style)
    a = m.attention(q, k, v, mask_kind="causal")
    a = m.reshape(m.transpose(a, (0, 2, 1, 3)), (cfg.batch, cfg.seq, cfg.heads * hd))
    x = x + m.linear(a, p("self_attn.o_proj.weight", (d, cfg.heads * hd)))
    h = m.rms_norm(x, p("post_attention_layernorm.weight", (d,)), eps=cfg.eps)
    return x + m.swiglu(h, p("mlp.gate_proj.weight", (cfg.ffn, d)), p("mlp.up_proj.weight", (cfg.ffn, d)),
                        p("mlp.down_proj.weight", (d, cfg.ffn)))


def llama(cfg: Cfg = Cfg(), name="llama") -> Graph:
    """Token ids [B,S] + RoPE tables [S,R/2] -> logits, through `cfg.layers` layers."""
    def fn(m):
        ids = m.input("ids", (cfg.batch, cfg.seq), "i64")
        cos = m.input("cos", (cfg.seq, cfg.rot // 2))
        sin = m.input("sin", (cfg.seq, cfg.rot // 2))
        x = m.gather(m.param("model.embed_tokens.weight", (cfg.vocab, cfg.hidden)), ids)
        for i in range(cfg.layers):
            x = llama_layer(m, x, i, cfg, cos, sin)
        x = m.rms_norm(x, m.param("model.norm.weight", (cfg.hidden,)), eps=cfg.eps)
        return {"logits": m.linear(x, m.param("lm_head.weight", (cfg.vocab, cfg.hidden)))}
    return Graph.define(name, fn)


def bert_layer(m, x, i: int, cfg: Cfg, prefix="encoder.layer."):
    """Post-norm BERT layer: biased q/k/v, bidirectional attention, residual + LayerNorm,
    biased GELU FFN, residual + LayerNorm."""
    pre = f"{prefix}{i}."
    d, hd = cfg.hidden, cfg.head_dim
    p = lambda name, shape: m.param(pre + name, shape)  # noqa: E731

    def lin(t, name, o, i_):
        return m.linear(t, p(name + ".weight", (o, i_)), p(name + ".bias", (o,)))
    q = _heads(m, lin(x, "attention.self.query", cfg.heads * hd, d), cfg.heads, cfg)
    k = _heads(m, lin(x, "attention.self.key", cfg.heads * hd, d), cfg.heads, cfg)
    v = _heads(m, lin(x, "attention.self.value", cfg.heads * hd, d), cfg.heads, cfg)
    a = m.attention(q, k, v, mask_kind="none")
    a = m.reshape(m.transpose(a, (0, 2, 1, 3)), (cfg.batch, cfg.seq, cfg.heads * hd))
    a = lin(a, "attention.output.dense", d, cfg.heads * hd)
    x = m.layer_norm(a + x, p("attention.output.LayerNorm.weight", (d,)),
                     p("attention.output.LayerNorm.bias", (d,)), eps=1e-12)
    f = lin(m.gelu(lin(x, "intermediate.dense", cfg.ffn, d)), "output.dense", d, cfg.ffn)
    return m.layer_norm(f + x, p("output.LayerNorm.weight", (d,)), p("output.LayerNorm.bias", (d,)),
                        eps=1e-12)


def bert(cfg: Cfg = Cfg(kv_heads=4), name="bert") -> Graph:
    def fn(m):
        x = m.input("x", (cfg.batch, cfg.seq, cfg.hidden))
        for i in range(cfg.layers):
            x = bert_layer(m, x, i, cfg)
        return {"hidden": x}
    return Graph.define(name, fn)


def random_params(g: Graph, rng, scale=None) -> dict:
    """Random f32 params for every param of `g` (norm weights near 1, matrices ~ 1/sqrt(in))."""
    out = {}
    for n in g.nodes:
        if n.op != "param":
            continue
        dims = n.outs[0].dims
        if len(dims) == 1:
            v = 1.0 + 0.1 * rng.standard_normal(dims) if "norm" in n.name.lower() else \
                0.1 * rng.standard_normal(dims)
        else:
            v = rng.standard_normal(dims) * (scale or 1.0 / math.sqrt(dims[-1]))
        out[n.name] = v.astype(n.outs[0].dtype.np)
    return out


def rope_tables(seq: int, rot: int, base: float = 10000.0, offset: int = 0):
    inv = base ** (-np.arange(0, rot, 2) / rot)
    ang = np.outer(np.arange(offset, offset + seq), inv)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def llama_inputs(cfg: Cfg, rng, seq: int, batch: int | None = None) -> dict:
    b = batch or (cfg.batch if isinstance(cfg.batch, int) else 2)
    cos, sin = rope_tables(seq, cfg.rot)
    return {"ids": rng.integers(0, cfg.vocab, (b, seq)), "cos": cos, "sin": sin}


D, B, SEQ = 16, 2, 5
HEADS = [(2, 2, 8), (4, 2, 4), (4, 1, 4)]          # (heads, kv heads, head_dim), heads*hd = D
ACTS = ["gelu", "gelu_tanh", "silu", "relu", "tanh", "sigmoid"]
UNARY = ["tanh", "sigmoid", "silu", "gelu", "relu", "neg", "abs", "gelu_tanh"]


# ----------------------------------------------------------------------------- random graphs
step = st.one_of(
    st.tuples(st.just("linear"), st.booleans(), st.sampled_from([None] + ACTS)),
    st.tuples(st.just("rms_norm"), st.booleans(), st.sampled_from([0.0, 1.0])),
    st.tuples(st.just("layer_norm"), st.integers(0, 2)),
    st.tuples(st.just("softmax")),
    st.tuples(st.just("swiglu")),
    st.tuples(st.just("gated")),
    st.tuples(st.just("attention"), st.integers(0, len(HEADS) - 1),
              st.sampled_from(["causal", "none", "sliding_window", "bias"]), st.booleans(),
              st.sampled_from(["half", "interleaved"]), st.sampled_from([0.0, 3.0])),
    st.tuples(st.just("residual"), st.integers(0, 30)),
    st.tuples(st.just("residual_norm"), st.integers(0, 30), st.sampled_from(["rms", "ln"])),
    st.tuples(st.just("unary"), st.sampled_from(UNARY)),
    st.tuples(st.just("affine"), st.sampled_from([0.5, 2.0, -1.0]), st.sampled_from([0.0, 0.25])),
    st.tuples(st.just("mul"), st.integers(0, 30)),
    st.tuples(st.just("dead")),
    st.tuples(st.just("dup")),
    st.tuples(st.just("const")),
)
programs = st.tuples(st.lists(step, min_size=1, max_size=7), st.integers(0, 30), st.booleans())
attention_step = st.tuples(st.just("attention"), st.integers(0, len(HEADS) - 1),
                           st.sampled_from(["causal", "none", "sliding_window", "bias"]), st.booleans(),
                           st.sampled_from(["half", "interleaved"]), st.sampled_from([0.0, 3.0]))
attention_programs = st.tuples(
    st.lists(st.one_of(attention_step, st.tuples(st.just("residual_norm"), st.integers(0, 30),
                                                 st.sampled_from(["rms", "ln"])),
                       st.tuples(st.just("swiglu"))), min_size=1, max_size=4).map(
        lambda s: [("attention", 0, "causal", True, "half", 0.0)] + s if s[0][0] != "attention" else s),
    st.integers(0, 30), st.booleans())


def build(program) -> Graph:
    """An HIR graph from a drawn program: x [B, seq, D] through the steps."""
    steps, aux_at, with_aux = program

    def fn(m):
        x = m.input("x", (B, "seq", D))
        vals = [x]
        n = [0]

        def p(shape):
            n[0] += 1
            return m.param(f"p{n[0]}", shape)

        tables: dict = {}

        def table(hd):
            if hd not in tables:
                tables[hd] = (m.input(f"cos{hd}", ("seq", hd // 2)), m.input(f"sin{hd}", ("seq", hd // 2)))
            return tables[hd]

        def heads(t, h, hd):
            return m.transpose(m.reshape(t, (B, "seq", h, hd)), (0, 2, 1, 3))

        for s in steps:
            kind = s[0]
            if kind == "linear":
                x = m.linear(x, p((D, D)), p((D,)) if s[1] else None)
                x = m.act(x, s[2]) if s[2] else x
            elif kind == "rms_norm":
                x = m.rms_norm(x, p((D,)) if s[1] else None, eps=1e-6, offset=s[2])
            elif kind == "layer_norm":
                x = m.layer_norm(x, p((D,)) if s[1] >= 1 else None, p((D,)) if s[1] == 2 else None)
            elif kind == "softmax":
                x = m.softmax(x)
            elif kind == "swiglu":
                x = m.swiglu(x, p((24, D)), p((24, D)), p((D, 24)))
            elif kind == "gated":
                x = m.linear(m.silu(m.linear(x, p((24, D)))) * m.linear(x, p((24, D))), p((D, 24)))
            elif kind == "attention":
                h, kvh, hd = HEADS[s[1]]
                q = heads(m.linear(x, p((h * hd, D))), h, hd)
                k = heads(m.linear(x, p((kvh * hd, D))), kvh, hd)
                v = heads(m.linear(x, p((kvh * hd, D))), kvh, hd)
                if s[3]:
                    cos, sin = table(hd)
                    q, k = m.rope(q, cos, sin, s[4]), m.rope(k, cos, sin, s[4])
                mask = m.input(f"bias{n[0]}", (1, 1, "seq", "seq")) if s[2] == "bias" else None
                a = m.attention(q, k, v, mask, mask_kind=s[2], window=2 if s[2] == "sliding_window" else 0,
                                softcap=s[5])
                x = m.linear(m.reshape(m.transpose(a, (0, 2, 1, 3)), (B, "seq", D)), p((D, h * hd)))
            elif kind == "residual":
                x = x + vals[s[1] % len(vals)]
            elif kind == "residual_norm":
                h_ = x + vals[s[1] % len(vals)]
                x = m.rms_norm(h_, p((D,))) if s[2] == "rms" else m.layer_norm(h_, p((D,)), p((D,)))
                vals.append(h_)
            elif kind == "unary":
                x = m.act(x, s[1])
            elif kind == "affine":
                x = x * s[1] + s[2] if s[2] else x * s[1]
            elif kind == "mul":
                x = m.tanh(x) * vals[s[1] % len(vals)]
            elif kind == "dead":
                m.linear(x, p((D, D)))                      # never used
            elif kind == "dup":
                w = p((D, D))
                x = m.tanh(m.linear(x, w)) + m.tanh(m.linear(x, w))     # CSE merges the pair
            elif kind == "const":
                c = m.constant(np.linspace(-1, 1, D).astype(np.float32))
                x = x * m.exp(c * 0.5 + 0.25) + m.constant(np.float32(0.1)) * 2.0   # folds
            vals.append(x)
        out = {"out": x}
        if with_aux and len(vals) > 2:
            out["aux"] = vals[1 + aux_at % (len(vals) - 1)]
        return out

    return Graph.define("random", fn)


def inputs_for(g: Graph, rng) -> dict:
    out = {}
    for name, i in g.inputs.items():
        dims = tuple(SEQ if d == "seq" else d for d in g.nodes[i].outs[0].dims)
        if name.startswith(("cos", "sin")):
            ang = np.outer(np.arange(SEQ), rng.uniform(0.1, 1.0, dims[1]))
            out[name] = (np.cos(ang) if name.startswith("cos") else np.sin(ang)).astype(np.float32)
        else:
            out[name] = rng.standard_normal(dims).astype(np.float32)
    return out
