"""The flows of a vision tower and of a CLIP / SigLIP text tower, from their VisionArch /
TextArch.

Vision flow inputs: pixel_values [batch, C, H, W] (H, W static: the position table is
resized for that grid when built). Text flow inputs: ids, positions [batch, seq] and
pool_onehot [batch, seq] (1.0 at the token each text is pooled at). Outputs:
last_hidden_state, pooled (HF's pooler_output) and embedding (image_embeds / text_embeds:
pooled through the projection where the model has one); a vision flow also gives
pixel_check [batch] (PixelCheck: NaN for an image with a non-finite value)."""
from __future__ import annotations

import attrs

from rlx_core.flow import ModelFlow
from rlx_core.flow.blocks import LayerNorm
from rlx_core.flow.flow import LayerScope
from rlx_core.flow.vision import (AttentionProbeHead, Dense, InsertTokens, PatchEmbed, PatchLinear, PositionsAt,
                                  ResizedPositions, SelectToken, TokenEmbed, TokenPool, VitLayer, VitLayerSpec,
                                  WeightedPositions)
from rlx_core.ir.dtype import BOOL, F32, I64
from rlx_core.ir.errors import ModelError
from rlx_core.profile import CompileProfile

from .config import TextArch, VisionArch

PROFILE = "encoder"
PIXEL_CHECK = "pixel_check"


@attrs.frozen
class PixelCheck:
    """Output `pixel_check` [batch]: the f32 sum of 0 * every value of each image's pixels,
    0 where all are finite and NaN where one is NaN or inf (0 * inf is NaN). The check of
    the input runs with the model, on its backend (on a GPU: a read of the pixels already
    uploaded, instead of a host pass over them before the upload), and its [batch] result
    comes back with the embeddings. It sees the pixels as the model reads them: under a bf16
    compute profile cast to bf16, where an f32 beyond bf16's range is already inf. The value
    passes through."""
    input: str = "pixel_values"

    def emit(self, ctx, value):
        x = ctx.inputs.get(self.input)
        if x is None:
            raise ModelError(f"pixel_check: the flow has no {self.input!r} input")
        ctx.outputs[PIXEL_CHECK] = ctx.m.sum(x * 0.0, tuple(range(1, len(x.dims))))
        return value


def _layers(f: ModelFlow, n: int, prefix: str, spec: VitLayerSpec) -> None:
    for i in range(n):
        f.raw_stage(LayerScope(i, f"{prefix}.{i}", VitLayer(spec)))


def _norm(f: ModelFlow, key: str, eps: float) -> None:
    f.raw_stage(LayerNorm(f"{key}.weight", f"{key}.bias", eps))


def naflex_flow(a: VisionArch, batch="batch", tokens="tokens", profile=None, name: str = "") -> ModelFlow:
    """The variable-resolution tower: inputs pixel_values [batch, tokens, C*p*p] (patches cut
    by the processor, padded to one count), pos_weights [batch, tokens, grid*grid] (each
    image's position resize, grid_position_weights) and key_mask [batch, 1, 1, tokens]."""
    p = a.prefix
    f = ModelFlow(name or f"{a.family}_vision", layer_prefix=f"{p}{a.layer_prefix}")
    f.profile(profile or CompileProfile.preset(PROFILE))
    f.input("pixel_values", (batch, tokens, a.channels * a.patch * a.patch), F32)
    f.input("pos_weights", (batch, tokens, a.grid * a.grid), F32)
    f.input("key_mask", (batch, 1, 1, tokens), BOOL)
    f.raw_stage(PixelCheck())
    f.raw_stage(PatchLinear(f"{p}{a.patch_key}"))
    f.raw_stage(WeightedPositions(f"{p}{a.pos_key}"))
    spec = VitLayerSpec(a.hidden, a.heads, a.eps, a.act, a.qkv_bias, False, a.keys, mask_input="key_mask")
    _layers(f, a.layers, f"{p}{a.layer_prefix}", spec)
    _norm(f, f"{p}{a.final_norm}", a.eps)
    f.output("last_hidden_state")
    f.raw_stage(AttentionProbeHead(f"{p}head", a.heads, a.eps, a.act, mask_input="key_mask"))
    return f.output("pooled").output("embedding")


def vision_flow(a: VisionArch, height: int, width: int, interpolate: bool = False, batch="batch",
                profile=None, name: str = "") -> ModelFlow:
    """The vision tower for [batch, C, height, width] pixels."""
    p = a.prefix
    f = ModelFlow(name or f"{a.family}_vision", layer_prefix=f"{p}{a.layer_prefix}")
    f.profile(profile or CompileProfile.preset(PROFILE))
    f.input("pixel_values", (batch, a.channels, height, width), F32)
    f.raw_stage(PixelCheck())
    f.raw_stage(PatchEmbed(f"{p}{a.patch_key}", a.patch, a.patch_bias))
    if a.cls_key:
        f.raw_stage(InsertTokens(f"{p}{a.cls_key}", 0))
    grid = (height // a.patch, width // a.patch)
    f.raw_stage(ResizedPositions(f"{p}{a.pos_key}", grid, 1 if a.cls_key else 0, "bicubic", a.antialias,
                                 interpolate or a.always_interpolate))
    if a.registers:
        f.raw_stage(InsertTokens(f"{p}embeddings.register_tokens", 1))
    if a.pre_norm:
        _norm(f, f"{p}{a.pre_norm}", a.eps)
    spec = VitLayerSpec(a.hidden, a.heads, a.eps, a.act, a.qkv_bias, False, a.keys)
    _layers(f, a.layers, f"{p}{a.layer_prefix}", spec)
    if a.final_norm:
        _norm(f, f"{p}{a.final_norm}", a.eps)
    f.output("last_hidden_state")
    if a.pooling == "probe":
        f.raw_stage(AttentionProbeHead(f"{p}head", a.heads, a.eps, a.act))
    else:
        f.raw_stage(TokenPool(0))
        if a.pooling == "cls_norm":
            _norm(f, f"{p}post_layernorm", a.eps)
        elif a.pooling == "pooler":
            f.raw_stage(Dense("pooler.dense", True, a.pooler_act))
    f.output("pooled")
    if a.projection:
        f.raw_stage(Dense(a.projection, False))
    return f.output("embedding")


def text_flow(t: TextArch, batch="batch", seq="seq", profile=None, name: str = "") -> ModelFlow:
    """The text tower: token + position embeddings, layers (causal for CLIP), final norm, the
    token pool_onehot marks, the head / projection."""
    p = t.prefix
    f = ModelFlow(name or f"{t.family}_text", layer_prefix=f"{p}encoder.layers")
    f.profile(profile or CompileProfile.preset(PROFILE))
    f.input("ids", (batch, seq), I64).input("positions", (batch, seq), I64).input("pool_onehot", (batch, seq), F32)
    f.raw_stage(TokenEmbed(f"{p}embeddings.token_embedding.weight"))
    f.raw_stage(PositionsAt(f"{p}embeddings.position_embedding.weight"))
    spec = VitLayerSpec(t.hidden, t.heads, t.eps, t.act, True, t.causal, t.keys)
    _layers(f, t.layers, f"{p}encoder.layers", spec)
    _norm(f, f"{p}final_layer_norm", t.eps)
    f.output("last_hidden_state")
    f.raw_stage(SelectToken("pool_onehot"))
    if t.pooling == "last":                  # SigLIP: pooler_output is after the head
        f.raw_stage(Dense(t.head, t.head_bias)).output("pooled")
    else:                                    # CLIP: pooler_output is the EOS state
        f.output("pooled").raw_stage(Dense(t.head, t.head_bias))
    return f.output("embedding")


__all__ = ["vision_flow", "naflex_flow", "text_flow", "PixelCheck", "PIXEL_CHECK", "PROFILE"]
