"""Vision encoders against HF transformers: tiny random ViT, DINOv2 (SwiGLU, registers), CLIP
and SigLIP models (both towers) built in-process and saved with save_pretrained, loaded with
rlx_core.load; pooled outputs and embeddings within 1e-4 of max |ref| on every available
backend, zero-shot similarities ranked as HF ranks them, resized position tables (odd image
sizes, patch 14 and 16), and bad configs / inputs refused with the project's errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

import rlx_core
from rlx_core.flow.vision import resize_grid
from rlx_core.ir.errors import ModelError, RlxError
from rlx_core.profile import CompileProfile
from rlx_core.testing import parity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOL = 1e-4
WORDS = ("a photo of the cat dog car tree house red blue green big small on in with two three one "
         "bird fish boat plane sky sea road field man woman child ball").split()
PAD, BOS, EOS = 0, 1, 3           # CLIP's eos_token_id 3: the first-EOS pooling (not the legacy argmax)
TEXT = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48, vocab_size=48,
            max_position_embeddings=16, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
VISION = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48)
CAPTIONS = ["a photo of a cat", "two red boats on the sea", "a big dog", "one small bird in the sky",
            "a man with a ball on the road field"]


def _tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": PAD, "<bos>": BOS, "<unk>": 2, "<eos>": EOS}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<bos>", BOS),
                                                                                        ("<eos>", EOS)])
    return tk


def _randomize(model, seed: int):
    """Random norms, biases, LayerScale, tokens and logit scale/bias: a wrong one cannot hide."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("norm" in n or "layrnorm" in n) and n.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith(("bias", "lambda1")) or "token" in n or "class_embedding" in n or "probe" in n:
                p.copy_(0.3 * torch.randn_like(p) + (0.5 if n.endswith("lambda1") else 0.0))
            elif n in ("logit_scale", "logit_bias"):
                p.copy_(torch.full_like(p, 1.3 if n == "logit_scale" else -0.7))
    return model.eval()


def _save(model, tmp_path_factory, name: str, template: str | None = None) -> str:
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    if template is not None:
        _tokenizer(template).save(str(path / "tokenizer.json"))
    return str(path)


def _close(got, want, what: str):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= TOL, f"{what}: max error {err:.3g} of max |ref| (tolerance {TOL})"


def _pixels(seed: int, n: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, h, w)).astype(np.float32)


# ------------------------------------------------------------------------------ the models
MODELS = {
    # ViTModel with its pooler: 37x37 images, patch 16 (a 2x2 grid; the conv drops the rest)
    "vit": lambda: transformers.ViTModel(transformers.ViTConfig(image_size=37, patch_size=16, **VISION,
                                                                layer_norm_eps=1e-12), add_pooling_layer=True),
    # DINOv2 with SwiGLU FFN, patch 14 on 42x42 (3x3 grid)
    "dinov2": lambda: transformers.Dinov2Model(transformers.Dinov2Config(
        image_size=42, patch_size=14, use_swiglu_ffn=True, mlp_ratio=3, **{k: v for k, v in VISION.items()
                                                                             if k != "intermediate_size"})),
    "dinov2_with_registers": lambda: transformers.Dinov2WithRegistersModel(transformers.Dinov2WithRegistersConfig(
        image_size=56, patch_size=14, num_register_tokens=3, mlp_ratio=2,
        **{k: v for k, v in VISION.items() if k != "intermediate_size"})),
    "clip": lambda: transformers.CLIPModel(transformers.CLIPConfig(
        text_config=TEXT, vision_config=dict(VISION, image_size=33, patch_size=16), projection_dim=24)),
    "siglip": lambda: transformers.SiglipModel(transformers.SiglipConfig(
        text_config=dict(TEXT, projection_size=32), vision_config=dict(VISION, image_size=30, patch_size=14))),
    "siglip_vision_model": lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        image_size=45, patch_size=16, **VISION)),
}
TEMPLATES = {"clip": "<bos> $A <eos>", "siglip": "$A <eos>"}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for i, (name, make) in enumerate(MODELS.items()):
        model = _randomize(make(), 100 + i)
        out[name] = (model, _save(model, tmp_path_factory, name, TEMPLATES.get(name)))
    return out


def _hf_image(name: str, model, pixels: np.ndarray, interpolate: bool = False) -> np.ndarray:
    """What embed(images=...) must return: HF's pooler_output (a CLIPModel's image_embeds)."""
    x = torch.from_numpy(pixels)
    with torch.no_grad():
        if name == "clip":
            return model.visual_projection(model.vision_model(pixel_values=x, interpolate_pos_encoding=interpolate)
                                           .pooler_output).numpy()
        if name == "siglip":
            return model.vision_model(pixel_values=x, interpolate_pos_encoding=interpolate).pooler_output.numpy()
        kw = {"interpolate_pos_encoding": True} if interpolate else {}
        return model(pixel_values=x, **kw).pooler_output.numpy()


def _ids(name: str, texts: list) -> np.ndarray:
    """Token ids as the model's processor gives them: CLIP padded to the longest, SigLIP to
    max_position_embeddings."""
    rows = [e.ids for e in _tokenizer(TEMPLATES[name]).encode_batch(texts)]
    s = TEXT["max_position_embeddings"] if name == "siglip" else max(map(len, rows))
    ids = np.full((len(rows), s), PAD, np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    return ids


def _hf_text(name: str, model, texts: list) -> np.ndarray:
    ids = torch.from_numpy(_ids(name, texts))
    with torch.no_grad():
        if name == "siglip":
            return model.text_model(input_ids=ids).pooler_output.numpy()
        mask = torch.from_numpy(np.array([[1] * len(e.ids) + [0] * (ids.shape[1] - len(e.ids)) for e in
                                          _tokenizer(TEMPLATES[name]).encode_batch(texts)]))
        return model.text_projection(model.text_model(input_ids=ids, attention_mask=mask).pooler_output).numpy()


BACKENDS = parity.backend_params()


# ------------------------------------------------------------------------------ images
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_image_embeddings_match_hf(hf_models, name, backend):
    model, path = hf_models[name]
    m = rlx_core.load(path, backend=backend, progress=False)
    size = m.image_size
    pixels = _pixels(1, 3, size, size)
    want = _hf_image(name, model, pixels)
    got = m.embed_pixels(pixels, batch_size=2)
    _close(got, want, f"{name} on {backend}: embed_pixels vs HF pooler_output")
    norm = m.embed_pixels(pixels[:1], normalize=True)
    _close(norm, want[:1] / np.linalg.norm(want[:1], axis=-1, keepdims=True), f"{name}: normalized")
    assert m.embedding_dim == want.shape[-1]
    assert m.embeds_images and m.embeds_texts == (name in ("clip", "siglip"))


BF16_TOL = 2e-2


@pytest.mark.parametrize("backend", parity.backend_params(only=("numpy", "cuda")))
@pytest.mark.parametrize("name", ["vit", "dinov2_with_registers", "clip", "siglip"])
def test_bf16_embeddings_near_hf(hf_models, name, backend):
    """bf16 compute (the encoder profile with precision.compute = bf16: issue 46's GPU
    configuration) against HF in f32: within BF16_TOL of max |ref|; the f32 runs above hold
    1e-4 on every backend. On numpy too, so the bf16 graph is checked where no GPU is."""
    model, path = hf_models[name]
    prof = CompileProfile.preset("encoder").evolve(precision={"compute": "bf16"})
    m = rlx_core.load(path, backend=backend, profile=prof, progress=False)
    assert m.profile.precision.compute.value == "bf16"
    pixels = _pixels(5, 4, m.image_size, m.image_size)
    want = _hf_image(name, model, pixels)
    got = np.asarray(m.embed_pixels(pixels, batch_size=4), np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= BF16_TOL, f"{name} bf16 on {backend}: max error {err:.3g} of max |ref| (tolerance {BF16_TOL})"
    assert err > 0, "bf16 compute gave f32's exact output: the profile's precision was not applied"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,size", [("dinov2", (43, 71)), ("dinov2_with_registers", (57, 30)),
                                       ("vit", (50, 67)), ("clip", (49, 64)), ("siglip_vision_model", (70, 33))])
def test_resized_positions_match_hf(hf_models, name, size, backend):
    """Images of another size: DINOv2 always resizes its positions (bicubic; antialiased with
    registers); ViT / CLIP / SigLIP do when asked (interpolate_pos_encoding=True)."""
    model, path = hf_models[name]
    m = rlx_core.load(path, backend=backend, progress=False, interpolate_pos_encoding=True)
    pixels = _pixels(2, 2, *size)
    _close(m.embed_pixels(pixels), _hf_image(name, model, pixels, interpolate=True),
           f"{name} at {size[0]}x{size[1]} on {backend}")


def test_resize_grid_matches_torch_interpolate():
    rng = np.random.default_rng(3)
    F = torch.nn.functional
    for side, out in [(4, (3, 7)), (5, (9, 2)), (16, (12, 21)), (3, (3, 3))]:
        t = rng.standard_normal((side * side, 6)).astype(np.float32)
        grid = torch.from_numpy(t).reshape(1, side, side, 6).permute(0, 3, 1, 2)
        for aa in (False, True):
            want = F.interpolate(grid, size=out, mode="bicubic", align_corners=False, antialias=aa)
            _close(resize_grid(t, (side, side), out, "bicubic", aa), want.permute(0, 2, 3, 1).reshape(-1, 6).numpy(),
                   f"bicubic {side}->{out} antialias={aa}")


# ------------------------------------------------------------------------------ texts, similarity
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_text_embeddings_and_similarity_match_hf(hf_models, name, backend):
    model, path = hf_models[name]
    m = rlx_core.load(path, backend=backend, progress=False)
    want_txt = _hf_text(name, model, CAPTIONS)
    _close(m.embed(texts=CAPTIONS, batch_size=3), want_txt, f"{name} on {backend}: text embeddings")
    pixels = _pixels(4, 4, m.image_size, m.image_size)
    with torch.no_grad():
        ids = torch.from_numpy(_ids(name, CAPTIONS))
        want = model(pixel_values=torch.from_numpy(pixels), input_ids=ids).logits_per_image.numpy()
    got = m.similarity(pixels, CAPTIONS)
    _close(got, want, f"{name} on {backend}: logits_per_image")
    assert (np.argsort(got, axis=1) == np.argsort(want, axis=1)).all(), "zero-shot ranking differs from HF's"


def test_vision_only_model_has_no_text_tower(hf_models):
    m = rlx_core.load(hf_models["siglip_vision_model"][1], backend="numpy", progress=False)
    with pytest.raises(ModelError, match="no text tower"):
        m.embed(texts=["a cat"])
    with pytest.raises(ModelError, match="texts or images"):
        m.embed()


# ------------------------------------------------------------------------------ bad input
def _config_folder(hf_models, name: str, tmp_path, **changes) -> str:
    src = hf_models[name][1]
    import shutil

    dst = tmp_path / name
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if "." in k:
            sub, key = k.split(".")
            cfg[sub][key] = v
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("name,key,value", [
    ("vit", "patch_size", 0), ("vit", "num_attention_heads", 5), ("dinov2", "layer_norm_eps", "x"),
    ("clip", "vision_config.image_size", -3), ("siglip", "text_config.hidden_act", "swishy"),
    ("clip", "text_config.eos_token_id", 999), ("siglip_vision_model", "vision_use_head", False),
    ("dinov2", "use_swiglu_ffn", "yes")])
def test_bad_config_names_the_key(hf_models, tmp_path, name, key, value):
    path = _config_folder(hf_models, name, tmp_path, **{key: value})
    with pytest.raises(RlxError, match=key.split(".")[-1]):
        rlx_core.load(path, backend="numpy", progress=False)


def test_size_mismatch_without_interpolation_names_image_size(hf_models):
    m = rlx_core.load(hf_models["vit"][1], backend="numpy", progress=False)
    with pytest.raises(ModelError, match="image_size"):
        m.embed_pixels(_pixels(0, 1, 50, 67))


@pytest.mark.parametrize("bad", [np.zeros((2, 4, 37, 37), np.float32), np.zeros((37, 37, 3), np.float32),
                                 np.full((1, 3, 37, 37), np.nan, np.float32), "not pixels"])
def test_bad_pixels_are_refused(hf_models, bad):
    m = rlx_core.load(hf_models["vit"][1], backend="numpy", progress=False)
    with pytest.raises(ModelError, match="pixel_values"):
        m.embed_pixels(bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_pixels_are_an_error_naming_the_image(hf_models, backend):
    """The graph's own check (flows.PixelCheck, run on the backend with the model, read back
    with the embeddings): a NaN or inf in image 3 of 5 embedded in batches of 2 is a
    ModelError naming image 3 (and image 1 of a forward_pixels of images 2-3); a finite
    value however large passes the check."""
    m = rlx_core.load(hf_models["dinov2"][1], backend=backend, progress=False)
    pixels = _pixels(6, 5, m.image_size, m.image_size)
    for value in (np.nan, np.inf, -np.inf):
        pixels[3, 1, 4, 7] = value
        with pytest.raises(ModelError, match="pixel_values: image 3 has non-finite values"):
            m.embed_pixels(pixels, batch_size=2)
        with pytest.raises(ModelError, match="pixel_values: image 1 has non-finite values"):
            m.forward_pixels(pixels[2:4], fetch=("embedding",))
    pixels[3, 1, 4, 7] = 3e38
    with np.errstate(all="ignore"):
        assert m.embed_pixels(pixels, batch_size=2).shape == (5, m.embedding_dim)
    pixels[3, 1, 4, 7] = 0.5
    out = m.forward_pixels(pixels)
    assert "pixel_check" not in out and np.isfinite(out["embedding"]).all()


# ------------------------------------------------------------------------------ images in
@pytest.mark.parametrize("name,processor", [
    ("clip", {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 40}, "crop_size": 33}),
    ("dinov2_with_registers", {"image_processor_type": "BitImageProcessor", "size": {"shortest_edge": 60},
                               "crop_size": {"height": 56, "width": 56}})])
def test_image_files_end_to_end_match_hf(hf_models, tmp_path, name, processor):
    """PNG / JPEG files through the checkpoint's preprocessor_config.json and the model,
    against transformers' Pillow processor and model."""
    from PIL import Image
    from transformers import AutoImageProcessor

    import shutil

    model, src = hf_models[name]
    folder = tmp_path / name
    shutil.copytree(src, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    rng = np.random.default_rng(5)
    files = []
    for i, (size, ext) in enumerate([((53, 71), "png"), ((97, 45), "jpg"), ((64, 64), "png")]):
        f = tmp_path / f"img{i}.{ext}"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(f)
        files.append(str(f))
    hf_proc = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    pixels = np.asarray(hf_proc([Image.open(f) for f in files], return_tensors="np")["pixel_values"], np.float32)
    m = rlx_core.load(str(folder), backend="numpy", progress=False)
    _close(m.embed(images=files), _hf_image(name, model, pixels), f"{name}: embed(images=files)")
    if name == "clip":
        with torch.no_grad():
            want = model(pixel_values=torch.from_numpy(pixels),
                         input_ids=torch.from_numpy(_ids(name, CAPTIONS))).logits_per_image.numpy()
        got = m.similarity(files, CAPTIONS)
        _close(got, want, "clip: similarity(files, texts)")
        assert (got.argmax(1) == want.argmax(1)).all()


# ------------------------------------------------------------------------------ SigLIP 2 (NaFlex)
NAFLEX = {"image_processor_type": "Siglip2ImageProcessor", "patch_size": 4, "max_num_patches": 12}


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    cfg = transformers.Siglip2Config(text_config=dict(TEXT, projection_size=32),
                                     vision_config=dict(VISION, num_patches=9, patch_size=4))
    model = _randomize(transformers.Siglip2Model(cfg), 7)
    path = _save(model, tmp_path_factory, "siglip2", TEMPLATES["siglip"])
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump(NAFLEX, f)
    return model, path


def _images(tmp_path, sizes) -> list:
    from PIL import Image

    rng = np.random.default_rng(8)
    files = []
    for i, size in enumerate(sizes):
        f = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(f)
        files.append(str(f))
    return files


def test_naflex_processor_matches_hf(siglip2, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor

    from rlx_blocks_vision.naflex import NaflexProcessor

    files = _images(tmp_path, [(9, 30), (21, 13), (16, 16), (40, 5)])
    hf = AutoImageProcessor.from_pretrained(siglip2[1], backend="pil")
    want = hf([Image.open(f) for f in files], return_tensors="np")
    got = NaflexProcessor.from_folder(siglip2[1])(files)
    for key in ("spatial_shapes", "pixel_attention_mask"):
        assert (np.asarray(got[key]) == np.asarray(want[key])).all(), key
    _close(got["pixel_values"], want["pixel_values"], "NaFlex pixel_values")


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip2_naflex_matches_hf(siglip2, tmp_path, backend):
    """Images of several aspect ratios (each its own patch grid, padded to max_num_patches):
    image embeddings, text embeddings and logits_per_image against HF's Siglip2Model."""
    from PIL import Image
    from transformers import AutoImageProcessor

    model, path = siglip2
    files = _images(tmp_path, [(9, 30), (21, 13), (16, 16)])
    feed = AutoImageProcessor.from_pretrained(path, backend="pil")([Image.open(f) for f in files],
                                                                    return_tensors="pt")
    ids = torch.from_numpy(_ids("siglip", CAPTIONS))
    with torch.no_grad():
        want_img = model.vision_model(**feed).pooler_output.numpy()
        want = model(input_ids=ids, **feed).logits_per_image.numpy()
        want_txt = model.text_model(input_ids=ids).pooler_output.numpy()
    m = rlx_core.load(path, backend=backend, progress=False)
    _close(m.embed(images=files), want_img, f"siglip2 on {backend}: embed(images=files)")
    _close(m.embed_pixels(**{k: v.numpy() for k, v in feed.items()}), want_img, "siglip2: embed_pixels")
    bad = {k: v.numpy().copy() for k, v in feed.items()}
    bad["pixel_values"][2, 0, 5] = np.nan
    with pytest.raises(ModelError, match="pixel_values: image 2 has non-finite values"):
        m.embed_pixels(**bad)
    _close(m.embed(texts=CAPTIONS), want_txt, "siglip2: text embeddings")
    got = m.similarity(files, CAPTIONS)
    _close(got, want, f"siglip2 on {backend}: logits_per_image")
    assert (np.argsort(got, axis=1) == np.argsort(want, axis=1)).all()


# ------------------------------------------------------------------------------ inspect, pooling rows
@pytest.mark.parametrize("name,mode", [("dinov2_with_registers", None), ("clip", "text"), ("siglip", "vision")])
def test_rlx_inspect_shows_the_vision_model(hf_models, name, mode):
    from rlx_core.inspection import Inspection

    ins = Inspection.load(hf_models[name][1], mode=mode, backend="numpy")
    ins.bind({})
    rep = ins.report()
    assert rep["model"]["model_class"] == "VisionModel" and rep["model"]["model_type"] == name
    stages = {s["stage"] for s in rep["stages"]}
    want = {"token_embed", "vit_layer", "select_token"} if mode == "text" else {"patch_embed", "vit_layer"}
    assert want <= stages, stages
    assert "VisionModel" in ins.text()


def test_text_pooling_rows(hf_models):
    """CLIP pools the first EOS (the largest id for configs with the legacy eos_token_id 2, as
    HF's argmax does); SigLIP pads to max_position_embeddings and pools the last token."""
    import attrs

    clip = rlx_core.load(hf_models["clip"][1], backend="numpy", progress=False)
    rows = [[BOS, 7, EOS, 9], [BOS, 5, 6, 7, EOS]]
    feed = clip.text_feed(rows)
    assert feed["ids"].shape == (2, 5) and (feed["pool_onehot"].argmax(1) == [2, 4]).all()
    assert (feed["pool_onehot"].sum(1) == 1).all()
    clip.text = attrs.evolve(clip.text, eos_id=2)
    assert (clip.text_feed(rows)["pool_onehot"].argmax(1) == [3, 3]).all()       # ids 9 and 7: the largest
    clip.text = attrs.evolve(clip.text, eos_id=EOS)
    with pytest.raises(ModelError, match="no EOS"):
        clip.text_feed([[BOS, 7, 8]])
    siglip = rlx_core.load(hf_models["siglip"][1], backend="numpy", progress=False)
    feed = siglip.text_feed(rows)
    assert feed["ids"].shape == (2, TEXT["max_position_embeddings"])
    assert (feed["pool_onehot"].argmax(1) == TEXT["max_position_embeddings"] - 1).all()
    with pytest.warns(UserWarning, match="truncated"):
        long = siglip.embed(texts=[" ".join(WORDS)])
    assert long.shape == (1, siglip.embedding_dim)


@pytest.mark.parametrize("name,drop", [("clip", "text_model.final_layer_norm.weight"),
                                       ("dinov2_with_registers", "embeddings.register_tokens")])
def test_checkpoint_missing_a_tensor_fails_at_load_naming_it(hf_models, tmp_path, name, drop):
    import shutil

    from safetensors.numpy import load_file, save_file

    dst = tmp_path / name
    shutil.copytree(hf_models[name][1], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(RlxError, match=drop.replace(".", r"\.")):
        rlx_core.load(str(dst), backend="numpy", progress=False)
