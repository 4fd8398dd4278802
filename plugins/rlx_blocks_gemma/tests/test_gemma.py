"""Gemma 2 / Gemma 3 against HF transformers (eager attention): tiny random models built
in-process, every sequence longer than the sliding window."""
from __future__ import annotations

import os

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError
from rlx_core.runtime.model import CausalLM
from rlx_core.testing.parity import assert_greedy_agrees
from rlx_core.testing.recipes import assert_models_agree

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 8
VOCAB = 151
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=WINDOW,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
TINY = {
    # Gemma 2: attention + final logit softcaps small enough to bite, sliding on even layers
    "gemma2-untied-gqa2": dict(arch="gemma2", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=96,
                               query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                               final_logit_softcapping=6.0, tie_word_embeddings=False),
    "gemma2-tied-mha": dict(arch="gemma2", num_hidden_layers=3, hidden_size=48, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=12, intermediate_size=80,
                            query_pre_attn_scalar=12, attn_logit_softcapping=10.0,
                            final_logit_softcapping=30.0, tie_word_embeddings=True),
    # Gemma 3: QK-norm, local/global RoPE bases, 1 global layer in 2 (pattern 2)
    "gemma3-untied-gqa2": dict(arch="gemma3", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=96,
                               query_pre_attn_scalar=16, sliding_window_pattern=2,
                               rope_parameters={
                                   "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                               tie_word_embeddings=False),
    # Gemma 3: explicit layer_types, linear RoPE scaling on global layers only, GQA 4,
    # head_dim != hidden/heads, a final softcap, and an attention softcap HF's Gemma 3 ignores
    "gemma3-tied-gqa4-linear": dict(arch="gemma3", num_hidden_layers=5, hidden_size=48, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                    query_pre_attn_scalar=32,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                 "sliding_attention", "full_attention"],
                                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                        "rope_theta": 20000.0},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 500.0}},
                                    final_logit_softcapping=12.0, attn_logit_softcapping=3.0,
                                    tie_word_embeddings=True),
}


def hf_model(name, tmp_path_factory):
    spec = dict(TINY[name])
    arch = spec.pop("arch")
    torch.manual_seed(sum(map(ord, name)))
    if arch == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, **spec))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**COMMON, **spec))
    model.config._attn_implementation = "eager"
    with torch.no_grad():       # random (1 + w) norms, so a wrong norm weight cannot hide
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.3 * torch.randn_like(p))
        if model.config.tie_word_embeddings:   # keep tied heads from echoing the input token
            model.model.embed_tokens.weight.mul_(0.1)
    model.eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    model, path = hf_model(request.param, tmp_path_factory)
    return model, rlx_core.load(path, backend="numpy", progress=False), path


def hf_generate(hf, ids, n, mask=None):
    mask = torch.ones(ids.shape, dtype=torch.long) if mask is None else torch.tensor(mask)
    with torch.no_grad():
        return hf.generate(torch.tensor(ids), attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0).numpy()


def hf_logits(hf):
    """HF's logits for a [1, n] prefix: the reference assert_greedy_agrees asks where tokens differ."""
    def logits(prefix):
        with torch.no_grad():
            return hf(torch.tensor(prefix)).logits.numpy()
    return logits


# ------------------------------------------------------------------------------- vs HF
def test_logits_match_hf(tiny, rng):
    hf, rlx, _ = tiny
    ids = rng.integers(0, VOCAB, (2, 3 * WINDOW + 5))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = rlx.logits(ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("prompt", [5, 2 * WINDOW + 3], ids=["prompt-in-window", "prompt-past-window"])
def test_greedy_48_tokens_with_kv_cache(tiny, rng, prompt):
    """48 new tokens: the sliding layers' ring wraps several times (window 8)."""
    hf, rlx, _ = tiny
    for _ in range(8):          # a prompt HF does not answer with one repeated token (proves little)
        ids = rng.integers(3, VOCAB, (1, prompt))
        ref = hf_generate(hf, ids, 48)
        if hf.config.tie_word_embeddings or len(set(ref[0, prompt:].tolist())) >= 4:
            break               # (tied tiny heads repeat themselves on many prompts: any will do)
    else:
        pytest.fail("degenerate tiny model: 8 prompts each answered by fewer than 4 distinct tokens")
    got = rlx.generate(ids, max_new_tokens=48, min_new_tokens=48)
    assert_greedy_agrees(got, ref, hf_logits(hf), 2e-4, "greedy against HF")


def test_left_padded_batch_matches_hf(tiny, rng):
    hf, rlx, _ = tiny
    rows = [list(rng.integers(3, VOCAB, n)) for n in (5, 2 * WINDOW + 1, 2)]
    s = max(map(len, rows))
    ids = np.zeros((3, s), np.int64)
    mask = np.zeros((3, s), np.int64)
    for b, r in enumerate(rows):
        ids[b, s - len(r):] = r
        mask[b, s - len(r):] = 1
    ref = hf_generate(hf, ids, 20, mask)
    got = rlx.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20)
    for b, r in enumerate(rows):
        assert_greedy_agrees(got[b:b + 1, s - len(r):], ref[b:b + 1, s - len(r):], hf_logits(hf), 2e-4,
                             f"row {b} against HF")


def test_kv_taps_match_hf_cache(tiny, rng):
    """present.<i>.k|v of a prefill = the K/V HF's cache holds for the prompt."""
    from rlx_blocks_gemma import GemmaFlow

    hf, rlx, _ = tiny
    ids = rng.integers(3, VOCAB, (1, WINDOW - 2))
    built = GemmaFlow.for_prefill(rlx.config).kv_taps().build(rlx.tensors)
    exe = built.compile("numpy")
    exe.fixed_dims = {"ctx": 16}
    n = ids.shape[1]
    out = exe.run(ids=ids, positions=np.arange(n)[None], key_mask=np.ones((1, 1, 1, n), bool),
                  cache_pos=np.zeros(1, np.int32))
    with torch.no_grad():
        cache = hf(torch.tensor(ids), use_cache=True).past_key_values
    for i in range(rlx.config["num_hidden_layers"]):
        np.testing.assert_allclose(out[f"present.{i}.k"], cache.layers[i].keys.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out[f"present.{i}.v"], cache.layers[i].values.numpy(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------- ring buffer
def test_ring_cache_is_window_sized_and_matches_full_cache(tiny, rng):
    from rlx_blocks_gemma import gemma_arch

    hf, rlx, path = tiny
    arch = gemma_arch(rlx.config)
    ids = rng.integers(3, VOCAB, (2, WINDOW + 3))
    ring = rlx.generate(ids, max_new_tokens=30, min_new_tokens=30)
    recipe = type(rlx.recipe)(ring=False)
    full_model = type(rlx)(recipe, rlx.config, rlx.tensors, rlx.tokenizer, "numpy")
    full = full_model.generate(ids, max_new_tokens=30, min_new_tokens=30)
    np.testing.assert_array_equal(ring, full)
    ctx = full_model.states["kv.0.k"].shape[2]
    for i in range(arch.layers):
        want = WINDOW if arch.is_sliding(i) else ctx
        assert rlx.states[f"kv.{i}.k"].shape == (2, arch.kv_heads, want, arch.head_dim), i
        assert full_model.states[f"kv.{i}.k"].shape[2] == ctx
    assert rlx.states[f"kv.ring{WINDOW}.valid"].shape == (2, 1, 1, WINDOW)


def test_short_prompt_after_long_one_sees_no_stale_ring(tiny, rng):
    """Prefill rewrites every ring slot: a second, shorter sequence must not attend to
    what the first one left in the ring."""
    hf, rlx, _ = tiny
    long = rng.integers(3, VOCAB, (1, 3 * WINDOW))
    short = rng.integers(3, VOCAB, (1, 3))
    rlx.generate(long, max_new_tokens=10)
    got = rlx.generate(short, max_new_tokens=12, min_new_tokens=12)
    assert_greedy_agrees(got, hf_generate(hf, short, 12), hf_logits(hf), 2e-4, "short prompt against HF")


# ------------------------------------------------------------------------------- fusion / profiles
@pytest.mark.parametrize("profile", ["fusable", "unfused", "gemma_decode"])
def test_fusion_policies_agree(tiny, rng, profile):
    hf, rlx, path = tiny
    ids = rng.integers(0, VOCAB, (1, 2 * WINDOW + 1))
    other = rlx_core.load(path, backend="numpy", profile=profile, progress=False)
    assert_models_agree(other, rlx, ids, what=f"profile {profile} against {rlx.profile.name}")


def test_profile_file_from_profiles_folder(tiny, rng):
    hf, rlx, path = tiny
    toml = os.path.join(os.path.dirname(__file__), "..", "..", "..", "profiles", "gemma.rlx.toml")
    if not os.path.isfile(toml):
        pytest.skip(f"{toml} is not in this checkout")
    m = rlx_core.load(path, backend="numpy", profile=os.path.abspath(toml), progress=False)
    assert m.profile.name == "gemma"
    ids = rng.integers(0, VOCAB, (1, 11))
    np.testing.assert_allclose(m.logits(ids), rlx.logits(ids), atol=1e-5)


def test_default_profile_is_gemma_preset(tiny):
    assert tiny[1].profile.name == "gemma_prefill"


# ------------------------------------------------------------------------------- flow hooks
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model, path = hf_model("gemma3-untied-gqa2", tmp_path_factory)
    return model, rlx_core.load(path, backend="numpy", progress=False)


def _logits(recipe_flow, model, ids, **build):
    exe = recipe_flow.build(model.tensors, **build).compile("numpy")
    mask = np.ones(ids.shape, bool)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    return exe.run(ids=ids, positions=pos, key_mask=mask[:, None, None, :])["logits"]


def test_recipe_flows_and_layer_override(small, rng):
    """Replacing every layer by the identity leaves logits = head(norm(scaled embedding))."""
    from rlx_blocks_gemma import Gemma3Flow

    _, m = small
    ids = rng.integers(0, VOCAB, (1, 6))
    np.testing.assert_allclose(_logits(Gemma3Flow.for_logits(m.config), m, ids), m.logits(ids), atol=1e-6)
    seen = []

    def identity(ctx):
        seen.append((ctx.index(), ctx.layer_type))
        assert ctx.default_stage() is not None
        return ctx.flow.custom(lambda emit, v, c: v)

    got = _logits(Gemma3Flow.for_logits(m.config).layer(identity), m, ids, check_unused=False)
    t, cfg = m.tensors, m.config
    x = t["model.embed_tokens.weight"][ids].astype(np.float64) * np.float32(np.sqrt(cfg["hidden_size"]))
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * (1 + t["model.norm.weight"])
    ref = x @ t["lm_head.weight"].T.astype(np.float64)
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert [lt for _, lt in seen] == ["sliding_attention", "full_attention"] * 2
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_wrong_family_flow_is_an_error(small):
    from rlx_blocks_gemma import Gemma2Flow

    with pytest.raises(ModelError, match="Gemma3Flow"):
        Gemma2Flow.for_logits(small[1].config)


def test_blocks_are_registered_and_resolve_by_name(small, rng):
    from rlx_blocks_gemma import Gemma3Flow
    from rlx_core.plugins import owner_of, registry

    reg = registry()
    for name in ("gemma.rms_norm", "gemma.geglu", "gemma.attention", "gemma.decoder_layer"):
        assert name in reg.blocks
    for mt in ("gemma2", "gemma3", "gemma3_text"):
        assert owner_of("recipe", mt) == "gemma"
    _, m = small
    ids = rng.integers(0, VOCAB, (1, 9))
    eps = m.config["rms_norm_eps"]
    flow = Gemma3Flow.for_logits(m.config).layer(
        lambda ctx: ctx.flow.plugin_named("gemma.decoder_layer", spec=ctx.spec, eps=eps))
    np.testing.assert_allclose(_logits(flow, m, ids), m.logits(ids), atol=1e-6)


# ------------------------------------------------------------------------------- configs
def test_config_spellings_agree():
    """transformers 5 rope_parameters, the older rope_theta/rope_local_base_freq/rope_scaling
    spelling (and the GGUF-synthesized one), and a multimodal text_config give one arch."""
    from rlx_blocks_gemma import gemma_arch

    base = dict(model_type="gemma3_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, intermediate_size=96, num_hidden_layers=7, vocab_size=100, sliding_window=16,
                query_pre_attn_scalar=32)
    new = gemma_arch(dict(base, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    old = gemma_arch(dict(base, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
                          rope_scaling={"rope_type": "linear", "factor": 8.0}))
    mm = gemma_arch({"model_type": "gemma3", "text_config": dict(base, rope_theta=1e6, rope_scaling={
        "rope_type": "linear", "factor": 8.0})})
    for a in (new, old, mm):
        assert a.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
        assert a.rope["sliding_attention"] == (1e4, None)
        assert a.rope["full_attention"][0] == 1e6
        assert a.rope["full_attention"][1]["factor"] == 8.0
        assert a.scale == 32 ** -0.5 and a.qk_norm and a.attn_softcap == 0.0
    g2 = gemma_arch(dict(base, model_type="gemma2", attn_logit_softcapping=50.0,
                         final_logit_softcapping=30.0))
    assert g2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert g2.rope["full_attention"] == g2.rope["sliding_attention"] == (10000.0, None)
    assert (g2.attn_softcap, g2.final_softcap, g2.qk_norm) == (50.0, 30.0, False)


@pytest.mark.parametrize("bad, match", [
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(hidden_activation="relu6"), "hidden_activation must be one of .*, got .relu6."),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(layer_types=["local", "global"]), "unknown layer types"),
])
def test_bad_configs_are_clear_errors(bad, match):
    from rlx_blocks_gemma import gemma_arch

    base = dict(model_type="gemma3_text", hidden_size=64, num_attention_heads=4, intermediate_size=96,
                num_hidden_layers=2, vocab_size=100)
    with pytest.raises(ModelError, match=match):
        gemma_arch(dict(base, **bad))


def test_multimodal_gemma3_checkpoint_runs_its_text_model(tmp_path, rng):
    """A Gemma3ForConditionalGeneration folder (model_type gemma3): its language model, on text."""
    text = dict(COMMON, num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, intermediate_size=48, query_pre_attn_scalar=16, sliding_window_pattern=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1,
                                    image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                    eoi_token_index=VOCAB - 2)
    torch.manual_seed(3)
    hf = transformers.Gemma3ForConditionalGeneration(cfg)
    hf.config._attn_implementation = "eager"
    hf.config.text_config._attn_implementation = "eager"
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n and "language_model" in n:
                p.copy_(0.3 * torch.randn_like(p))
    hf.eval()
    hf.save_pretrained(tmp_path)
    m = rlx_core.load(str(tmp_path), backend="numpy", progress=False)
    assert m.config["model_type"] == "gemma3_text"
    ids = rng.integers(3, VOCAB - 3, (1, 2 * WINDOW + 1))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(m.logits(ids) - ref).max() <= 1e-4


# ------------------------------------------------------------------------------- bad input
def test_unknown_architecture_is_not_claimed(small):
    with pytest.raises(ModelError, match="registered recipes"):
        CausalLM.from_tensors(dict(small[1].config, model_type="gemma7"), small[1].tensors)


def test_chat_on_a_model_without_template_is_an_error(small):
    from rlx_core.weights.tokenizer import Tokenizer

    _, m = small
    tok = Tokenizer(lambda: None, name="tiny")
    model = type(m)(m.recipe, m.config, m.tensors, tok, "numpy")
    with pytest.raises(ModelError, match="chat template"):
        model.generate("hello", chat=True)


def test_window_wider_than_the_context(tmp_path, rng):
    """sliding_window > max_position_embeddings: the ring has max_positions slots and
    never wraps; generation up to the end of the context still matches HF."""
    cfg = transformers.Gemma2Config(**dict(COMMON, sliding_window=40, max_position_embeddings=32),
                                    num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, intermediate_size=48,
                                    query_pre_attn_scalar=16, tie_word_embeddings=False)
    torch.manual_seed(7)
    hf = transformers.Gemma2ForCausalLM(cfg).eval()
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path)
    m = rlx_core.load(str(tmp_path), backend="numpy", progress=False)
    ids = rng.integers(3, VOCAB, (1, 10))
    got = m.generate(ids, max_new_tokens=22, min_new_tokens=22)
    assert_greedy_agrees(got, hf_generate(hf, ids, 22), hf_logits(hf), 2e-4, "greedy against HF")
    assert m.states["kv.0.k"].shape[2] == 32 and m.states["kv.1.k"].shape[2] == 32
