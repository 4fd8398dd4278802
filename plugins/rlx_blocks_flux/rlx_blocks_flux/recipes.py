"""FluxFlow: the FLUX transformer as a flow of blocks and streams, and the registered recipes
(`FluxTransformer2DModel`, `Flux2Transformer2DModel`) that build a FluxModel from a diffusers
transformer folder.

Inputs (diffusers' forward, batch B, image tokens Si, text tokens St, static per shape):
hidden_states [B, Si, in_channels], encoder_hidden_states [B, St, joint_attention_dim],
timestep [B] (in [0, 1]; the model scales by 1000), img_ids [Si, axes], txt_ids [St, axes],
guidance [B] (guidance-distilled models), pooled_projections [B, pooled_dim] (FLUX.1).
"""
from __future__ import annotations

import numpy as np

from rlx_core.flow import ModelFlow
from rlx_core.flow.dit import AdaLnModulation, AdaNormOut, ConditionMlp, MultiAxisRope, TimestepEmbed
from rlx_core.flow.stream import IMG, MAIN, TXT
from rlx_core.ir.dtype import F32
from rlx_core.profile import CompileProfile

from .blocks import TEMB
from .config import FLUX1, FLUX2, FluxArch, flux_arch


class FluxFlow:
    """Recipe: the flow of one FLUX transformer forward at fixed sizes.

        FluxFlow(cfg, batch=1, img_len=4096, txt_len=512).flow().build(weights)
    """
    profile_name = "flux2"

    def __init__(self, cfg: dict, batch: int = 1, img_len: int = 16, txt_len: int = 8, guidance: bool | None = None,
                 profile=None):
        self.cfg, self.arch = dict(cfg), flux_arch(cfg)
        self.batch, self.img_len, self.txt_len = int(batch), int(img_len), int(txt_len)
        self.guidance = self.arch.guidance if guidance is None else guidance
        self._profile = profile if profile is not None else CompileProfile.preset(self.profile_name)

    def inputs(self, f: ModelFlow) -> ModelFlow:
        a, b = self.arch, self.batch
        f.input("hidden_states", (b, self.img_len, a.in_channels), F32)
        f.input("encoder_hidden_states", (b, self.txt_len, a.joint_dim), F32)
        f.input("timestep", (b,), F32)
        f.input("img_ids", (self.img_len, len(a.axes)), F32).input("txt_ids", (self.txt_len, len(a.axes)), F32)
        if self.guidance:
            f.input("guidance", (b,), F32)
        if a.version == 1:
            f.input("pooled_projections", (b, a.pooled_dim), F32)
        return f

    def conditioning(self, f: ModelFlow) -> ModelFlow:
        """Stream "temb": timestep (+ guidance) embeddings (+ pooled text, FLUX.1); FLUX.2 also
        the shared modulation vectors every block reads."""
        a = self.arch
        root = "time_text_embed" if a.version == 1 else "time_guidance_embed"
        f.raw_stage(TimestepEmbed("timestep", f"{root}.timestep_embedder", a.channels, bias=a.bias))
        f.store_stream(TEMB)
        if self.guidance:
            f.raw_stage(TimestepEmbed("guidance", f"{root}.guidance_embedder", a.channels, bias=a.bias))
            f.accumulate_stream(TEMB)
        if a.version == 1:
            f.raw_stage(ConditionMlp("pooled_projections", f"{root}.text_embedder")).accumulate_stream(TEMB)
        else:
            for key, n, name in (("double_stream_modulation_img", 6, "mod.img"),
                                 ("double_stream_modulation_txt", 6, "mod.txt"),
                                 ("single_stream_modulation", 3, "mod.single")):
                f.raw_stage(AdaLnModulation(TEMB, f"{key}.linear", n, name))
        return f

    def flow(self) -> ModelFlow:
        a = self.arch
        f = ModelFlow("flux" if a.version == 1 else "flux2", layer_prefix="transformer_blocks")
        f.profile(self._profile)
        self.inputs(f).bind_inputs_to_streams({IMG: "hidden_states", TXT: "encoder_hidden_states"})
        f.load_stream(IMG).linear("x_embedder.weight", bias="x_embedder.bias" if a.bias else None).store_stream(IMG)
        f.load_stream(TXT).linear("context_embedder.weight",
                                  bias="context_embedder.bias" if a.bias else None).store_stream(TXT)
        self.conditioning(f)
        f.raw_stage(MultiAxisRope(("txt_ids", "img_ids"), a.axes, a.theta))
        for i in range(a.double):
            f.layer(i, lambda s: s.plugin_named("flux_double_block", arch=a), prefix=f"transformer_blocks.{i}")
        f.join_streams((TXT, IMG), into=MAIN)
        for j in range(a.single):
            f.layer(a.double + j, lambda s: s.plugin_named("flux_single_block", arch=a),
                    prefix=f"single_transformer_blocks.{j}")
        f.split_stream(MAIN).load_stream(IMG)
        f.raw_stage(AdaNormOut(TEMB, "norm_out.linear", a.eps, a.bias))
        return f.linear("proj_out.weight", bias="proj_out.bias" if a.bias else None)

    def build(self, weights, **kw):
        return self.flow().build(weights, self.cfg, F32, **kw)


class FluxRecipe:
    """Registered recipe: a diffusers FluxTransformer2DModel folder -> FluxModel."""
    name = "flux"
    model_types = (FLUX1,)
    default_profile = "flux2"
    flow_class = FluxFlow

    def flow(self, cfg: dict, batch: int = 1, img_len: int = 16, txt_len: int = 8, guidance=None,
             profile=None) -> ModelFlow:
        return self.flow_class(cfg, batch, img_len, txt_len, guidance, profile).flow()

    def build(self, ckpt, backend=None, profile=None, **kw):
        from .model import FluxModel

        flux_arch(ckpt.config)                   # a bad config fails here, before any compile
        return FluxModel(self, ckpt.config, ckpt.tensors, backend, profile, source=ckpt.path, **kw)

    # -- tiny random models (tests; the rlx_core.testing hooks)
    def tiny_config(self) -> dict:
        """2 double + 2 single blocks, hidden 32 (2 heads of 16), guidance embeds."""
        return dict(_class_name=FLUX1, patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                    pooled_projection_dim=12, guidance_embeds=True, axes_dims_rope=[4, 6, 6])

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random diffusers-named tensors for `cfg`."""
        return {k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in tensor_shapes(flux_arch(cfg)).items()}


class Flux2Recipe(FluxRecipe):
    """Registered recipe: a diffusers Flux2Transformer2DModel folder -> FluxModel."""
    name = "flux2"
    model_types = (FLUX2,)

    def tiny_config(self) -> dict:
        return dict(_class_name=FLUX2, patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, mlp_ratio=3.0,
                    timestep_guidance_channels=32, axes_dims_rope=[4, 4, 4, 4], rope_theta=2000,
                    guidance_embeds=True)


def tensor_shapes(a: FluxArch) -> dict:
    """name -> shape of every tensor a diffusers FLUX transformer of `a` holds."""
    h, out = a.hidden, {}

    def lin(key, n_out, n_in, bias=a.bias):
        out[f"{key}.weight"] = (n_out, n_in)
        if bias:
            out[f"{key}.bias"] = (n_out,)

    root = "time_text_embed" if a.version == 1 else "time_guidance_embed"
    lin("x_embedder", h, a.in_channels)
    lin("context_embedder", h, a.joint_dim)
    for e in ("timestep_embedder",) + (("guidance_embedder",) if a.guidance else ()):
        lin(f"{root}.{e}.linear_1", h, a.channels)
        lin(f"{root}.{e}.linear_2", h, h)
    if a.version == 1:
        lin(f"{root}.text_embedder.linear_1", h, a.pooled_dim, True)
        lin(f"{root}.text_embedder.linear_2", h, h, True)
    else:
        lin("double_stream_modulation_img.linear", 6 * h, h)
        lin("double_stream_modulation_txt.linear", 6 * h, h)
        lin("single_stream_modulation.linear", 3 * h, h)
    for i in range(a.double):
        p = f"transformer_blocks.{i}"
        if a.version == 1:
            lin(f"{p}.norm1.linear", 6 * h, h)
            lin(f"{p}.norm1_context.linear", 6 * h, h)
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            lin(f"{p}.attn.{name}", h, h)
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            out[f"{p}.attn.{name}.weight"] = (a.head_dim,)
        lin(f"{p}.attn.to_out.0", h, h)
        lin(f"{p}.attn.to_add_out", h, h)
        for ff in ("ff", "ff_context"):
            if a.version == 1:
                lin(f"{p}.{ff}.net.0.proj", a.mlp_hidden, h)
                lin(f"{p}.{ff}.net.2", h, a.mlp_hidden)
            else:
                lin(f"{p}.{ff}.linear_in", 2 * a.mlp_hidden, h)
                lin(f"{p}.{ff}.linear_out", h, a.mlp_hidden)
    for j in range(a.single):
        p = f"single_transformer_blocks.{j}"
        out[f"{p}.attn.norm_q.weight"] = out[f"{p}.attn.norm_k.weight"] = (a.head_dim,)
        if a.version == 1:
            lin(f"{p}.norm.linear", 3 * h, h)
            for name in ("to_q", "to_k", "to_v"):
                lin(f"{p}.attn.{name}", h, h)
            lin(f"{p}.proj_mlp", a.mlp_hidden, h)
            lin(f"{p}.proj_out", h, h + a.mlp_hidden)
        else:
            lin(f"{p}.attn.to_qkv_mlp_proj", 3 * h + 2 * a.mlp_hidden, h)
            lin(f"{p}.attn.to_out", h, h + a.mlp_hidden)
    lin("norm_out.linear", 2 * h, h)
    lin("proj_out", a.out_channels, h)
    return out


__all__ = ["FluxFlow", "FluxRecipe", "Flux2Recipe", "tensor_shapes"]
