"""SigLIP 2's NaFlex preprocessing (transformers' Siglip2ImageProcessorPil): each image keeps
its aspect ratio, resized so that it holds at most max_num_patches whole patches, rescaled,
normalized, cut into patches flattened as (patch row, patch col, channel), and padded to
max_num_patches with a mask. Decoding (files, bytes, arrays, PIL images; the pixel bound,
RGB conversion) is rlx_blocks_vision.images.ImageProcessor's."""
from __future__ import annotations

import json
import math
import os

import numpy as np

from rlx_core.ir.errors import ModelError

CONFIG_NAME = "preprocessor_config.json"
DEFAULTS = dict(patch_size=16, max_num_patches=256, resample=2, do_rescale=True, rescale_factor=1 / 255,
                do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=None)


def size_for_max_patches(height: int, width: int, patch: int, max_patches: int, eps: float = 1e-5) -> tuple:
    """(height, width), multiples of `patch`, of the largest scaling of the image with at most
    `max_patches` patches: HF's binary search (get_image_size_for_max_num_patches)."""
    def scaled(scale: float, size: int) -> int:
        return int(max(patch, math.ceil(size * scale / patch) * patch))

    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if (scaled(mid, height) / patch) * (scaled(mid, width) / patch) <= max_patches:
            lo = mid
        else:
            hi = mid
    return scaled(lo, height), scaled(lo, width)


def _number(cfg: dict, key: str, source: str, lo: float = 0.0) -> float:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= lo:
        raise ModelError(f"{source}: {key!r} must be a number > {lo:g}, got {v!r}")
    return float(v)


class NaflexProcessor:
    """`proc(images)` -> {"pixel_values": [N, max_patches, p*p*3] float32,
    "pixel_attention_mask": [N, max_patches] int32, "spatial_shapes": [N, 2] int64}."""

    def __init__(self, cfg: dict, source: str = CONFIG_NAME, max_pixels: int | None = None):
        from .images import ImageProcessor

        if not isinstance(cfg, dict):
            raise ModelError(f"{source}: must be a JSON object, got {type(cfg).__name__}")
        c = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        self.source = source
        for key in ("patch_size", "max_num_patches"):
            if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1:
                raise ModelError(f"{source}: {key!r} must be a positive integer, got {c[key]!r}")
        self.patch, self.max_patches = c["patch_size"], c["max_num_patches"]
        if c["resample"] not in (0, 1, 2, 3, 4, 5) or isinstance(c["resample"], bool):
            raise ModelError(f"{source}: 'resample' must be a Pillow filter id 0-5, got {c['resample']!r}")
        self.resample = c["resample"]
        x = np.arange(256, dtype=np.uint8)[None, :].repeat(3, axis=0)   # HF's arithmetic per level
        if c["do_rescale"]:
            x = (x.astype(np.float64) * _number(c, "rescale_factor", source)).astype(np.float32)
        x = x.astype(np.float32)
        if c["do_normalize"]:
            mean = np.broadcast_to(np.asarray(c["image_mean"], np.float32), (3,))
            std = np.broadcast_to(np.asarray(c["image_std"], np.float32), (3,))
            if not (std != 0).all():
                raise ModelError(f"{source}: 'image_std' must not be 0, got {c['image_std']!r}")
            x = (x - mean[:, None]) / std[:, None]
        self.levels = np.ascontiguousarray(x, np.float32)
        # decoding and RGB conversion only: the crop-free processor with every step off
        self.decoder = ImageProcessor.from_dict(
            {"image_processor_type": "SiglipImageProcessor", "do_resize": False, "do_rescale": False,
             "do_normalize": False, "do_center_crop": False, "do_convert_rgb": c["do_convert_rgb"]},
            source, max_pixels=max_pixels)

    @classmethod
    def from_folder(cls, path, max_pixels: int | None = None) -> "NaflexProcessor":
        file = os.path.join(os.fspath(path), CONFIG_NAME)
        try:
            with open(file, encoding="utf-8") as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ModelError(f"{file}: missing; a SigLIP 2 checkpoint needs its preprocessing config "
                             "(patch_size, max_num_patches, normalization)") from None
        except (OSError, ValueError) as e:
            raise ModelError(f"{file}: not a readable JSON file ({e})") from None
        return cls(cfg, file, max_pixels)

    def one(self, item, index: int = 0) -> tuple:
        """(patches [h*w, p*p*3] float32, (h, w)) of one image."""
        from PIL import Image

        from .images import _source_name

        name = _source_name(item, index)
        rgb = self.decoder.rgb(self.decoder.decode(item, name), name)
        h, w = size_for_max_patches(rgb.shape[0], rgb.shape[1], self.patch, self.max_patches)
        if (h, w) != rgb.shape[:2]:
            rgb = np.asarray(Image.fromarray(rgb).resize((w, h), resample=self.resample))
        x = np.empty((h, w, 3), np.float32)
        for c in range(3):
            np.take(self.levels[c], rgb[..., c], out=x[..., c])
        p = self.patch
        patches = x.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 1, 3, 4).reshape((h // p) * (w // p), -1)
        return patches, (h // p, w // p)

    def __call__(self, images) -> dict:
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ModelError("no images given; expected a list of paths, bytes, arrays or PIL images")
        n = len(images)
        pixels = np.zeros((n, self.max_patches, self.patch * self.patch * 3), np.float32)
        mask = np.zeros((n, self.max_patches), np.int32)
        shapes = np.zeros((n, 2), np.int64)
        for i, item in enumerate(images):
            patches, shapes[i] = self.one(item, i)
            pixels[i, :len(patches)], mask[i, :len(patches)] = patches, 1
        return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}


__all__ = ["NaflexProcessor", "size_for_max_patches"]
