"""FLUX.1 and FLUX.2 against diffusers (the reference, test-only): tiny random transformers
(2 double + 2 single blocks, hidden 32, a 6 x 10 grid of image tokens, 7 text tokens) saved
as diffusers folders and loaded with rlx_core.load; the transformer output on every CPU
backend here, the 4-step Euler loop against diffusers' scheduler + transformer loop, fusion
policies against each other, assert_clean under the flux2 profile, and bad inputs."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.flow.dit import sinusoid_freqs
from rlx_core.pipeline import available_backends
from rlx_core.profile import CompileProfile

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
embeddings = pytest.importorskip("diffusers.models.embeddings")

from rlx_blocks_flux import Flux2Recipe, FluxRecipe, latent_ids  # noqa: E402

PROFILES = Path(__file__).resolve().parents[3] / "profiles"
H, W, TXT, BATCH = 6, 10, 7, 2
TOL = 1e-4                     # fp32 max abs, the bar
FAMILIES = {"flux1": (FluxRecipe, "FluxTransformer2DModel"), "flux2": (Flux2Recipe, "Flux2Transformer2DModel")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family, diffusers model, folder): the recipe's tiny config as a diffusers model whose
    every weight is random (norm weights around 1, so the QK-norm weights matter)."""
    recipe_cls, cls_name = FAMILIES[request.param]
    cfg = {k: v for k, v in recipe_cls().tiny_config().items() if k != "_class_name"}
    gen = torch.Generator().manual_seed(1234)
    model = getattr(diffusers, cls_name)(**cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name and p.ndim == 1 else 0.15 * noise)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, str(path)


@pytest.fixture(autouse=True)
def same_frequency_table(monkeypatch):
    """diffusers' timestep embedding, with the f32 frequency table rlx uses. torch's and
    numpy's f32 exp differ in the last bit of a few entries, and sin(1000 t f) turns one ulp
    of f into ~6e-5 of output (seen up to 3.7e-4 after the blocks): unpatched, the f32
    comparison measures the two libms, not the blocks. test_frequency_table_is_torchs_to_an_ulp
    bounds that difference."""
    def with_rlx_table(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1,
                       scale=1, max_period=10000):
        half = embedding_dim // 2
        freqs = torch.from_numpy(sinusoid_freqs(embedding_dim, downscale_freq_shift, max_period))
        emb = scale * (timesteps[:, None].float() * freqs[None, :])
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
        return torch.cat([emb[:, half:], emb[:, :half]], dim=-1) if flip_sin_to_cos else emb

    monkeypatch.setattr(embeddings, "get_timestep_embedding", with_rlx_table)


def test_frequency_table_is_torchs_to_an_ulp():
    """The table the fixture swaps in is diffusers' own up to one ulp per entry."""
    for dim, shift in ((256, 0.0), (256, 1.0), (64, 0.0)):
        half = dim // 2
        exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32) / (half - shift)
        want = torch.exp(exponent).numpy()
        ulps = np.abs(sinusoid_freqs(dim, shift).view(np.int32) - want.view(np.int32))
        assert ulps.max() <= 1, f"dim {dim} shift {shift}: {ulps.max()} ulps off torch"


def inputs(model, rng, batch=BATCH) -> dict:
    """Fresh random diffusers inputs (numpy): odd grid, non-trivial text position ids."""
    c = model.config
    axes = len(c.axes_dims_rope)
    txt_ids = np.zeros((TXT, axes), np.float32)
    txt_ids[:, 0] = rng.integers(0, 3, TXT)
    img_ids = latent_ids(H, W, axes)
    img_ids[:, 0] = 1.0
    feed = {"hidden_states": rng.standard_normal((batch, H * W, c.in_channels)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((batch, TXT, c.joint_attention_dim)).astype(np.float32),
            "timestep": rng.uniform(0.05, 1.0, batch).astype(np.float32),
            "img_ids": img_ids, "txt_ids": txt_ids,
            "guidance": rng.uniform(1.0, 5.0, batch).astype(np.float32)}
    if "pooled_projection_dim" in c:
        feed["pooled_projections"] = rng.standard_normal((batch, c.pooled_projection_dim)).astype(np.float32)
    return feed


def reference(model, feed: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in feed.items()}).sample.numpy()


def backend_or_skip(name: str) -> str:
    for b, ok, why in available_backends():
        if b.name == name:
            if not ok:
                pytest.skip(f"backend {name!r} is not available here: {why}")
            return name
    pytest.skip(f"backend {name!r} is not installed")


@pytest.mark.parametrize("backend", ["numpy", "opencl", "numba", "cuda"])
def test_forward_matches_diffusers(tiny, rng, backend):
    family, model, path = tiny
    m = rlx_core.load(path, backend=backend_or_skip(backend), progress=False)
    assert type(m.recipe).__name__ == FAMILIES[family][0].__name__
    feed = inputs(model, rng)
    want = reference(model, feed)
    got = m.forward(**feed)
    assert got.shape == want.shape == (BATCH, H * W, model.config.in_channels)
    assert np.abs(want).max() > 0.1                       # the blocks do something
    err = np.abs(got - want).max()
    assert err <= TOL, f"{family} on {backend}: max abs {err:.3g} (max |ref| {np.abs(want).max():.3g})"


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
def test_bf16_forward_near_diffusers(tiny, rng, backend):
    """bf16 compute (profiles/flux2.rlx.toml) against diffusers in f32: within bf16's error,
    relative to the output's largest value. The timestep and RoPE tables are computed in f32
    as diffusers computes them (bf16 frequency tables alone put it 0.3 off). The timestep and
    guidance are exact in bf16: the model rounds them to bf16 on entry, as diffusers does,
    and x1000 that rounding alone moves the output by O(1)."""
    family, model, path = tiny
    prof = CompileProfile.from_toml_path(str(PROFILES / "flux2.rlx.toml"))
    assert prof.precision.compute.value == "bf16"
    m = rlx_core.load(path, backend=backend_or_skip(backend), profile=prof, progress=False)
    feed = dict(inputs(model, rng), timestep=np.array([0.5, 0.75], np.float32),
                guidance=np.array([3.5, 4.0], np.float32))
    want = reference(model, feed)
    err = np.abs(m.forward(**feed).astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= 4e-2, f"{family} bf16 on {backend}: max abs / max |ref| {err:.3g}"


def test_denoise_matches_diffusers_loop(tiny, rng):
    """4 Euler steps from the same latents and embeddings: diffusers' scheduler with the
    FLUX pipelines' sigmas and shift, and its transformer, against FluxModel.denoise."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family, model, path = tiny
    feed = inputs(model, rng, batch=1)
    steps, guidance = 4, 3.5
    if family == "flux1":
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift(H * W, 256, 4096, 0.5, 1.15)
    else:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        mu = compute_empirical_mu(H * W, steps)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    lat = torch.from_numpy(feed["hidden_states"])
    cond = {k: torch.from_numpy(v) for k, v in feed.items() if k not in ("hidden_states", "timestep", "guidance")}
    with torch.no_grad():
        for t in sched.timesteps:
            v = model(hidden_states=lat, timestep=t.expand(1) / 1000, guidance=torch.full([1], guidance), **cond).sample
            lat = sched.step(v, t, lat, return_dict=False)[0]
    m = rlx_core.load(path, backend="numpy", progress=False)
    seen = []
    got = m.denoise(feed["hidden_states"], feed["encoder_hidden_states"], feed["img_ids"], feed["txt_ids"],
                    num_steps=steps, guidance=guidance, pooled_prompt_embeds=feed.get("pooled_projections"),
                    callback=lambda i, s, x: seen.append(s))
    np.testing.assert_allclose(seen, sched.sigmas[:-1].numpy(), rtol=0, atol=0)
    assert np.abs(got - feed["hidden_states"]).max() > 0.1
    err = np.abs(got - lat.numpy()).max()
    assert err <= TOL, f"{family}: 4-step loop max abs {err:.3g}"


def _profiles():
    base = CompileProfile.preset("flux2")
    return {"direct": base, "fusable": base.evolve(fusion={"policy": "fusable"}),
            "skipped": base.evolve(fusion={"policy": "fusable", "skip": True})}


def test_fusion_policies_agree(tiny, rng):
    """direct, fusable and every fusion group skipped give the same numbers."""
    family, model, path = tiny
    feed = inputs(model, rng)
    outs = {name: rlx_core.load(path, backend="numpy", profile=p, progress=False).forward(**feed)
            for name, p in _profiles().items()}
    scale = np.abs(outs["skipped"]).max()
    for name in ("direct", "fusable"):
        err = np.abs(outs[name] - outs["skipped"]).max()
        assert err <= 4e-6 * max(scale, 1.0), f"{family}: {name} vs skipped: {err:.3g}"


def test_assert_clean_under_flux2_profile(tiny, rng):
    """The recipe's graph leaves no fusable pattern unfused under profiles/flux2.rlx.toml
    (bf16 there; compiled in f32 here to compare) nor the flux2 preset."""
    family, model, path = tiny
    toml = CompileProfile.from_toml_path(PROFILES / "flux2.rlx.toml")
    assert toml.name == "flux2"
    feed = inputs(model, rng, batch=1)
    want = reference(model, feed)
    for prof in (toml.evolve(fusion={"assert_clean": True}, precision={"compute": "f32"}),
                 CompileProfile.preset("flux2").evolve(fusion={"assert_clean": True})):
        m = rlx_core.load(path, backend="numpy", profile=prof, progress=False)
        assert m.profile.fusion.assert_clean
        assert np.abs(m.forward(**feed) - want).max() <= TOL


def test_default_profile_is_the_flux2_preset(tiny):
    m = rlx_core.load(tiny[2], backend="numpy", progress=False)
    assert m.profile.name == "flux2"


# ----------------------------------------------------------------------------- bad input
def test_mismatched_img_ids_length_names_the_input(tiny, rng):
    family, model, path = tiny
    m = rlx_core.load(path, backend="numpy", progress=False)
    feed = inputs(model, rng, batch=1)
    feed["img_ids"] = feed["img_ids"][:-1]
    with pytest.raises(ModelError, match=r"img_ids: expected \[60, \d\].*got \[59"):
        m.forward(**feed)
    feed = inputs(model, rng, batch=1)
    feed["txt_ids"] = feed["txt_ids"][:, :2]
    with pytest.raises(ModelError, match=r"txt_ids: expected \[7, \d\]"):
        m.forward(**feed)


def test_wrong_embedding_width_names_the_input(tiny, rng):
    family, model, path = tiny
    m = rlx_core.load(path, backend="numpy", progress=False)
    feed = inputs(model, rng, batch=1)
    feed["encoder_hidden_states"] = feed["encoder_hidden_states"][..., :-1]
    with pytest.raises(ModelError, match="encoder_hidden_states.*joint_attention_dim"):
        m.forward(**feed)
    feed = inputs(model, rng, batch=1)
    feed["hidden_states"] = np.concatenate([feed["hidden_states"]] * 2, -1)
    with pytest.raises(ModelError, match="hidden_states: 16 channels"):
        m.forward(**feed)
    if family == "flux1":
        feed = inputs(model, rng, batch=1)
        feed["pooled_projections"] = feed["pooled_projections"][:, :5]
        with pytest.raises(ModelError, match="pooled_projections: expected"):
            m.forward(**feed)
        feed.pop("pooled_projections")
        with pytest.raises(ModelError, match="pooled_projections"):
            m.forward(**feed)
    feed = inputs(model, rng, batch=1)
    feed.pop("guidance")
    with pytest.raises(ModelError, match="guidance"):
        m.forward(**feed)


def test_missing_block_weight_names_the_tensor(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    family, model, path = tiny
    src = Path(path)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    [weights] = list(src.glob("*.safetensors"))
    tensors = load_file(str(weights))
    gone = "single_transformer_blocks.1.attn.norm_k.weight"
    del tensors[gone]
    save_file(tensors, str(tmp_path / weights.name))
    m = rlx_core.load(str(tmp_path), backend="numpy", progress=False)
    feed = inputs(model, np.random.default_rng(0), batch=1)
    with pytest.raises(WeightError, match=f"missing 1: \\['{gone}'\\]"):
        m.forward(**feed)


@pytest.mark.parametrize("key, value, v2_only", [
    ("axes_dims_rope", [4, 4], False), ("guidance_embeds", "false", False), ("out_channels", "16", False),
    ("eps", "x", True), ("rope_theta", "x", True), ("mlp_ratio", True, True),
])
def test_bad_config_names_the_key(tiny, tmp_path, key, value, v2_only):
    """A value of the wrong type is refused, naming the key (bool("false") once read true, and
    int("16") / float("x") raised raw ValueErrors); FLUX.1 has no eps, rope_theta, mlp_ratio."""
    import json

    family, model, path = tiny
    if v2_only and family == "flux1":
        pytest.skip(f"FluxTransformer2DModel has no {key}")
    src = Path(path)
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("*.safetensors"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises((ModelError, WeightError), match=f"{key}"):
        rlx_core.load(str(tmp_path), backend="numpy", progress=False)


# ----------------------------------------------------------------------------- inspect
def test_rlx_inspect_prints_stages_and_stream_bindings(tiny):
    from click.testing import CliRunner

    from rlx_core.cli import main

    family, model, path = tiny
    r = CliRunner().invoke(main, ["inspect", path, "--backend", "numpy"])
    assert r.exit_code == 0, r.output
    out = r.output
    recipe = FAMILIES[family][0].name
    assert f"{FAMILIES[family][1]} through recipe {recipe} (" in out
    stages = out.split("# stages")[1].split("# streams")[0]
    assert "layers 0-1" in stages or "layer 0" in stages
    assert "flux_double_block" in stages and "flux_single_block" in stages and "multi_axis_rope" in stages
    streams = out.split("# streams")[1].split("# passes")[0]
    assert "img <- input hidden_states" in streams
    assert "txt <- input encoder_hidden_states" in streams
    assert "flux_double_block (layers 0-1)" in streams
    assert "flux_single_block (layers 2-3)" in streams
