"""BERT against HF transformers: tiny random BertModel configs built in-process (absolute
positions, token types, several shapes and activations), padded and packed layouts (the
latter with the backends' own varlen kernels, and legalized), and the fusion policies."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.runtime.encoder import Encoder
from rlx_core.testing import parity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = {
    "h32-4heads-gelu": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=37,
                            type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12),
    "h48-6heads-gelu_new-3types": dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=3,
                                       intermediate_size=64, type_vocab_size=3, hidden_act="gelu_new",
                                       layer_norm_eps=1e-5),
    "h40-5heads-relu-1type": dict(hidden_size=40, num_attention_heads=5, num_hidden_layers=2,
                                  intermediate_size=72, type_vocab_size=1, hidden_act="relu",
                                  layer_norm_eps=1e-7),
    "h64-2heads-1layer": dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=128,
                              type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12),
}
VOCAB, MAX_POS = 97, 40


def _hf(name, tmp_path_factory):
    cfg = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POS, **TINY[name])
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.BertModel(cfg, add_pooling_layer=True)
    with torch.no_grad():                    # random norms and biases: a wrong one cannot hide
        for n, p in model.named_parameters():
            if "LayerNorm.weight" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    model, path = _hf(request.param, tmp_path_factory)
    return request.param, model, rlx_core.load(path, backend="numpy", progress=False)


def _batch(rng, lens, types_n):
    s = max(lens)
    ids = np.zeros((len(lens), s), np.int64)
    types = np.zeros((len(lens), s), np.int64)
    mask = np.zeros((len(lens), s), np.int64)
    for b, n in enumerate(lens):
        ids[b, :n] = rng.integers(1, VOCAB, n)
        types[b, :n] = rng.integers(0, types_n, n)
        mask[b, :n] = 1
    return ids, types, mask


def _hf_out(model, ids, types, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                     attention_mask=torch.tensor(mask)).last_hidden_state.numpy()


def test_last_hidden_state_matches_hf(tiny, rng):
    name, hf, enc = tiny
    assert isinstance(enc, Encoder)
    ids, types, mask = _batch(rng, [13, 5, 1, 9], TINY[name]["type_vocab_size"])
    ref = _hf_out(hf, ids, types, mask)
    got = enc.hidden_states(ids, mask, types)
    assert got.shape == ref.shape
    m = mask.astype(bool)
    assert np.abs(got - ref)[m].max() <= 1e-4
    # full length, no padding, every position
    ids, types, mask = _batch(rng, [MAX_POS, MAX_POS], TINY[name]["type_vocab_size"])
    assert np.abs(enc.hidden_states(ids, mask, types) - _hf_out(hf, ids, types, mask)).max() <= 1e-4


@pytest.mark.parametrize("backend", ["legalized"] + parity.backend_params())
def test_packed_layout_matches_hf(tiny, rng, backend):
    """Packed runs on the kernels of varlen_attention / segment_pool (NumPy, numba), and on
    backends without them (legalized into attention with a block-diagonal mask)."""
    name, hf, enc = tiny
    lens = [7, 1, 12, 3]
    ids, types, mask = _batch(rng, lens, TINY[name]["type_vocab_size"])
    ref = _hf_out(hf, ids, types, mask)
    with parity.numpy_without({"varlen_attention", "segment_pool"}, "legalized"):
        if backend != "numpy":
            enc = Encoder(enc.recipe, enc.config, enc.tensors, backend=backend,
                          flow_options={"layout": "packed"})
        exe = enc.executable("packed")
        ops = {n.op for n in exe.mir.nodes}
        assert ("varlen_attention" in ops) == ("varlen_attention" in enc.backend.supported_ops()), sorted(ops)
        rows = [(list(ids[b, :n]), list(types[b, :n])) for b, n in enumerate(lens)]
        out = enc._run_packed(exe, rows, 6)
    h = out["last_hidden_state"][0]
    at = 0
    for b, n in enumerate(lens):
        assert np.abs(h[at:at + n] - ref[b, :n]).max() <= 1e-4
        at += n
    pooled = (ref * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    np.testing.assert_allclose(out["pooled"][:4], pooled, atol=1e-4)
    assert np.abs(out["pooled"][5:]).max() == 0            # [4] pads 23 tokens to 32; [5] is empty


def test_embed_matches_hf_mean_pooling(tiny, rng):
    name, hf, enc = tiny
    lens = [int(x) for x in rng.integers(1, MAX_POS + 1, 9)]
    ids, types, mask = _batch(rng, lens, 1)
    ref = _hf_out(hf, ids, types, mask)
    pooled = (ref * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    ref_n = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    rows = [list(ids[b, :n]) for b, n in enumerate(lens)]
    for bs in (1, 4, 9):
        np.testing.assert_allclose(enc.embed(rows, batch_size=bs), ref_n, atol=1e-5)
        np.testing.assert_allclose(enc.embed(rows, batch_size=bs, normalize=False), pooled, atol=1e-4)


@pytest.mark.parametrize("options", [{"layout": "padded"}, {"layout": "padded", "fused_qkv": False},
                                     {"layout": "packed", "fused_qkv": False}])
def test_layouts_and_projections_agree(tiny, rng, options):
    name, hf, enc = tiny
    other = Encoder(enc.recipe, enc.config, enc.tensors, backend="numpy", flow_options=options)
    lens = [6, 11, 2]
    ids, types, mask = _batch(rng, lens, TINY[name]["type_vocab_size"])
    ref = _hf_out(hf, ids, types, mask)
    got = other.hidden_states(ids, mask, types)
    assert np.abs(got - ref)[mask.astype(bool)].max() <= 1e-4
    rows = [list(ids[b, :n]) for b, n in enumerate(lens)]
    np.testing.assert_allclose(other.embed(rows), enc.embed(rows), atol=2e-6)


@pytest.mark.parametrize("profile", ["fusable", "unfused", "debug"])
def test_fusion_policies_give_the_same_result(tiny, rng, profile):
    name, hf, enc = tiny
    other = Encoder(enc.recipe, enc.config, enc.tensors, backend="numpy", profile=profile)
    ids, types, mask = _batch(rng, [9, 4], TINY[name]["type_vocab_size"])
    ref = _hf_out(hf, ids, types, mask)
    got = other.hidden_states(ids, mask, types)
    assert np.abs(got - ref)[mask.astype(bool)].max() <= 1e-4


def test_masked_lm_checkpoint_loads_as_encoder(tmp_path, rng):
    """BertForMaskedLM: `bert.` prefix stripped, the MLM head dropped."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POS, **TINY["h32-4heads-gelu"])
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(cfg).eval()
    mlm.save_pretrained(tmp_path)
    enc = rlx_core.load(str(tmp_path), backend="numpy", progress=False)
    ids, types, mask = _batch(rng, [8, 3], 2)
    with torch.no_grad():
        ref = mlm.bert(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                       attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    assert np.abs(enc.hidden_states(ids, mask, types) - ref)[mask.astype(bool)].max() <= 1e-4
