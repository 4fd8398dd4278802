"""NomicBERT against an independent float64 NumPy implementation of the published architecture
(nomic-ai's modeling_hf_nomic_bert: fused Wqkv, rotary q/k, post-norm LayerNorm blocks, SwiGLU
MLP `fc2(fc11(x) * silu(fc12(x)))`, emb_ln) on random weights; no HF class exists offline."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError
from rlx_core.runtime.encoder import Encoder
from rlx_core.testing import parity

from rlx_blocks_bert import NomicBertRecipe

BASE = NomicBertRecipe().tiny_config()                                  # nomic-bert-2048's shape
VARIANTS = {
    "nomic-bert-2048": {},                                               # the published shape
    "partial-rotary-interleaved": dict(rotary_emb_fraction=0.5, rotary_emb_interleaved=True,
                                       rotary_emb_base=10000, layer_norm_epsilon=1e-5),
    "geglu-biases-3layers": dict(activation_function="geglu", qkv_proj_bias=True, mlp_fc1_bias=True,
                                 mlp_fc2_bias=True, n_layer=3, n_head=6),
    "plain-gelu-mlp": dict(activation_function="gelu", n_inner=None, type_vocab_size=1),
    "absolute-positions": dict(rotary_emb_fraction=0.0, type_vocab_size=0),
}


def nomic_weights(cfg: dict, rng) -> dict:
    return NomicBertRecipe().tiny_tensors(cfg, rng)


# ------------------------------------------------------------------ float64 reference
def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


_erf = np.vectorize(math.erf)
ACT = {"swiglu": lambda x: x / (1 + np.exp(-x)), "geglu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
       "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))}


def _rotate(x, pos, rot, base, interleaved):
    """flash-attn apply_rotary_emb on [n, heads, d]: the first `rot` dims rotate."""
    inv = 1.0 / base ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    f = pos[:, None].astype(np.float64) * inv[None]                          # [n, rot/2]
    c, s = np.cos(f)[:, None], np.sin(f)[:, None]
    r, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        out = np.empty_like(r)
        out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = r[..., :rot // 2], r[..., rot // 2:]
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    return np.concatenate([out, rest], -1)


def nomic_reference(cfg: dict, t: dict, ids: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Last hidden state [n, hidden] of ONE unpadded sequence, float64."""
    W = {k: v.astype(np.float64) for k, v in t.items()}
    h, heads, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    d = h // heads
    rot = int(cfg["rotary_emb_fraction"] * d)
    pos = np.arange(len(ids))
    x = W["embeddings.word_embeddings.weight"][ids]
    if cfg["type_vocab_size"]:
        x = x + W["embeddings.token_type_embeddings.weight"][types]
    if not rot:
        x = x + W["embeddings.position_embeddings.weight"][pos]
    x = _ln(x, W["emb_ln.weight"], W["emb_ln.bias"], eps)

    def lin(y, name):
        out = y @ W[name + ".weight"].T
        return out + W[name + ".bias"] if name + ".bias" in W else out

    act = ACT[cfg["activation_function"]]
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        qkv = lin(x, p + "attn.Wqkv").reshape(len(ids), 3, heads, d)        # "(three h d)"
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        if rot:
            q = _rotate(q, pos, rot, cfg["rotary_emb_base"], cfg["rotary_emb_interleaved"])
            k = _rotate(k, pos, rot, cfg["rotary_emb_base"], cfg["rotary_emb_interleaved"])
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(len(ids), h)
        x = _ln(x + lin(o, p + "attn.out_proj"), W[p + "norm1.weight"], W[p + "norm1.bias"], eps)
        if cfg["activation_function"] in ("swiglu", "geglu"):
            y = lin(x, p + "mlp.fc11") * act(lin(x, p + "mlp.fc12"))
        else:
            y = act(lin(x, p + "mlp.fc1"))
        x = _ln(x + lin(y, p + "mlp.fc2"), W[p + "norm2.weight"], W[p + "norm2.bias"], eps)
    return x


@pytest.fixture(params=sorted(VARIANTS))
def nomic(request, rng):
    cfg = dict(BASE, **VARIANTS[request.param])
    t = nomic_weights(cfg, rng)
    return cfg, t, Encoder.from_tensors(cfg, t, backend="numpy")


def _seqs(rng, cfg, lens):
    tv = max(cfg["type_vocab_size"], 1)
    return [(rng.integers(0, cfg["vocab_size"], n), rng.integers(0, tv, n)) for n in lens]


def test_padded_batch_matches_reference(nomic, rng):
    cfg, t, enc = nomic
    seqs = _seqs(rng, cfg, [9, 3, 17, 1])
    s = max(len(a) for a, _ in seqs)
    ids, types, mask = (np.zeros((len(seqs), s), np.int64) for _ in range(3))
    for b, (a, ty) in enumerate(seqs):
        ids[b, :len(a)], types[b, :len(a)], mask[b, :len(a)] = a, ty, 1
    got = enc.hidden_states(ids, mask, types)
    for b, (a, ty) in enumerate(seqs):
        ref = nomic_reference(cfg, t, a, ty)
        assert np.abs(got[b, :len(a)] - ref).max() <= 1e-4, b


@pytest.mark.parametrize("backend", ["legalized"] + parity.backend_params())
def test_packed_and_embed_match_reference(nomic, rng, backend):
    """Packed (RoPE on tokens-major rows, then varlen_attention) on the NumPy and numba
    kernels, and legalized for backends without them."""
    cfg, t, enc = nomic
    seqs = _seqs(rng, cfg, [5, 12, 2, 30])
    refs = [nomic_reference(cfg, t, a, ty) for a, ty in seqs]
    with parity.numpy_without({"varlen_attention", "segment_pool"}, "legalized"):
        if backend != "numpy":
            enc = Encoder(enc.recipe, enc.config, enc.tensors, backend=backend,
                          flow_options={"layout": "packed"})
        out = enc._run_packed(enc.executable("packed"), [(list(a), list(ty)) for a, ty in seqs], 5)
    h, at = out["last_hidden_state"][0], 0
    for (a, _), ref in zip(seqs, refs):
        assert np.abs(h[at:at + len(a)] - ref).max() <= 1e-4
        at += len(a)
    pooled = np.stack([r.mean(0) for r in refs])
    if cfg["type_vocab_size"] <= 1:               # embed() sends token type 0
        got = enc.embed([list(a) for a, _ in seqs], batch_size=3)
        np.testing.assert_allclose(got, pooled / np.linalg.norm(pooled, axis=1, keepdims=True), atol=1e-5)
    np.testing.assert_allclose(out["pooled"][:4], pooled, atol=1e-4)


def test_nomic_recipe_loads_a_folder_with_a_prefixed_checkpoint(tmp_path, rng):
    """A NomicBertForPreTraining-style checkpoint (`bert.` prefix, MLM head) in an HF folder."""
    from safetensors.numpy import save_file

    cfg = dict(BASE)
    t = nomic_weights(cfg, rng)
    saved = {f"bert.{k}": v for k, v in t.items()}
    saved["cls.predictions.decoder.weight"] = np.zeros((cfg["vocab_size"], cfg["n_embd"]), np.float32)
    save_file(saved, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    enc = rlx_core.load(str(tmp_path), backend="numpy", progress=False)
    assert isinstance(enc, Encoder) and enc.config["model_type"] == "nomic_bert" and enc.dim == 48
    a, ty = _seqs(rng, cfg, [11])[0]
    got = enc.hidden_states(a[None], None, ty[None])[0]
    assert np.abs(got - nomic_reference(cfg, t, a, ty)).max() <= 1e-4


@pytest.mark.parametrize("change, match", [
    (dict(prenorm=True), "prenorm"), (dict(use_rms_norm=True), "RMSNorm"),
    (dict(parallel_block=True), "parallel"), (dict(moe_every_n_layers=2, num_experts=8), "mixture-of-experts"),
    (dict(activation_function="mish"), "activation_function 'mish'"),
    (dict(n_head=5), "not a multiple"), (dict(rotary_emb_scale_base=512), "xPos"),
    (dict(n_embd=None), "missing \\['n_embd'\\]"),
])
def test_unsupported_nomic_variants_are_named(change, match, rng):
    cfg = dict(BASE, **change)
    with pytest.raises(ModelError, match=match):
        Encoder.from_tensors(cfg, {}, backend="numpy")


def test_dynamic_ntk_config_caps_the_length(rng):
    cfg = dict(BASE, rotary_scaling_factor=2.0, max_trained_positions=64)
    enc = Encoder.from_tensors(cfg, nomic_weights(cfg, rng), backend="numpy")
    assert enc.max_positions == 64
    with pytest.raises(ModelError, match="longer than the model's 64 positions"):
        enc.embed([[1] * 65])
