"""The plugin's registration, its blocks composed by hand (BertFlowBuilder, plugin_named),
the recipe hooks, pooling modes, and the errors a bad config or checkpoint gives."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rlx_core.flow import ModelFlow
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.plugins import registry
from rlx_core.runtime.encoder import Encoder, sentence_transformers_config

CFG = dict(model_type="bert", vocab_size=50, hidden_size=24, num_attention_heads=3, num_hidden_layers=2,
           intermediate_size=40, max_position_embeddings=32, type_vocab_size=2, layer_norm_eps=1e-12,
           hidden_act="gelu", pad_token_id=0)


def bert_weights(cfg: dict, rng, prefix: str = "") -> dict:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    r = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float32)        # noqa: E731
    t = {"embeddings.word_embeddings.weight": r(cfg["vocab_size"], h),
         "embeddings.position_embeddings.weight": r(cfg["max_position_embeddings"], h),
         "embeddings.token_type_embeddings.weight": r(cfg["type_vocab_size"], h),
         "embeddings.LayerNorm.weight": 1 + r(h), "embeddings.LayerNorm.bias": r(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            t[p + f"attention.self.{n}.weight"], t[p + f"attention.self.{n}.bias"] = r(h, h), r(h)
        t[p + "attention.output.dense.weight"], t[p + "attention.output.dense.bias"] = r(h, h), r(h)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = r(inter, h), r(inter)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = r(h, inter), r(h)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + f"{n}.weight"], t[p + f"{n}.bias"] = 1 + r(h), r(h)
    return {prefix + k: v for k, v in t.items()}


@pytest.fixture
def weights(rng):
    return bert_weights(CFG, rng)


def test_plugin_registers_recipes_and_blocks_but_no_ops():
    """A block family ships no kernels: its packed layout uses ops of the table."""
    from rlx_core.ir.ops import OPS

    reg = registry()
    assert type(reg.recipes["bert"]).__name__ == "BertRecipe"
    assert type(reg.recipes["nomic_bert"]).__name__ == "NomicBertRecipe"
    for name in ("bert.gather_add", "bert.gelu_ffn", "bert.encoder_layer", "bert.nomic_encoder_layer",
                 "bert.mean_pool", "bert.cls_pool", "bert.l2_normalize"):
        assert name in reg.blocks
    assert not [n for n in reg.ops if n.startswith("bert.")]
    assert {"varlen_attention", "segment_pool"} <= set(OPS)


def test_hand_built_flow_with_plugin_named_blocks_matches_recipe(weights, rng):
    """The recipe's graph rebuilt from blocks resolved by name through the registry."""
    from rlx_blocks_bert import BertFlowBuilder, BertSpec

    spec = BertSpec(hidden=24, heads=3, intermediate=40)
    f = (BertFlowBuilder("hand").encoder_inputs()
         .embed("embeddings.word_embeddings.weight")
         .plugin_named("bert.gather_add", input="positions", weight="embeddings.position_embeddings.weight")
         .gather_add("token_type_ids", "embeddings.token_type_embeddings.weight")
         .layer_norm("embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias", 1e-12))
    f.layer(0, lambda s: s.plugin_named("bert.encoder_layer", spec=spec))
    f.layer(1, lambda s: s.bert_encoder_layer(spec))
    f.output("last_hidden_state").plugin_named("bert.mean_pool").plugin_named("bert.l2_normalize")
    built = f.build(weights)
    exe = built.compile("numpy")
    ids = rng.integers(0, 50, (2, 7))
    mask = np.ones((2, 7), bool)
    mask[1, 4:] = False
    out = exe.run(ids=ids, token_type_ids=np.zeros_like(ids), positions=np.broadcast_to(np.arange(7), (2, 7)),
                  key_mask=mask[:, None, None, :])
    enc = Encoder.from_tensors(CFG, weights, backend="numpy")
    ref = enc.forward(ids, mask)
    np.testing.assert_allclose(out["last_hidden_state"], ref["last_hidden_state"], atol=1e-5)
    np.testing.assert_allclose(out["logits"], ref["embedding"], atol=1e-6)    # the flow's final value


def test_gelu_ffn_block_alone(weights, rng):
    from rlx_blocks_bert import BertFlowBuilder

    f = BertFlowBuilder("ffn").input("x", (2, 5, 24), "f32")
    f.layer(0, lambda s: s.gelu_ffn())
    built = f.build({k: v for k, v in weights.items() if k.startswith("encoder.layer.0.") and
                     ("intermediate.dense" in k or k.startswith("encoder.layer.0.output.dense"))})
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    got = built.compile("numpy").run(x=x)["logits"]
    p = "encoder.layer.0."
    h = x @ weights[p + "intermediate.dense.weight"].T + weights[p + "intermediate.dense.bias"]
    from math import erf, sqrt

    h = h * 0.5 * (1 + np.vectorize(erf)(h / sqrt(2)))
    ref = h @ weights[p + "output.dense.weight"].T + weights[p + "output.dense.bias"]
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_recipe_hooks_taps_and_layer_override(weights, rng):
    from rlx_blocks_bert import BertFlow

    ids = rng.integers(0, 50, (1, 6))
    feed = dict(ids=ids, token_type_ids=np.zeros_like(ids), positions=np.arange(6)[None],
                key_mask=np.ones((1, 1, 1, 6), bool))
    out = BertFlow(CFG).taps().build(weights).compile("numpy").run(feed)
    np.testing.assert_allclose(out["layer.1"], out["last_hidden_state"])
    seen = []

    def skip_layers(i, default):
        seen.append(i)
        return ModelFlow().custom(lambda emit, v, ctx: v)

    flow = BertFlow(CFG).layer(skip_layers).patch_flow(lambda f: f.custom(lambda emit, v, ctx: v * 2.0))
    out2 = flow.build(weights, check_unused=False).compile("numpy").run(feed)
    assert seen == [0, 1]
    emb = weights["embeddings.word_embeddings.weight"][ids[0]] + weights["embeddings.position_embeddings.weight"][:6] \
        + weights["embeddings.token_type_embeddings.weight"][0]
    mu, var = emb.mean(-1, keepdims=True), emb.var(-1, keepdims=True)
    ln = (emb - mu) / np.sqrt(var + 1e-12) * weights["embeddings.LayerNorm.weight"] + weights["embeddings.LayerNorm.bias"]
    np.testing.assert_allclose(out2["last_hidden_state"][0], ln, atol=1e-5)
    pooled = ln.mean(0)
    np.testing.assert_allclose(out2["logits"][0], 2 * pooled / np.linalg.norm(pooled), atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "max", "mean"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_pooling_modes(weights, rng, pooling, layout):
    enc = Encoder.from_tensors(CFG, weights, backend="numpy", pooling=pooling, flow_options={"layout": layout})
    rows = [list(rng.integers(1, 50, n)) for n in (5, 1, 9)]
    h = [Encoder.from_tensors(CFG, weights, backend="numpy").hidden_states(np.array([r]))[0] for r in rows]
    ref = np.stack([{"cls": x[0], "max": x.max(0), "mean": x.mean(0)}[pooling] for x in h])
    np.testing.assert_allclose(enc.embed(rows, normalize=False), ref, atol=1e-5)
    assert enc.layout == layout


def test_sentence_transformers_config(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": True}))
    (tmp_path / "1_Pooling").mkdir()
    pool = tmp_path / "1_Pooling" / "config.json"
    pool.write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    st = sentence_transformers_config(str(tmp_path))
    assert st["pooling"] == "cls" and st["max_seq_length"] == 128 and st["do_lower_case"] and not st["normalize"]
    pool.write_text(json.dumps({"pooling_mode": "max"}))
    assert sentence_transformers_config(str(tmp_path))["pooling"] == "max"
    pool.write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}))
    with pytest.raises(ModelError, match="not supported"):
        sentence_transformers_config(str(tmp_path))
    pool.write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ModelError, match="weightedmean"):
        sentence_transformers_config(str(tmp_path))
    plain = tmp_path / "a" / "plain"              # neither it nor its parent is an ST folder
    plain.mkdir(parents=True)
    assert sentence_transformers_config(str(plain)) == {}


def test_max_length_and_lowercase_from_st_config(weights):
    enc = Encoder.from_tensors(CFG, weights, backend="numpy", st={"max_seq_length": 16, "do_lower_case": True})
    assert enc.max_length == 16 and enc.do_lower_case
    with pytest.raises(ModelError, match="more than the model's 32 positions"):
        Encoder.from_tensors(CFG, weights, backend="numpy", max_length=64)


@pytest.mark.parametrize("change, match", [
    (dict(position_embedding_type="relative_key"), "position_embedding_type 'relative_key'"),
    (dict(is_decoder=True), "is_decoder"),
    (dict(add_cross_attention=True), "add_cross_attention"),
    (dict(hidden_act="relu6"), "hidden_act must be one of .*, got 'relu6'"),
    (dict(num_attention_heads=5), "not a multiple of 5 attention heads"),
    (dict(intermediate_size=None), "missing \\['intermediate_size'\\]"),
    (dict(hidden_size="big"), "hidden_size must be a positive integer"),
])
def test_unsupported_bert_configs_are_named(weights, change, match):
    with pytest.raises(ModelError, match=match):
        Encoder.from_tensors(dict(CFG, **change), weights, backend="numpy")


def test_bad_pooling_and_layout(weights):
    with pytest.raises(ModelError, match="unsupported pooling 'sum'"):
        Encoder.from_tensors(CFG, weights, backend="numpy", pooling="sum").embed([[1, 2]])
    with pytest.raises(ModelError, match="layout must be"):
        Encoder.from_tensors(CFG, weights, backend="numpy", flow_options={"layout": "ragged"}).embed([[1, 2]])


def test_missing_unexpected_and_misshaped_tensors_in_one_error(weights):
    t = dict(weights)
    t.pop("encoder.layer.1.intermediate.dense.bias")
    t["encoder.layer.0.attention.self.key.weight"] = np.zeros((3, 3), np.float32)
    t["extra.weight"] = np.zeros(2, np.float32)
    enc = Encoder.from_tensors(CFG, t, backend="numpy")
    with pytest.raises(WeightError) as e:
        enc.embed([[1, 2, 3]])
    msg = str(e.value)
    for key in ("encoder.layer.1.intermediate.dense.bias", "extra.weight",
                "encoder.layer.0.attention.self.key.weight"):
        assert key in msg


def test_prefixed_checkpoint_and_old_layernorm_names(rng):
    t = bert_weights(CFG, rng)
    old = {("bert." + k).replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in t.items()}
    old["cls.predictions.bias"] = np.zeros(50, np.float32)
    old["bert.pooler.dense.weight"] = np.zeros((24, 24), np.float32)
    old["bert.embeddings.position_ids"] = np.arange(32)[None]
    ids = rng.integers(0, 50, (1, 8))
    a = Encoder.from_tensors(CFG, old, backend="numpy").hidden_states(ids)
    b = Encoder.from_tensors(CFG, t, backend="numpy").hidden_states(ids)
    np.testing.assert_array_equal(a, b)
