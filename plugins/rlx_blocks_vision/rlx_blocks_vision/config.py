"""The facts of an HF vision (or CLIP/SigLIP text) config the flows need, per family, checked:
a bad or unsupported value is a ModelError naming the config key and what was expected.

A tower is described by a `VisionArch` / `TextArch`: sizes, the checkpoint's key names and
the pieces its HF model class runs (class / register tokens, LayerScale, the FFN, the
pooling that gives HF's `pooler_output`)."""
from __future__ import annotations

import math

import attrs

from rlx_core.flow.vision import VitLayerKeys
from rlx_core.ir.errors import ModelError
from rlx_core.weights.config import config_source, hf_activation

# HF ViT / DINOv2 layer names (checkpoint names, as save_pretrained writes them)
VIT_KEYS = VitLayerKeys(norm1="layernorm_before", norm2="layernorm_after", q="attention.attention.query",
                        k="attention.attention.key", v="attention.attention.value",
                        o="attention.output.dense", fc1="intermediate.dense", fc2="output.dense")
DINOV2_KEYS = attrs.evolve(VIT_KEYS, norm1="norm1", norm2="norm2", fc1="mlp.fc1", fc2="mlp.fc2",
                           layer_scale=("layer_scale1.lambda1", "layer_scale2.lambda1"))
CLIP_KEYS = VitLayerKeys()          # layer_norm1, self_attn.{q,k,v,out}_proj, mlp.fc1/fc2


@attrs.frozen
class VisionArch:
    family: str                  # model_type of the tower's config
    hidden: int
    heads: int
    layers: int
    eps: float
    act: str                     # IR activation of the MLP
    patch: int
    image_size: int
    channels: int
    keys: VitLayerKeys
    prefix: str                  # "" or "vision_model." (a CLIP/SigLIP tower inside its model)
    layer_prefix: str            # "encoder.layer" / "encoder.layers" (under prefix)
    patch_key: str
    patch_bias: bool
    pos_key: str
    cls_key: str = ""            # "" when there is no class token (SigLIP)
    registers: int = 0           # DINOv2 register tokens (inserted after the class token)
    qkv_bias: bool = True
    pre_norm: str = ""           # CLIP's pre_layrnorm
    final_norm: str = ""         # applied to every token (ViT, DINOv2, SigLIP)
    pooling: str = "cls"         # cls | pooler (ViT's dense + act) | cls_norm (CLIP) | probe (SigLIP)
    pooler_act: str = "tanh"
    always_interpolate: bool = False     # DINOv2 resizes its positions to any grid
    antialias: bool = False              # DINOv2 with registers resizes antialiased
    projection: str = ""                 # CLIP's visual_projection (no bias)
    naflex: bool = False                 # pre-patchified variable-resolution images (SigLIP 2)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch


@attrs.frozen
class TextArch:
    family: str
    hidden: int
    heads: int
    layers: int
    eps: float
    act: str
    vocab: int
    max_positions: int
    causal: bool                 # CLIP's text tower is causal
    pooling: str                 # eos (CLIP) | last (SigLIP, padded to max_positions)
    eos_id: int | None
    pad_id: int
    head: str                    # "text_projection" (CLIP, no bias) or "text_model.head" (SigLIP)
    head_bias: bool
    keys: VitLayerKeys = CLIP_KEYS
    prefix: str = "text_model."


# ------------------------------------------------------------------------------ checked values
def _src(cfg: dict, where: str) -> str:
    return f"{config_source(cfg)}{where}"


def _int(cfg: dict, key: str, where: str = "", default=None, lo: int = 1) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        want = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ModelError(f"{_src(cfg, where)}: {key} must be {want}, got {v!r}")
    return v


def _real(cfg: dict, key: str, where: str = "", default=None) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelError(f"{_src(cfg, where)}: {key} must be a finite number > 0, got {v!r}")
    return float(v)


def _flag(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise ModelError(f"{_src(cfg, where)}: {key} must be true or false, got {v!r}")
    return v


def _image_size(cfg: dict, where: str, default: int) -> int:
    v = cfg.get("image_size", default)
    if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] == v[1]:
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelError(f"{_src(cfg, where)}: image_size must be a positive integer (square images), "
                         f"got {v!r}")
    return v


def _heads(cfg: dict, hidden: int, where: str) -> int:
    heads = _int(cfg, "num_attention_heads", where)
    if hidden % heads:
        raise ModelError(f"{_src(cfg, where)}: hidden_size {hidden} is not a multiple of "
                         f"num_attention_heads {heads}")
    return heads


def _common(cfg: dict, where: str, act_default: str, eps_default: float) -> dict:
    hidden = _int(cfg, "hidden_size", where)
    patch = _int(cfg, "patch_size", where)
    size = _image_size(cfg, where, 224)
    if size < patch:
        raise ModelError(f"{_src(cfg, where)}: image_size {size} is smaller than patch_size {patch}")
    channels = _int(cfg, "num_channels", where, 3)
    return dict(hidden=hidden, heads=_heads(cfg, hidden, where), layers=_int(cfg, "num_hidden_layers", where),
                eps=_real(cfg, "layer_norm_eps", where, eps_default),
                act=hf_activation(cfg, "hidden_act", default=act_default), patch=patch, image_size=size,
                channels=channels)


# ------------------------------------------------------------------------------ families
def vit_arch(cfg: dict, pooler: bool) -> VisionArch:
    """HF ViTModel: class token, pre-norm layers, final layernorm; `pooler` (the checkpoint
    has pooler.dense): HF's pooler_output is act(dense(CLS)), else the CLS token."""
    c = _common(cfg, "", "gelu", 1e-12)
    act = hf_activation(cfg, "pooler_act", default="tanh")
    return VisionArch(family="vit", keys=VIT_KEYS, prefix="", layer_prefix="encoder.layer",
                      patch_key="embeddings.patch_embeddings.projection", patch_bias=True,
                      pos_key="embeddings.position_embeddings", cls_key="embeddings.cls_token",
                      qkv_bias=_flag(cfg, "qkv_bias", "", True), final_norm="layernorm",
                      pooling="pooler" if pooler else "cls", pooler_act=act, **c)


def dinov2_arch(cfg: dict, swiglu_names: bool = False) -> VisionArch:
    """HF Dinov2Model / Dinov2WithRegistersModel: class (+ register) tokens, positions
    always resized to the image's grid, LayerScale, GELU or SwiGLU FFN; pooler_output is the
    CLS token after the final layernorm."""
    family = cfg.get("model_type", "dinov2")
    c = _common(cfg, "", "gelu", 1e-6)
    regs = _int(cfg, "num_register_tokens", "", 0, lo=0) if family == "dinov2_with_registers" else 0
    keys = DINOV2_KEYS
    if _flag(cfg, "use_swiglu_ffn", "", False):
        keys = attrs.evolve(keys, gate_up="mlp.weights_in", fc2="mlp.weights_out")
    _real(cfg, "mlp_ratio", "", 4)
    return VisionArch(family=family, keys=keys, prefix="", layer_prefix="encoder.layer",
                      patch_key="embeddings.patch_embeddings.projection", patch_bias=True,
                      pos_key="embeddings.position_embeddings", cls_key="embeddings.cls_token",
                      registers=regs, qkv_bias=_flag(cfg, "qkv_bias", "", True), final_norm="layernorm",
                      pooling="cls", always_interpolate=True, antialias=family == "dinov2_with_registers",
                      **c)


def clip_vision_arch(cfg: dict, where: str, prefix: str, projection: str) -> VisionArch:
    """HF CLIPVisionTransformer: class embedding, pre_layrnorm, layers (quick_gelu), the CLS
    token through post_layernorm (pooler_output), then visual_projection in a CLIPModel."""
    c = _common(cfg, where, "quick_gelu", 1e-5)
    return VisionArch(family="clip", keys=CLIP_KEYS, prefix=prefix, layer_prefix="encoder.layers",
                      patch_key="embeddings.patch_embedding", patch_bias=False,
                      pos_key="embeddings.position_embedding.weight", cls_key="embeddings.class_embedding",
                      pre_norm="pre_layrnorm", pooling="cls_norm", projection=projection, **c)


def siglip_vision_arch(cfg: dict, where: str, prefix: str) -> VisionArch:
    """HF SiglipVisionTransformer: no class token, post_layernorm, the attention-probe head."""
    c = _common(cfg, where, "gelu_pytorch_tanh", 1e-6)
    if not _flag(cfg, "vision_use_head", where, True):
        raise ModelError(f"{_src(cfg, where)}: vision_use_head=false is not supported (the model's "
                         "pooler_output is the attention-probe head's)")
    return VisionArch(family="siglip", keys=CLIP_KEYS, prefix=prefix, layer_prefix="encoder.layers",
                      patch_key="embeddings.patch_embedding", patch_bias=True,
                      pos_key="embeddings.position_embedding.weight", final_norm="post_layernorm",
                      pooling="probe", **c)


def siglip2_vision_arch(cfg: dict, where: str, prefix: str) -> VisionArch:
    """HF Siglip2VisionTransformer (NaFlex): pre-patchified pixels through a linear patch
    embedding, a square position table resized per image (antialiased bilinear) to its patch
    grid, a patch mask over the padding, post_layernorm, the masked attention-probe head."""
    n = _int(cfg, "num_patches", where, 256)
    side = int(round(math.sqrt(n)))
    if side * side != n:
        raise ModelError(f"{_src(cfg, where)}: num_patches must be a square number (the position "
                         f"table is a square grid), got {n}")
    patch = _int(cfg, "patch_size", where, 16)
    c = _common(dict(cfg, image_size=side * patch, patch_size=patch), where, "gelu_pytorch_tanh", 1e-6)
    if not _flag(cfg, "vision_use_head", where, True):
        raise ModelError(f"{_src(cfg, where)}: vision_use_head=false is not supported (the model's "
                         "pooler_output is the attention-probe head's)")
    return VisionArch(family="siglip2", keys=CLIP_KEYS, prefix=prefix, layer_prefix="encoder.layers",
                      patch_key="embeddings.patch_embedding", patch_bias=True,
                      pos_key="embeddings.position_embedding.weight", final_norm="post_layernorm",
                      pooling="probe", naflex=True, **c)


def text_arch(cfg: dict, family: str, where: str, pad_id: int | None) -> TextArch:
    """CLIPTextTransformer (causal, EOS-token pooling, text_projection) or SiglipTextTransformer
    (bidirectional, last token of texts padded to max_position_embeddings, its head)."""
    hidden = _int(cfg, "hidden_size", where)
    clip = family == "clip"
    vocab = _int(cfg, "vocab_size", where)
    eos = cfg.get("eos_token_id", 2 if clip else None)
    if clip and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab):
        raise ModelError(f"{_src(cfg, where)}: eos_token_id must be a token id below vocab_size {vocab} "
                         f"(CLIP pools the EOS token's state), got {eos!r}")
    pad = pad_id if pad_id is not None else cfg.get("pad_token_id") or 0
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab:
        raise ModelError(f"{_src(cfg, where)}: pad_token_id must be a token id below vocab_size {vocab}, "
                         f"got {pad!r}")
    return TextArch(family=family, hidden=hidden, heads=_heads(cfg, hidden, where),
                    layers=_int(cfg, "num_hidden_layers", where),
                    eps=_real(cfg, "layer_norm_eps", where, 1e-5 if clip else 1e-6),
                    act=hf_activation(cfg, "hidden_act", default="quick_gelu" if clip else "gelu_pytorch_tanh"),
                    vocab=vocab, max_positions=_int(cfg, "max_position_embeddings", where, 77 if clip else 64),
                    causal=clip, pooling="eos" if clip else "last", eos_id=eos if clip else None, pad_id=pad,
                    head="text_projection" if clip else "text_model.head", head_bias=not clip)


def sub_config(cfg: dict, key: str) -> dict:
    """config[key] (text_config / vision_config of a CLIP or SigLIP model), checked."""
    sub = cfg.get(key)
    if not isinstance(sub, dict):
        raise ModelError(f"{config_source(cfg)}: {key} must be an object (the tower's config), got {sub!r}")
    return sub


__all__ = ["VisionArch", "TextArch", "vit_arch", "dinov2_arch", "clip_vision_arch", "siglip_vision_arch", "siglip2_vision_arch",
           "text_arch", "sub_config", "VIT_KEYS", "DINOV2_KEYS", "CLIP_KEYS"]
