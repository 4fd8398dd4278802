"""The registered recipes (HF model types vit, dinov2, dinov2_with_registers, clip,
clip_vision_model, siglip, siglip_vision_model, siglip2, siglip2_vision_model) that read a
checkpoint's config into a VisionArch (+ TextArch) and build a VisionModel, and each
recipe's tiny model for the conformance kit."""
from __future__ import annotations

import abc

import numpy as np

from rlx_core.flow import ModelFlow
from rlx_core.ir.errors import ModelError
from rlx_core.weights.config import check_config, config_source

from .config import (TextArch, VisionArch, clip_vision_arch, dinov2_arch, siglip2_vision_arch, siglip_vision_arch,
                     sub_config, text_arch, vit_arch)
from .flows import PROFILE, text_flow, vision_flow
from .model import VisionModel

TINY_VISION = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48)
TINY_TEXT = dict(TINY_VISION, vocab_size=40, max_position_embeddings=12, pad_token_id=0)


# ------------------------------------------------------------------------------ recipes
def strip_prefix(tensors, prefix: str, drop: tuple = ()) -> dict:
    """Checkpoint tensors with a task model's `prefix` (ViTForImageClassification's `vit.`)
    removed and its task heads (`drop`) left out."""
    has = any(k.startswith(prefix) for k in tensors)
    out = {}
    for k, v in tensors.items():
        if k.startswith(drop):
            continue
        out[k[len(prefix):] if has and k.startswith(prefix) else k] = v
    return out


def _tower_prefix(tensors) -> str:
    """A vision-only model's key prefix: "vision_model." as HF's hub checkpoints have it, or
    none (as some transformers versions save a bare SiglipVisionModel)."""
    return "vision_model." if any(k.startswith("vision_model.") for k in tensors) or not tensors else ""


class VisionRecipe(abc.ABC):
    """A registered recipe: checkpoint -> rlx_blocks_vision.model.VisionModel. Subclasses say
    how to read the config into a VisionArch (and a TextArch for two-tower models)."""
    name = "vision"
    model_types: tuple = ()
    default_profile = PROFILE
    ignore_unused: tuple = ()
    task_prefix = ""
    task_heads: tuple = ()
    interpolate_default = False

    def tensors(self, tensors) -> dict:
        return strip_prefix(tensors, self.task_prefix, self.task_heads) if self.task_prefix else dict(tensors)

    @abc.abstractmethod
    def vision_arch(self, cfg: dict, tensors) -> VisionArch:
        """The vision tower's shape and tensor names, read from `cfg` (and the checkpoint's tensors)."""

    def text_arch(self, cfg: dict, tokenizer=None) -> TextArch | None:
        return None

    def logit_keys(self) -> tuple:
        """(logit_scale, logit_bias) tensor names of a two-tower model ("" where it has none)."""
        return ("", "")

    def vision_flow(self, cfg: dict, tensors, height: int, width: int, interpolate: bool = False,
                    profile=None) -> ModelFlow:
        return vision_flow(self.vision_arch(cfg, tensors), height, width, interpolate, profile=profile)

    def text_flow(self, cfg: dict, tokenizer=None, profile=None) -> ModelFlow:
        t = self.text_arch(cfg, tokenizer)
        if t is None:
            raise ModelError(f"{config_source(cfg)}: a {cfg.get('model_type')} model has no text tower")
        return text_flow(t, profile=profile)

    def build(self, ckpt, backend=None, profile=None, **kw):
        cfg = dict(ckpt.config)
        check_config(cfg, config_source(cfg), ModelError)
        tensors = self.tensors(ckpt.tensors)
        self.vision_arch(cfg, tensors)                 # an unsupported variant fails here, by key
        self.text_arch(cfg, ckpt.tokenizer)
        return VisionModel(self, cfg, tensors, ckpt.tokenizer, backend, profile, source=ckpt.path, **kw)


class ViTRecipe(VisionRecipe):
    """HF ViTModel (and ViTForImageClassification's encoder). pooled: the pooler's
    act(dense(CLS)) where the checkpoint has pooler.dense, else the CLS token after the final
    layernorm."""
    name = "vit"
    model_types = ("vit",)
    task_prefix = "vit."
    task_heads = ("classifier.",)
    ignore_unused = ("embeddings.mask_token",)

    def vision_arch(self, cfg, tensors):
        return vit_arch(cfg, pooler="pooler.dense.weight" in tensors)


    def tiny_config(self) -> dict:
        """A small ViT with its pooler: patch 16 on 35x35 images (a 2x2 grid)."""
        return dict(model_type="vit", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                    intermediate_size=48, image_size=35, patch_size=16, layer_norm_eps=1e-12)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        a = vit_arch(cfg, pooler=True)
        return random_like(vision_shapes(cfg, a), rng)


class Dinov2Recipe(VisionRecipe):
    """HF Dinov2Model / Dinov2WithRegistersModel: pooled is the CLS token after the final norm."""
    name = "dinov2"
    model_types = ("dinov2", "dinov2_with_registers")
    task_prefix = "dinov2."
    task_heads = ("classifier.",)
    ignore_unused = ("embeddings.mask_token",)
    interpolate_default = True

    def vision_arch(self, cfg, tensors):
        return dinov2_arch(cfg)

    def tiny_config(self) -> dict:
        """DINOv2 with 2 registers and the SwiGLU FFN: patch 14 on 42x42 images."""
        return dict(model_type="dinov2_with_registers", hidden_size=32, num_attention_heads=4,
                    num_hidden_layers=2, mlp_ratio=3, use_swiglu_ffn=True, num_register_tokens=2,
                    image_size=42, patch_size=14, layer_norm_eps=1e-6)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        return random_like(vision_shapes(cfg, dinov2_arch(cfg)), rng)


class ClipRecipe(VisionRecipe):
    """HF CLIPModel (image and text towers; embeddings after visual_projection and
    text_projection, logits scaled by exp(logit_scale)) and CLIPVisionModel /
    CLIPVisionModelWithProjection (model_type clip_vision_model)."""
    name = "clip"
    model_types = ("clip", "clip_vision_model")

    def vision_arch(self, cfg, tensors):
        if cfg.get("model_type") == "clip_vision_model":
            proj = "visual_projection" if "visual_projection.weight" in tensors else ""
            return clip_vision_arch(cfg, "", _tower_prefix(tensors), proj)
        return clip_vision_arch(sub_config(cfg, "vision_config"), " (vision_config)", "vision_model.",
                                "visual_projection")

    def text_arch(self, cfg, tokenizer=None):
        if cfg.get("model_type") == "clip_vision_model":
            return None
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        return text_arch(sub_config(cfg, "text_config"), "clip", " (text_config)", pad)

    def logit_keys(self):
        return ("logit_scale", "")

    def tiny_config(self) -> dict:
        """CLIP with both towers: patch 16 on 33x33 images, a causal text tower (EOS id 3)."""
        return dict(model_type="clip", projection_dim=24, logit_scale_init_value=2.6592,
                    text_config=dict(TINY_TEXT, eos_token_id=3),
                    vision_config=dict(TINY_VISION, image_size=33, patch_size=16))

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        t = random_like({**vision_shapes(cfg["vision_config"], self.vision_arch(cfg, {})),
                         **text_shapes(cfg["text_config"], self.text_arch(cfg), cfg["projection_dim"])}, rng)
        t["logit_scale"] = np.float32(2.6592).reshape(())
        return t


class SiglipRecipe(VisionRecipe):
    """HF SiglipModel (image and text towers; logits exp(logit_scale) * cosine + logit_bias)
    and SiglipVisionModel (model_type siglip_vision_model). Fixed-resolution SigLIP 2
    checkpoints are `siglip` models too."""
    name = "siglip"
    model_types = ("siglip", "siglip_vision_model")

    def vision_arch(self, cfg, tensors):
        if cfg.get("model_type") == "siglip_vision_model":
            return siglip_vision_arch(cfg, "", _tower_prefix(tensors))
        return siglip_vision_arch(sub_config(cfg, "vision_config"), " (vision_config)", "vision_model.")

    def text_arch(self, cfg, tokenizer=None):
        if cfg.get("model_type") == "siglip_vision_model":
            return None
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        return text_arch(sub_config(cfg, "text_config"), "siglip", " (text_config)", pad)

    def logit_keys(self):
        return ("logit_scale", "logit_bias")

    def tiny_config(self) -> dict:
        """SigLIP with both towers: patch 14 on 30x30 images, the attention-probe head."""
        return dict(model_type="siglip", text_config=dict(TINY_TEXT, projection_size=32),
                    vision_config=dict(TINY_VISION, image_size=30, patch_size=14))

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        t = random_like({**vision_shapes(cfg["vision_config"], self.vision_arch(cfg, {})),
                         **text_shapes(cfg["text_config"], self.text_arch(cfg), 32)}, rng)
        t["logit_scale"], t["logit_bias"] = np.array([2.3], np.float32), np.array([-10.0], np.float32)
        return t


class Siglip2Recipe(SiglipRecipe):
    """HF Siglip2Model / Siglip2VisionModel: SigLIP 2's NaFlex (variable-resolution) form.
    Images keep their aspect ratio: the processor resizes each to at most max_num_patches
    patches, cuts them, and pads to that count; the model resizes its position table to each
    image's grid and masks the padding. (Fixed-resolution SigLIP 2 checkpoints declare
    model_type siglip and load through SiglipRecipe.)"""
    name = "siglip2"
    model_types = ("siglip2", "siglip2_vision_model")

    def vision_arch(self, cfg, tensors):
        if cfg.get("model_type") == "siglip2_vision_model":
            return siglip2_vision_arch(cfg, "", _tower_prefix(tensors))
        return siglip2_vision_arch(sub_config(cfg, "vision_config"), " (vision_config)", "vision_model.")

    def text_arch(self, cfg, tokenizer=None):
        if cfg.get("model_type") == "siglip2_vision_model":
            return None
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        return text_arch(sub_config(cfg, "text_config"), "siglip", " (text_config)", pad)

    def tiny_config(self) -> dict:
        """SigLIP 2 NaFlex with both towers: patch 4, a 3x3 position grid (num_patches 9)."""
        return dict(model_type="siglip2", text_config=dict(TINY_TEXT, projection_size=32),
                    vision_config=dict(TINY_VISION, num_patches=9, patch_size=4))

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        a = self.vision_arch(cfg, {})
        shapes = vision_shapes(cfg["vision_config"], a)
        t = random_like({**shapes, **text_shapes(cfg["text_config"], self.text_arch(cfg), 32)}, rng)
        t["logit_scale"], t["logit_bias"] = np.array([2.3], np.float32), np.array([-10.0], np.float32)
        return t


RECIPES = (ViTRecipe, Dinov2Recipe, ClipRecipe, SiglipRecipe, Siglip2Recipe)


# ------------------------------------------------------------------------------ tiny models (the kit)
def _layer_shapes(prefix: str, keys, d: int, inter: int, qkv_bias: bool = True) -> dict:
    out = {}
    for n in (keys.norm1, keys.norm2):
        out[f"{prefix}.{n}.weight"] = out[f"{prefix}.{n}.bias"] = (d,)
    for n in (keys.q, keys.k, keys.v, keys.o):
        out[f"{prefix}.{n}.weight"] = (d, d)
        if qkv_bias or n == keys.o:
            out[f"{prefix}.{n}.bias"] = (d,)
    if keys.gate_up:
        out[f"{prefix}.{keys.gate_up}.weight"], out[f"{prefix}.{keys.gate_up}.bias"] = (2 * inter, d), (2 * inter,)
    else:
        out[f"{prefix}.{keys.fc1}.weight"], out[f"{prefix}.{keys.fc1}.bias"] = (inter, d), (inter,)
    out[f"{prefix}.{keys.fc2}.weight"], out[f"{prefix}.{keys.fc2}.bias"] = (d, inter), (d,)
    for n in keys.layer_scale:
        out[f"{prefix}.{n}"] = (d,)
    return out


def _intermediate(cfg: dict, a: VisionArch) -> int:
    if a.family.startswith("dinov2"):
        inter = int(a.hidden * cfg.get("mlp_ratio", 4))
        return (int(inter * 2 / 3) + 7) // 8 * 8 if a.keys.gate_up else inter
    return int(cfg["intermediate_size"])


def vision_shapes(cfg: dict, a: VisionArch) -> dict:
    """name -> shape of every tensor an HF checkpoint of vision tower `a` holds (`cfg`: its config)."""
    p, d, n = a.prefix, a.hidden, a.grid * a.grid
    out = {f"{p}{a.patch_key}.weight": (d, a.channels * a.patch * a.patch) if a.naflex else
           (d, a.channels, a.patch, a.patch)}
    if a.patch_bias:
        out[f"{p}{a.patch_key}.bias"] = (d,)
    if a.cls_key:
        out[f"{p}{a.cls_key}"] = (d,) if a.family == "clip" else (1, 1, d)
    out[f"{p}{a.pos_key}"] = (n + 1, d) if a.family == "clip" else (n, d) if not a.cls_key else (1, n + 1, d)
    if a.registers:
        out[f"{p}embeddings.register_tokens"] = (1, a.registers, d)
    for key in (a.pre_norm, a.final_norm, "post_layernorm" if a.pooling == "cls_norm" else ""):
        if key:
            out[f"{p}{key}.weight"] = out[f"{p}{key}.bias"] = (d,)
    inter = _intermediate(cfg, a)
    for i in range(a.layers):
        out.update(_layer_shapes(f"{p}{a.layer_prefix}.{i}", a.keys, d, inter, a.qkv_bias))
    if a.pooling == "pooler":
        out["pooler.dense.weight"], out["pooler.dense.bias"] = (d, d), (d,)
    if a.pooling == "probe":
        h = f"{p}head"
        out.update({f"{h}.probe": (1, 1, d), f"{h}.attention.in_proj_weight": (3 * d, d),
                    f"{h}.attention.in_proj_bias": (3 * d,), f"{h}.attention.out_proj.weight": (d, d),
                    f"{h}.attention.out_proj.bias": (d,), f"{h}.layernorm.weight": (d,), f"{h}.layernorm.bias": (d,),
                    f"{h}.mlp.fc1.weight": (inter, d), f"{h}.mlp.fc1.bias": (inter,),
                    f"{h}.mlp.fc2.weight": (d, inter), f"{h}.mlp.fc2.bias": (d,)})
    if a.projection:
        out[f"{a.projection}.weight"] = (int(cfg.get("projection_dim") or d), d)
    return out


def text_shapes(cfg: dict, t: TextArch, projection: int) -> dict:
    """name -> shape of every tensor of text tower `t` (`cfg`: its text_config)."""
    p, d = t.prefix, t.hidden
    out = {f"{p}embeddings.token_embedding.weight": (t.vocab, d),
           f"{p}embeddings.position_embedding.weight": (t.max_positions, d),
           f"{p}final_layer_norm.weight": (d,), f"{p}final_layer_norm.bias": (d,)}
    for i in range(t.layers):
        out.update(_layer_shapes(f"{p}encoder.layers.{i}", t.keys, d, int(cfg["intermediate_size"])))
    out[f"{t.head}.weight"] = (projection, d)
    if t.head_bias:
        out[f"{t.head}.bias"] = (projection,)
    return out


def random_like(shapes: dict, rng) -> dict:
    """float32 N(0, 0.2^2) tensors; norm weights and LayerScale around 1."""
    def one(k):
        return k.endswith(".weight") and ("norm" in k or "layrnorm" in k)

    return {k: (0.2 * rng.standard_normal(s) + (1.0 if one(k) else 0.0)).astype(np.float32)
            for k, s in shapes.items()}


__all__ = ["VisionRecipe", "ViTRecipe", "Dinov2Recipe", "ClipRecipe", "SiglipRecipe", "Siglip2Recipe",
           "RECIPES", "vision_flow", "text_flow", "strip_prefix", "vision_shapes", "text_shapes",
           "random_like"]
