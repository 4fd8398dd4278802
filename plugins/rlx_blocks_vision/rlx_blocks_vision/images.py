"""Images in: decoding files, bytes, arrays and PIL images, and a checkpoint's own
preprocessing (preprocessor_config.json) into the float32 [N, 3, H, W] pixels a vision tower
takes.

`ImageProcessor` reproduces transformers' Pillow/NumPy image processors (the `use_fast=False`
ones: ViTImageProcessor, BitImageProcessor (DINOv2), CLIPImageProcessor, SiglipImageProcessor)
step for step: the same Pillow resize (same filter, from the same uint8 RGB image), the same
center crop (zero-padded when the image is smaller), rescale in float64 then float32, and
normalize in float32, so the tensor matches HF's to rounding. Keys a config leaves out take
the defaults of the processor class it names, as HF does.

Files and bytes are opened lazily and refused before any pixel is decoded when they hold more
than `max_pixels` pixels (default DEFAULT_MAX_PIXELS, or the RLX_MAX_IMAGE_PIXELS environment
variable): a small compressed file can decode to gigabytes. Their EXIF orientation is applied,
as HF's load_image does. An image that is not 8-bit RGB is converted as HF's convert_to_rgb
does (alpha composited onto white) when the config says do_convert_rgb, and refused otherwise:
HF would hand the model one or four channels, or 16-bit values it clips. (Given a path, HF's
load_image converts every file to RGB first, dropping alpha rather than compositing it; a
file here is treated as HF treats the opened image, so a transparent file matches
processor(Image.open(path)), and an RGB file matches either.)"""
from __future__ import annotations

import io
import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rlx_core.ir.errors import ModelError

DEFAULT_MAX_PIXELS = 64_000_000          # 64 megapixels: 8000 x 8000
MAX_PIXELS_ENV = "RLX_MAX_IMAGE_PIXELS"
CONFIG_NAME = "preprocessor_config.json"
# the encoded formats read: the common image files; not every format Pillow knows (EPS would
# run Ghostscript on bytes a server's client sent)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")       # (JPEG's opener reads MPO too)

_IMAGENET_STANDARD = (0.5, 0.5, 0.5)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# transformers' BaseImageProcessor defaults, then each PilBackend subclass's class attributes
_BASE = {"do_convert_rgb": None, "do_resize": None, "size": None, "default_to_square": True,
         "crop_size": None, "resample": None, "do_rescale": None, "rescale_factor": 1 / 255,
         "do_normalize": None, "image_mean": None, "image_std": None, "do_center_crop": None,
         "do_pad": None, "pad_size": None}
_CROP_224 = {"resample": 3, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "size": {"shortest_edge": 224},
             "default_to_square": False, "crop_size": {"height": 224, "width": 224}, "do_resize": True,
             "do_center_crop": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
CLASS_DEFAULTS: dict[str, dict] = {
    "ViTImageProcessor": {"resample": 2, "image_mean": _IMAGENET_STANDARD, "image_std": _IMAGENET_STANDARD,
                          "size": {"height": 224, "width": 224}, "do_resize": True, "do_rescale": True,
                          "do_normalize": True},
    "BitImageProcessor": _CROP_224,
    "CLIPImageProcessor": _CROP_224,
    "SiglipImageProcessor": {"resample": 3, "image_mean": _IMAGENET_STANDARD, "image_std": _IMAGENET_STANDARD,
                             "size": {"height": 224, "width": 224}, "default_to_square": False,
                             "do_resize": True, "do_rescale": True, "do_normalize": True,
                             "do_convert_rgb": True},
}
# older configs name a feature extractor; a config without either takes its model type's class
_FEATURE_EXTRACTORS = {"ViTFeatureExtractor": "ViTImageProcessor", "CLIPFeatureExtractor": "CLIPImageProcessor"}
MODEL_TYPE_PROCESSOR = {"vit": "ViTImageProcessor", "dinov2": "BitImageProcessor",
                        "dinov2_with_registers": "BitImageProcessor", "clip": "CLIPImageProcessor",
                        "clip_vision_model": "CLIPImageProcessor", "siglip": "SiglipImageProcessor",
                        "siglip_vision_model": "SiglipImageProcessor"}
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_MODE_NAMES = {"L": "8-bit grayscale", "LA": "grayscale with alpha", "1": "1-bit", "P": "palette",
               "PA": "palette with alpha", "RGBA": "RGBA (with alpha)", "CMYK": "CMYK", "YCbCr": "YCbCr",
               "I;16": "16-bit grayscale", "I;16B": "16-bit grayscale", "I;16L": "16-bit grayscale",
               "I": "32-bit integer", "F": "32-bit float", "LAB": "Lab", "HSV": "HSV"}
_OPEN_LOCK = threading.Lock()


def _pil():
    """Pillow, imported on first use (importing the plugin does not need it)."""
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ModelError("reading images needs Pillow: pip install pillow") from None
    return Image, ImageOps


def max_pixels_default() -> int:
    """The pixel bound: RLX_MAX_IMAGE_PIXELS when set, else DEFAULT_MAX_PIXELS."""
    raw = os.environ.get(MAX_PIXELS_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_MAX_PIXELS
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise ModelError(f"{MAX_PIXELS_ENV} must be a whole number of pixels >= 1, got {raw!r}")
    return value


def preprocess_threads() -> int:
    """Threads that preprocess a batch of images: RLX_NUM_THREADS (as the CPU backends use),
    else every core."""
    raw = os.environ.get("RLX_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else (os.cpu_count() or 1)


def patch_grid(height: int, width: int, patch: int, where: str) -> tuple[int, int]:
    """(rows, cols) of patches for an image of height x width; a ModelError naming `where`
    (the config key or file that fixes the size) when a side is not a multiple of `patch`."""
    if height % patch or width % patch:
        raise ModelError(f"{where}: a {height}x{width} image is not a whole number of {patch}x{patch} "
                         f"patches; expected both sides to be multiples of {patch}")
    return height // patch, width // patch


# ----------------------------------------------------------------------------- decoding
def _describe_mode(mode: str) -> str:
    return _MODE_NAMES.get(mode, f"mode {mode}")


def _open_encoded(data: bytes, name: str, max_pixels: int):
    """A decoded PIL image from encoded bytes: refused from its header when larger than
    max_pixels (before any pixel is decoded), a ModelError for a non-image or truncated file;
    EXIF orientation applied (as HF's load_image)."""
    Image, ImageOps = _pil()
    from PIL import UnidentifiedImageError

    with _OPEN_LOCK:                      # Pillow's own bomb bound is lifted so ours governs
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)    # lazy: reads the header only
        except UnidentifiedImageError:
            raise ModelError(f"{name}: not an image file of a format read here "
                             f"({', '.join(IMAGE_FORMATS)})") from None
        except Exception as e:                          # a known format whose header is cut or broken
            raise ModelError(f"{name}: the image data is truncated or corrupt ({e})") from None
        finally:
            Image.MAX_IMAGE_PIXELS = saved
    w, h = img.size
    if w * h > max_pixels:
        raise ModelError(f"{name}: a {w}x{h} image ({w * h:,} pixels) is over the bound of {max_pixels:,} "
                         f"pixels; raise it with {MAX_PIXELS_ENV} or max_pixels= if the image is trusted")
    try:
        img.load()
    except Exception as e:                              # OSError: truncated; others: corrupt data
        raise ModelError(f"{name}: the {img.format or 'image'} data is truncated or corrupt ({e})") from None
    return ImageOps.exif_transpose(img)


def _read_file(path, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ModelError(f"{name}: no such image file") from None
    except IsADirectoryError:
        raise ModelError(f"{name}: is a directory, not an image file") from None
    except OSError as e:
        raise ModelError(f"{name}: cannot read the image file ({e.strerror or e})") from None


def _source_name(item, index: int) -> str:
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    kind = "bytes" if isinstance(item, (bytes, bytearray, memoryview)) else type(item).__name__
    return f"image {index} ({kind})"


# ----------------------------------------------------------------------------- config
def _is_bool(v) -> bool:
    return v is None or isinstance(v, bool)


def _size_dict(value, key: str, default_to_square: bool, source: str) -> dict:
    """A size value as HF's get_size_dict reads it: an int (a square, or the shortest edge when
    not default_to_square), [height, width], or a dict with height+width or shortest_edge."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict):
        keys = set(value)
        if keys in ({"height", "width"}, {"shortest_edge"}) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value.values()):
            return dict(value)
    raise ModelError(f"{source}: '{key}' must be a positive int, [height, width], "
                     f"{{\"height\", \"width\"}} or {{\"shortest_edge\"}} (the forms this plugin reproduces), "
                     f"got {value!r}"[:400])


def _channels(value, key: str, source: str, nonzero: bool = False) -> tuple:
    vals = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not (isinstance(vals, (list, tuple)) and len(vals) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals)):
        raise ModelError(f"{source}: '{key}' must be a number or 3 numbers (R, G, B), got {value!r}"[:300])
    if nonzero and any(v == 0 for v in vals):
        raise ModelError(f"{source}: '{key}' must not contain 0 (it divides), got {value!r}")
    return tuple(float(v) for v in vals)


def processor_class(cfg: dict, source: str, model_type: str | None = None) -> str:
    """The HF processor class whose defaults fill the keys `cfg` leaves out."""
    name = cfg.get("image_processor_type")
    if name is None and cfg.get("feature_extractor_type") is not None:
        name = _FEATURE_EXTRACTORS.get(cfg["feature_extractor_type"], cfg["feature_extractor_type"])
        key = "feature_extractor_type"
    else:
        key = "image_processor_type"
    if name is None:
        if model_type in MODEL_TYPE_PROCESSOR:
            return MODEL_TYPE_PROCESSOR[model_type]
        raise ModelError(f"{source}: no 'image_processor_type' (expected one of {sorted(CLASS_DEFAULTS)})"
                         + (f" and model type {model_type!r} has no default processor" if model_type else ""))
    if not isinstance(name, str):
        raise ModelError(f"{source}: '{key}' must be a string, got {name!r}"[:300])
    for suffix in ("Fast", "Pil"):
        if name.endswith(suffix) and name[:-len(suffix)] in CLASS_DEFAULTS:
            name = name[:-len(suffix)]
    if name not in CLASS_DEFAULTS:
        raise ModelError(f"{source}: '{key}' is {name!r}; this plugin reproduces {sorted(CLASS_DEFAULTS)}"[:400])
    return name


class ImageProcessor:
    """A checkpoint's image preprocessing, as transformers' Pillow image processor of the same
    config computes it. `proc(images)` -> float32 [N, 3, H, W]; images are paths, encoded
    bytes, numpy uint8 arrays [H, W, 3] (or [H, W] / [H, W, 1] / [H, W, 4] when the config
    converts to RGB) or PIL images. `max_pixels` bounds a decoded file (see the module)."""

    def __init__(self, cfg: dict, source: str = CONFIG_NAME, model_type: str | None = None,
                 max_pixels: int | None = None):
        if not isinstance(cfg, dict):
            raise ModelError(f"{source}: must be a JSON object, got {type(cfg).__name__}")
        self.source = source
        self.kind = processor_class(cfg, source, model_type)
        merged = {**_BASE, **CLASS_DEFAULTS[self.kind], **{k: v for k, v in cfg.items() if v is not None}}
        for key in ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_pad",
                    "default_to_square"):
            if not _is_bool(merged[key]):
                raise ModelError(f"{source}: '{key}' must be true or false, got {merged[key]!r}"[:300])
        if merged["do_pad"]:
            raise ModelError(f"{source}: 'do_pad' is true; padding is not a step these processors take")
        self.convert_rgb = bool(merged["do_convert_rgb"])
        self.resize_to = self.crop_to = None
        if merged["do_resize"]:
            self.resize_to = _size_dict(merged["size"], "size", bool(merged["default_to_square"]), source)
            self.resample = merged["resample"] if merged["resample"] is not None else 2
            if self.resample not in RESAMPLE_NAMES or isinstance(self.resample, bool):
                raise ModelError(f"{source}: 'resample' must be a Pillow filter id {RESAMPLE_NAMES}, "
                                 f"got {merged['resample']!r}"[:300])
        if merged["do_center_crop"]:
            if merged["crop_size"] is None:
                raise ModelError(f"{source}: 'do_center_crop' is true but 'crop_size' is missing")
            crop = _size_dict(merged["crop_size"], "crop_size", True, source)
            if "height" not in crop:
                raise ModelError(f"{source}: 'crop_size' must give height and width, got {merged['crop_size']!r}")
            self.crop_to = (crop["height"], crop["width"])
        self.rescale = None
        if merged["do_rescale"]:
            f = merged["rescale_factor"]
            if not (isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0):
                raise ModelError(f"{source}: 'rescale_factor' must be a number > 0, got {f!r}"[:300])
            self.rescale = float(f)
        self.mean = self.std = None
        if merged["do_normalize"]:
            for key in ("image_mean", "image_std"):
                if merged[key] is None:
                    raise ModelError(f"{source}: 'do_normalize' is true but '{key}' is missing")
            self.mean = np.array(_channels(merged["image_mean"], "image_mean", source), np.float32)
            self.std = np.array(_channels(merged["image_std"], "image_std", source, nonzero=True), np.float32)
        self._levels: np.ndarray | None = None
        self.max_pixels = max_pixels_default() if max_pixels is None else max_pixels
        if isinstance(self.max_pixels, bool) or not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ModelError(f"max_pixels must be a whole number >= 1, got {max_pixels!r}")

    @classmethod
    def from_dict(cls, cfg: dict, source: str = CONFIG_NAME, model_type: str | None = None,
                  max_pixels: int | None = None) -> "ImageProcessor":
        return cls(cfg, source, model_type, max_pixels)

    @classmethod
    def from_folder(cls, path, max_pixels: int | None = None) -> "ImageProcessor":
        """The processor of the checkpoint folder `path` (its preprocessor_config.json; a config
        without a processor type takes the one of config.json's model_type)."""
        file = os.path.join(os.fspath(path), CONFIG_NAME)
        try:
            with open(file, encoding="utf-8") as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ModelError(f"{file}: missing; a vision checkpoint needs its preprocessing config "
                             f"(resize, crop, rescale, normalize)") from None
        except (OSError, ValueError) as e:
            raise ModelError(f"{file}: not a readable JSON file ({e})") from None
        model_type = None
        try:
            with open(os.path.join(os.fspath(path), "config.json"), encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            pass                          # only a fallback for a config that names no processor
        return cls(cfg, file, model_type, max_pixels)

    def __repr__(self) -> str:
        steps = []
        if self.convert_rgb:
            steps.append("rgb")
        if self.resize_to is not None:
            steps.append(f"resize {self.resize_to} {RESAMPLE_NAMES[self.resample]}")
        if self.crop_to is not None:
            steps.append(f"crop {self.crop_to[0]}x{self.crop_to[1]}")
        if self.rescale is not None:
            steps.append(f"rescale {self.rescale:.6g}")
        if self.mean is not None:
            steps.append("normalize")
        return f"ImageProcessor({self.kind}: {', '.join(steps) or 'identity'})"

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """(height, width) every output has, or None when it follows the input's size."""
        if self.crop_to is not None:
            return self.crop_to
        if self.resize_to is not None and "height" in self.resize_to:
            return self.resize_to["height"], self.resize_to["width"]
        return None

    # ------------------------------------------------------------------------- steps
    def __call__(self, images) -> np.ndarray:
        if isinstance(images, np.ndarray) and images.ndim == 4:
            images = list(images)
        elif not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ModelError("no images given; expected a list of paths, bytes, arrays or PIL images")
        out = self._each(images)
        shapes = {x.shape for x in out}
        if len(shapes) > 1:
            raise ModelError(f"the images preprocess to different sizes {sorted(s[1:] for s in shapes)} "
                             f"({self.source} fixes no output size); give images of one size")
        return np.stack(out)

    def _each(self, images: list) -> list:
        """one() of every image, on up to preprocess_threads() threads: Pillow's decode and
        resize and NumPy's lookups release the GIL, so the images of a batch go side by side
        (the benchmark's 16 photos on 2 cores: ~110 ms one after another). Errors are
        raised for the first bad image in order, as one after another."""
        workers = min(len(images), preprocess_threads())
        if workers < 2:
            return [self.one(item, i) for i, item in enumerate(images)]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.one, images, range(len(images))))

    def one(self, item, index: int = 0) -> np.ndarray:
        """One image as float32 [3, H, W]."""
        name = _source_name(item, index)
        rgb = self.rgb(self.decode(item, name), name)
        if self.resize_to is not None:
            rgb = self._resize(rgb)
        if self.crop_to is not None:
            rgb = center_crop(rgb, *self.crop_to)
        out = np.empty((3,) + rgb.shape[:2], np.float32)
        for c in range(3):                           # rescale + normalize: a lookup per channel
            np.take(self.levels[c], rgb[..., c], out=out[c])
        return out

    @property
    def levels(self) -> np.ndarray:
        """[3, 256] float32: what rescale then normalize make of each uint8 level of each
        channel, by HF's own arithmetic (the product in float64 rounded to float32, then
        (x - mean) / std in float32), so a lookup gives HF's values bit for bit."""
        if self._levels is None:
            x = np.arange(256, dtype=np.uint8)[None, :].repeat(3, axis=0)
            if self.rescale is not None:
                x = (x.astype(np.float64) * self.rescale).astype(np.float32)
            x = x.astype(np.float32)
            if self.mean is not None:
                x = (x - self.mean[:, None]) / self.std[:, None]
            self._levels = np.ascontiguousarray(x, np.float32)
        return self._levels

    def decode(self, item, name: str):
        """A path, bytes, PIL image or array as a PIL image or a uint8 array [H, W, C]."""
        Image, _ = _pil()
        if isinstance(item, (str, os.PathLike)):
            return _open_encoded(_read_file(item, name), name, self.max_pixels)
        if isinstance(item, (bytes, bytearray, memoryview)):
            return _open_encoded(bytes(item), name, self.max_pixels)
        if isinstance(item, Image.Image):
            return item
        if isinstance(item, np.ndarray):
            if item.dtype != np.uint8:
                raise ModelError(f"{name}: a {item.dtype} array; expected uint8 pixels [height, width, 3]")
            arr = item[..., None] if item.ndim == 2 else item
            if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4) or 0 in arr.shape:
                raise ModelError(f"{name}: an array of shape {item.shape}; expected [height, width, 3] "
                                 "(channels last)")
            return arr
        raise ModelError(f"{name}: expected a path, bytes, a numpy uint8 array or a PIL image, "
                         f"got {type(item).__name__}")

    def rgb(self, img, name: str) -> np.ndarray:
        """8-bit RGB [H, W, 3]: as HF's convert_to_rgb when the config converts, else only an
        image that already is 8-bit RGB."""
        if isinstance(img, np.ndarray):
            channels = img.shape[-1]
            if channels == 3:
                return img
            if not self.convert_rgb:
                what = "grayscale" if channels == 1 else "RGBA"
                raise ModelError(f"{name}: a {what} array; {self.source} does not set do_convert_rgb, so "
                                 "the model expects RGB [height, width, 3]")
            if channels == 1:
                return np.repeat(img, 3, axis=-1)
            alpha = img[..., 3:4] / 255                   # HF: composite onto white, rounded
            return np.round(alpha * img[..., :3] + (1 - alpha) * 255).astype(np.uint8)
        transparent = "A" in img.getbands() or img.info.get("transparency") is not None
        if img.mode == "RGB" and not (self.convert_rgb and transparent):
            return np.asarray(img)
        if not self.convert_rgb:
            raise ModelError(f"{name}: image mode {img.mode} ({_describe_mode(img.mode)}); {self.source} "
                             "does not set do_convert_rgb, so the model expects 8-bit RGB")
        Image, _ = _pil()
        if transparent:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
        return np.asarray(img.convert("RGB"))

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize (HF's get_resize_output_image_size)."""
        size = self.resize_to
        if "height" in size:
            return size["height"], size["width"]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def _resize(self, rgb: np.ndarray) -> np.ndarray:
        Image, _ = _pil()
        h, w = self.output_size(*rgb.shape[:2])
        return np.asarray(Image.fromarray(rgb).resize((w, h), resample=self.resample))


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """HF's center_crop on [H, W, C]: the centered window; an image smaller than the window is
    first zero-padded around its center (ceil of half the difference before it)."""
    h, w = x.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[top:top + height, left:left + width]
    nh, nw = max(height, h), max(width, w)
    pad_top, pad_left = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded = np.zeros((nh, nw) + x.shape[2:], x.dtype)
    padded[pad_top:pad_top + h, pad_left:pad_left + w] = x
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top):min(nh, top + height), max(0, left):min(nw, left + width)]


__all__ = ["ImageProcessor", "center_crop", "patch_grid", "processor_class", "max_pixels_default",
           "IMAGE_FORMATS", "DEFAULT_MAX_PIXELS", "MAX_PIXELS_ENV", "CLASS_DEFAULTS", "MODEL_TYPE_PROCESSOR"]
