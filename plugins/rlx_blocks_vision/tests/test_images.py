"""ImageProcessor against transformers' Pillow image processors (AutoImageProcessor with
backend="pil", i.e. use_fast=False) built from the same preprocessor_config.json, on random
images of odd sizes given as arrays, PIL images and PNG/JPEG/WebP files and bytes; and the
bad input it refuses with a ModelError naming the file or key."""
from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError

PIL = pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from rlx_blocks_vision.images import (DEFAULT_MAX_PIXELS, MAX_PIXELS_ENV, ImageProcessor,  # noqa: E402
                                      center_crop, patch_grid)

TOL = 1e-6

# (processor class, extra config keys): each class's defaults, and odd sizes, other filters,
# crops larger than the resized image (HF pads), old-style int sizes
CONFIGS = [
    ("ViTImageProcessor", {}),
    ("ViTImageProcessor", {"size": {"height": 37, "width": 45}, "resample": 3}),
    ("ViTImageProcessor", {"size": 30, "resample": 1, "image_mean": 0.4, "image_std": 0.3}),
    ("BitImageProcessor", {"size": {"shortest_edge": 40}, "crop_size": {"height": 33, "width": 35}}),
    ("BitImageProcessor", {"size": {"shortest_edge": 29}, "crop_size": {"height": 39, "width": 31},
                           "resample": 2}),
    ("CLIPImageProcessor", {"size": {"shortest_edge": 36}, "crop_size": 36}),
    ("CLIPImageProcessor", {"do_resize": False, "crop_size": {"height": 41, "width": 27}, "resample": 0}),
    ("SiglipImageProcessor", {"size": {"height": 31, "width": 47}}),
    ("SiglipImageProcessor", {"size": {"height": 32, "width": 32}, "do_normalize": False, "resample": 4}),
    ("SiglipImageProcessor", {"size": {"height": 28, "width": 28}, "do_rescale": False, "resample": 5}),
]
SIZES = [(53, 71), (97, 31), (17, 200), (45, 45)]


def _write_config(folder, kind: str, extra: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": kind, **extra}))


def _hf(folder):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(folder), backend="pil")


def _hf_pixels(hf, images) -> np.ndarray:
    return np.asarray(hf(images, return_tensors="np")["pixel_values"], np.float32)


def _random_rgb(rng, size) -> np.ndarray:
    return rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.max(np.abs(ours - ref)) <= TOL


@pytest.mark.parametrize("kind,extra", CONFIGS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONFIGS)])
def test_arrays_and_pil_images_match_hf(tmp_path, kind, extra):
    rng = np.random.default_rng(len(json.dumps(extra)))
    _write_config(tmp_path, kind, extra)
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    for size in SIZES:
        arr = _random_rgb(rng, size)
        ref = _hf_pixels(hf, [arr])
        _close(ours([arr]), ref)
        _close(ours([Image.fromarray(arr)]), ref)
        assert ref.shape[1] == 3


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("kind,extra", [CONFIGS[1], CONFIGS[3], CONFIGS[7]], ids=["vit", "bit", "siglip"])
def test_files_and_bytes_match_hf(tmp_path, fmt, kind, extra):
    rng = np.random.default_rng(7)
    _write_config(tmp_path, kind, extra)
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    paths = []
    for i, size in enumerate(SIZES[:3]):
        p = tmp_path / f"img{i}.{fmt.lower()}"
        Image.fromarray(_random_rgb(rng, size)).save(p, fmt)
        paths.append(p)
    # one size per call where the config fixes none (a batch of different sizes is refused)
    for p in paths:
        ref = _hf_pixels(hf, [str(p)])                 # HF opens the path itself (load_image)
        _close(ours([str(p)]), ref)
        _close(ours([p.read_bytes()]), ref)
        _close(ours([p]), ref)                          # a pathlib.Path


def test_batch_of_many_images_in_order(tmp_path):
    rng = np.random.default_rng(3)
    _write_config(tmp_path, *CONFIGS[3])
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    arrays = [_random_rgb(rng, s) for s in SIZES]
    out = ours(arrays)
    assert out.shape == (4, 3, 33, 35)
    _close(out, _hf_pixels(hf, arrays))
    _close(ours(np.stack([arrays[3]] * 2)), _hf_pixels(hf, [arrays[3]] * 2))   # a 4-D array: a batch


@pytest.mark.parametrize("threads", ["1", "3"])
def test_batch_in_threads_keeps_order_and_the_first_error(tmp_path, monkeypatch, threads):
    """A batch preprocessed on RLX_NUM_THREADS threads equals HF's, image for image in order,
    and a batch with bad images names the first of them, as one after another would."""
    monkeypatch.setenv("RLX_NUM_THREADS", threads)
    rng = np.random.default_rng(4)
    _write_config(tmp_path, *CONFIGS[4])
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    arrays = [_random_rgb(rng, SIZES[i % len(SIZES)]) for i in range(7)]
    _close(ours(arrays), _hf_pixels(hf, arrays))
    with pytest.raises(ModelError, match=r"image 2 \(bytes\): not an image"):
        ours(arrays[:2] + [b"\x00" * 64, _png(arrays[3]), b"\x01" * 64])


def test_exif_orientation_of_a_file_is_applied_as_hf(tmp_path):
    rng = np.random.default_rng(11)
    _write_config(tmp_path, *CONFIGS[1])
    img = Image.fromarray(_random_rgb(rng, (30, 50)))
    exif = Image.Exif()
    exif[0x0112] = 6                                   # rotate 90 degrees clockwise to display
    p = tmp_path / "rotated.jpg"
    img.save(p, "JPEG", exif=exif)
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    _close(ours([str(p)]), _hf_pixels(hf, [str(p)]))
    upright = np.asarray(ImageProcessor.from_dict({"image_processor_type": "ViTImageProcessor",
                                                   "do_resize": False, "do_normalize": False,
                                                   "do_rescale": False}).one(str(p)))
    assert upright.shape == (3, 50, 30)                # rotated: the 30x50 image stands 50 tall


@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "P", "I;16", "CMYK"])
def test_non_rgb_images_convert_as_hf_when_the_config_says(tmp_path, mode):
    rng = np.random.default_rng(5)
    _write_config(tmp_path, *CONFIGS[5])               # CLIP: do_convert_rgb true
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 1000, size=(43, 61), dtype=np.uint16))
    elif mode == "P":
        img = Image.fromarray(_random_rgb(rng, (43, 61))).convert("P")
    else:
        img = Image.fromarray(_random_rgb(rng, (43, 61))).convert("RGBA")
        img.putalpha(Image.fromarray(rng.integers(0, 256, size=(43, 61), dtype=np.uint8)))
        img = img.convert(mode)
    assert img.mode == mode
    _close(ours([img]), _hf_pixels(hf, [img]))


@pytest.mark.parametrize("channels", [1, 4])
def test_non_rgb_arrays_convert_as_hf_when_the_config_says(tmp_path, channels):
    rng = np.random.default_rng(channels)
    _write_config(tmp_path, *CONFIGS[7])               # SigLIP: do_convert_rgb true
    ours, hf = ImageProcessor.from_folder(tmp_path), _hf(tmp_path)
    arr = rng.integers(0, 256, size=(37, 59, channels), dtype=np.uint8)
    _close(ours([arr]), _hf_pixels(hf, [arr]))
    if channels == 1:
        _close(ours([arr[..., 0]]), _hf_pixels(hf, [arr]))       # [H, W] is grayscale too


def test_old_style_configs_match_hf(tmp_path):
    rng = np.random.default_rng(2)
    arr = _random_rgb(rng, (61, 43))
    for kind, cfg in [("vit", {"feature_extractor_type": "ViTFeatureExtractor", "size": 32, "resample": 2,
                               "do_resize": True, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                               "image_std": [0.5, 0.5, 0.5]}),
                      ("clip", {"feature_extractor_type": "CLIPFeatureExtractor", "size": 40, "crop_size": 36,
                                "do_center_crop": True, "do_resize": True, "do_normalize": True,
                                "resample": 3})]:
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
        _close(ImageProcessor.from_folder(folder)([arr]), _hf_pixels(_hf(folder), [arr]))


def test_model_type_gives_the_processor_when_the_config_names_none(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 30},
                                                                   "crop_size": {"height": 28, "width": 28}}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dinov2"}))
    proc = ImageProcessor.from_folder(tmp_path)
    assert proc.kind == "BitImageProcessor" and proc.fixed_size == (28, 28)
    arr = _random_rgb(np.random.default_rng(0), (40, 50))
    _write_config(tmp_path / "ref", "BitImageProcessor", {"size": {"shortest_edge": 30},
                                                          "crop_size": {"height": 28, "width": 28}})
    _close(proc([arr]), _hf_pixels(_hf(tmp_path / "ref"), [arr]))


def test_center_crop_pads_a_small_image_as_hf():
    from transformers.image_transforms import center_crop as hf_crop

    rng = np.random.default_rng(9)
    for (h, w), (ch, cw) in [((5, 8), (9, 4)), ((7, 7), (10, 11)), ((12, 9), (3, 3)), ((4, 6), (4, 6))]:
        x = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        ref = hf_crop(np.moveaxis(x, -1, 0), (ch, cw), input_data_format="channels_first")
        np.testing.assert_array_equal(np.moveaxis(center_crop(x, ch, cw), -1, 0), ref)


# ----------------------------------------------------------------------------- bad input
def _vit(tmp_path, **extra) -> ImageProcessor:
    _write_config(tmp_path, "ViTImageProcessor", {"size": {"height": 32, "width": 32}, **extra})
    return ImageProcessor.from_folder(tmp_path)


def _png(arr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_file_is_an_error_naming_it(tmp_path, fmt):
    buf = io.BytesIO()
    Image.fromarray(_random_rgb(np.random.default_rng(0), (40, 50))).save(buf, fmt)
    p = tmp_path / f"cut.{fmt.lower()}"
    p.write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    with pytest.raises(ModelError, match=r"cut\.\w+: .*(truncated|corrupt)"):
        _vit(tmp_path)([str(p)])


def test_non_image_and_missing_files_are_errors_naming_them(tmp_path):
    proc = _vit(tmp_path)
    p = tmp_path / "notes.txt"
    p.write_text("not an image at all")
    with pytest.raises(ModelError, match=r"notes\.txt: not an image file"):
        proc([str(p)])
    with pytest.raises(ModelError, match=r"image 1 \(bytes\): not an image"):
        proc([_png(_random_rgb(np.random.default_rng(0), (8, 8))), b"\x00" * 64])
    for fmt in ("EPS", "PCX"):                          # formats Pillow reads, this module does not
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, fmt)
        with pytest.raises(ModelError, match=r"image 0 \(bytes\): not an image file of a format read here "
                                             r"\(PNG, JPEG, WEBP, GIF, BMP, TIFF\)"):
            proc([buf.getvalue()])
    with pytest.raises(ModelError, match=r"nope\.png: no such image file"):
        proc([str(tmp_path / "nope.png")])
    with pytest.raises(ModelError, match=r"image 0 \(dict\): expected a path, bytes"):
        proc([{"url": "x"}])
    with pytest.raises(ModelError, match="no images given"):
        proc([])


def test_grayscale_and_16_bit_refused_without_do_convert_rgb(tmp_path):
    proc = _vit(tmp_path)                              # ViT: do_convert_rgb unset
    rng = np.random.default_rng(1)
    gray = tmp_path / "gray.png"
    Image.fromarray(rng.integers(0, 256, size=(20, 30), dtype=np.uint8)).save(gray)
    deep = tmp_path / "deep.png"
    Image.fromarray(rng.integers(0, 65535, size=(20, 30), dtype=np.uint16)).save(deep)
    with pytest.raises(ModelError, match=r"gray\.png: image mode L \(8-bit grayscale\); "
                                         r".*preprocessor_config\.json does not set do_convert_rgb"):
        proc([str(gray)])
    with pytest.raises(ModelError, match=r"deep\.png: image mode I;16 \(16-bit grayscale\);.*expects 8-bit RGB"):
        proc([str(deep)])
    with pytest.raises(ModelError, match=r"image 0 \(ndarray\): a grayscale array"):
        proc([rng.integers(0, 256, size=(20, 30), dtype=np.uint8)])
    with pytest.raises(ModelError, match=r"a uint16 array; expected uint8"):
        proc([rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint16)])
    with pytest.raises(ModelError, match=r"an array of shape \(20, 30, 2\); expected \[height, width, 3\]"):
        proc([rng.integers(0, 256, size=(20, 30, 2), dtype=np.uint8)])


def test_a_missing_or_invalid_config_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(ModelError, match=r"preprocessor_config\.json: missing"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"preprocessor_config\.json: not a readable JSON file"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": 224}))
    with pytest.raises(ModelError, match=r"no 'image_processor_type'"):
        ImageProcessor.from_folder(tmp_path)


@pytest.mark.parametrize("extra,key", [
    ({"image_processor_type": "Siglip2ImageProcessor"}, "image_processor_type"),
    ({"resample": 9}, "resample"),
    ({"size": {"longest_edge": 30}}, "size"),
    ({"size": -3}, "size"),
    ({"do_pad": True}, "do_pad"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"rescale_factor": -1}, "rescale_factor"),
    ({"do_resize": "yes"}, "do_resize"),
    ({"do_center_crop": True, "crop_size": {"shortest_edge": 3}}, "crop_size"),
])
def test_bad_config_values_are_errors_naming_the_key(extra, key):
    cfg = {"image_processor_type": "ViTImageProcessor", **extra}
    with pytest.raises(ModelError, match=rf"cfg\.json: '{key}'"):
        ImageProcessor.from_dict(cfg, "cfg.json")


def test_images_of_different_sizes_without_a_fixed_size_are_refused():
    proc = ImageProcessor.from_dict({"image_processor_type": "BitImageProcessor", "do_center_crop": False,
                                     "size": {"shortest_edge": 20}})
    rng = np.random.default_rng(0)
    assert proc.fixed_size is None
    with pytest.raises(ModelError, match="preprocess to different sizes"):
        proc([_random_rgb(rng, (20, 30)), _random_rgb(rng, (20, 40))])


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height 8-bit RGB pixels, with a few bytes of data:
    decoding it would allocate width * height * 3 bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def test_decompression_bomb_refused_from_the_header(tmp_path, monkeypatch):
    proc = _vit(tmp_path)
    p = tmp_path / "bomb.png"
    p.write_bytes(_bomb_png(50_000, 50_000))           # 2.5 gigapixels in ~100 bytes
    from PIL import ImageFile

    def never(self):                                   # the refusal comes before any decoding
        raise AssertionError("decoded a refused image")
    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    with pytest.raises(ModelError, match=rf"bomb\.png: a 50000x50000 image \(2,500,000,000 pixels\) is over "
                                         rf"the bound of {DEFAULT_MAX_PIXELS:,} pixels; raise it with "
                                         rf"{MAX_PIXELS_ENV}"):
        proc([str(p)])


def test_pixel_bound_is_raised_by_the_env_var_or_the_argument(tmp_path, monkeypatch):
    arr = _random_rgb(np.random.default_rng(0), (40, 50))      # 2,000 pixels
    _write_config(tmp_path, "ViTImageProcessor", {"size": {"height": 32, "width": 32}})
    monkeypatch.setenv(MAX_PIXELS_ENV, "1999")
    with pytest.raises(ModelError, match="over the bound of 1,999 pixels"):
        ImageProcessor.from_folder(tmp_path)([_png(arr)])
    monkeypatch.setenv(MAX_PIXELS_ENV, "2000")
    assert ImageProcessor.from_folder(tmp_path)([_png(arr)]).shape == (1, 3, 32, 32)
    assert ImageProcessor.from_folder(tmp_path, max_pixels=5000)([_png(arr)]).shape == (1, 3, 32, 32)
    with pytest.raises(ModelError, match="over the bound of 1,000 pixels"):
        ImageProcessor.from_folder(tmp_path, max_pixels=1000)([_png(arr)])
    monkeypatch.setenv(MAX_PIXELS_ENV, "lots")
    with pytest.raises(ModelError, match=f"{MAX_PIXELS_ENV} must be a whole number"):
        ImageProcessor.from_folder(tmp_path)
    # an image above Pillow's own bound (~179 MP: its DecompressionBombError) obeys ours instead
    monkeypatch.setenv(MAX_PIXELS_ENV, str(300_000_000))
    with pytest.raises(ModelError, match="truncated or corrupt"):     # allowed: decoding starts, data ends
        ImageProcessor.from_folder(tmp_path)([_bomb_png(15_000, 15_000)])


def test_patch_grid():
    assert patch_grid(224, 196, 14, "config.json") == (16, 14)
    with pytest.raises(ModelError, match=r"config\.json: a 225x224 image is not a whole number of 16x16 patches"):
        patch_grid(225, 224, 16, "config.json")
