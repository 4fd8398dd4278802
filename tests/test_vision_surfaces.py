"""Images through core's surfaces: `rlx embed MODEL --image a.png b.jpg [--json]` and
`rlx serve`'s /v1/embeddings with images as base64 data URLs (in `input`, or vLLM's
`messages` with an image_url part) and texts for a model with a text tower.

Core duck-types on the model (`embeds_images`) and hands it file paths or the decoded bytes,
so the first half checks core's part with a recording fake model: the bytes the model gets
are the bytes the client encoded, in order, normalized, and bad requests are 400s naming the
field. The second half runs the vision plugin's tiny ViT and CLIP end to end against HF
(skipped when rlx-blocks-vision is not installed)."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.runtime.encoder import embed_command

SERVE = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn"))
needs_serve = pytest.mark.skipif(not SERVE, reason="the serve extra (starlette, uvicorn) is not installed")


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


class FakeVision:
    """A model that embeds images (and texts with `texts=True`): each input's row is a hash of
    its bytes (a path's file, an image's encoded bytes, a text's UTF-8), so a row proves which
    bytes reached the model. Bytes starting with b"BAD" are refused as the plugin refuses a
    broken image."""

    embeds_images = True

    def __init__(self, texts: bool = True):
        self.embeds_texts, self.calls = texts, []
        self.config, self.source, self.embedding_dim = {"model_type": "fake_vision"}, "/srv/private/fake", 8

    @staticmethod
    def row(data: bytes) -> np.ndarray:
        return np.frombuffer(hashlib.sha256(data).digest()[:8], np.uint8).astype(np.float32) - 127.5

    def embed(self, texts=None, images=None, normalize=False, batch_size=16):
        kind, items = ("images", images) if images is not None else ("texts", texts)
        self.calls.append((kind, list(items), normalize, batch_size))
        rows = []
        for i, x in enumerate(items):
            data = x.encode() if kind == "texts" else x if isinstance(x, bytes) else open(x, "rb").read()
            if data.startswith(b"BAD"):
                raise ModelError(f"image {i} (bytes): not an image file of a format read here")
            rows.append(self.row(data))
        e = np.stack(rows)
        return e / np.linalg.norm(e, axis=1, keepdims=True) if normalize else e


def _unit(rows) -> np.ndarray:
    rows = np.asarray(rows, np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


# ----------------------------------------------------------------------------- rlx embed
def test_embed_command_images(tmp_path):
    files = []
    for i in range(3):
        p = tmp_path / f"img{i}.png"
        p.write_bytes(b"\x89PNG fake %d" % i)
        files.append(str(p))
    fake, out = FakeVision(), []
    emb = embed_command(fake, files, images=True, echo=out.append, batch_size=2)
    assert fake.calls == [("images", files, True, 2)]
    want = _unit([FakeVision.row(open(f, "rb").read()) for f in files])
    np.testing.assert_allclose(emb, want, rtol=1e-6)
    np.testing.assert_allclose(np.array([[float(v) for v in line.split()] for line in out]), want, rtol=1e-6)
    # --json, --no-normalize, and the paths given as lines of a file
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(files))
    out = []
    embed_command(fake, file=str(lst), images=True, json_out=True, normalize=False, echo=out.append)
    body = json.loads(out[0])
    assert body["count"] == 3 and body["dim"] == 8 and body["normalized"] is False
    np.testing.assert_allclose(body["embeddings"], [FakeVision.row(open(f, "rb").read()) for f in files])


def test_embed_command_texts_of_a_vision_model_with_a_text_tower():
    fake, out = FakeVision(texts=True), []
    emb = embed_command(fake, ["a cat", "a dog"], echo=out.append)
    assert fake.calls == [("texts", ["a cat", "a dog"], True, 32)]
    np.testing.assert_allclose(emb, _unit([FakeVision.row(b"a cat"), FakeVision.row(b"a dog")]), rtol=1e-6)
    assert len(out) == 2


def test_embed_command_errors(tmp_path):
    from tiny_models import tiny_bert

    with pytest.raises(ModelError, match="embeds images only; give image paths with --image"):
        embed_command(FakeVision(texts=False), ["a cat"], echo=print)
    with pytest.raises(ModelError, match="--no-truncate applies to texts"):
        embed_command(FakeVision(), ["a.png"], images=True, no_truncate=True, echo=print)
    with pytest.raises(ModelError, match="text tower truncates"):
        embed_command(FakeVision(), ["a cat"], no_truncate=True, echo=print)
    with pytest.raises(ModelError, match="nothing to embed: give one or more image paths"):
        embed_command(FakeVision(), [], images=True, echo=print)
    with pytest.raises(ModelError, match="give image paths or --file, not both"):
        embed_command(FakeVision(), ["a.png"], file="x.txt", images=True, echo=print)
    with pytest.raises(ModelError, match="embeds texts, not images; --image needs a vision checkpoint"):
        embed_command(tiny_bert(np.random.default_rng(0)), ["a.png"], images=True, echo=print)


def test_cli_embed_image_flag(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import rlx_core.runtime.model as runtime_model
    from rlx_core.cli import main

    fake = FakeVision()
    loaded = []
    monkeypatch.setattr(runtime_model, "load", lambda name, **kw: loaded.append(name) or fake)
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    a.write_bytes(b"first image")
    b.write_bytes(b"second image")
    r = CliRunner().invoke(main, ["embed", "some-model", "--image", str(a), str(b), "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.output)
    assert loaded == ["some-model"] and body["count"] == 2 and body["model"] == "some-model"
    np.testing.assert_allclose(body["embeddings"], _unit([FakeVision.row(b"first image"),
                                                          FakeVision.row(b"second image")]), rtol=1e-6)
    assert fake.calls[0][0] == "images" and fake.calls[0][1] == [str(a), str(b)]
    r = CliRunner().invoke(main, ["embed", "some-model", "--image", "--file", "-"], input=f"{b}\n{a}\n")
    assert r.exit_code == 0, r.output                    # paths as lines of stdin
    assert fake.calls[-1][1] == [str(b), str(a)] and len(r.output.splitlines()) == 2
    bad = CliRunner().invoke(main, ["embed", "some-model", "--image", str(a), "--no-truncate"])
    assert bad.exit_code != 0 and "--no-truncate applies to texts" in bad.output


# ----------------------------------------------------------------------------- /v1/embeddings
def _post(app, body: dict) -> tuple:
    from serve_tiny import asgi_call

    status, _, raw = asgi_call(app, "POST", "/v1/embeddings", json.dumps(body).encode())
    return status, json.loads(raw)


def _rows(resp: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(resp["data"], key=lambda d: d["index"])], np.float32)


@needs_serve
def test_serve_image_data_urls_and_texts():
    from rlx_core.serve import create_app

    fake = FakeVision()
    app = create_app({"vis": fake})
    images = [b"\x89PNG one", b"\xff\xd8 two", b"RIFF three"]
    status, resp = _post(app, {"model": "vis", "input": [data_url(images[0]), data_url(images[1], "jpeg"),
                                                         data_url(images[2], "webp")]})
    assert status == 200, resp
    assert fake.calls[-1][:3] == ("images", images, True)          # the client's bytes, in order
    np.testing.assert_allclose(_rows(resp), _unit([FakeVision.row(x) for x in images]), rtol=1e-6)
    assert resp["usage"] == {"prompt_tokens": 0, "total_tokens": 0} and resp["model"] == "vis"
    # one data URL as a string; texts; base64 floats
    status, resp = _post(app, {"model": "vis", "input": data_url(images[1])})
    assert status == 200 and len(resp["data"]) == 1
    status, resp = _post(app, {"model": "vis", "input": ["a cat", "two dogs"], "encoding_format": "base64"})
    assert status == 200 and fake.calls[-1][:2] == ("texts", ["a cat", "two dogs"])
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in resp["data"]])
    np.testing.assert_allclose(got, _unit([FakeVision.row(b"a cat"), FakeVision.row(b"two dogs")]), rtol=1e-6)


@needs_serve
def test_serve_vllm_messages_form():
    from rlx_core.serve import create_app

    fake = FakeVision()
    app = create_app({"vis": fake})
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"pixels!")}}]}]
    status, resp = _post(app, {"model": "vis", "messages": msg, "encoding_format": "float"})
    assert status == 200, resp
    assert fake.calls[-1][:2] == ("images", [b"pixels!"])
    np.testing.assert_allclose(_rows(resp), _unit([FakeVision.row(b"pixels!")]), rtol=1e-6)
    status, resp = _post(app, {"model": "vis", "messages": [{"role": "user", "content": "a red car"}]})
    assert status == 200 and fake.calls[-1][:2] == ("texts", ["a red car"])


@needs_serve
@pytest.mark.parametrize("body,param,message", [
    ({"input": ["data:image/png;base64,AAAA", "a cat"]}, "input", "mixes image data URLs and texts"),
    ({"input": "data:image/png;base64,@@@"}, "input", "input: the data URL's base64 data is malformed"),
    ({"input": ["a", "data:image/png,rawbytes"]}, "input", "mixes"),
    ({"input": ["data:image/png;base64,AAAA", "data:image/png,raw"]}, "input",
     r"input\[1\]: a data URL of an image must be base64"),
    ({"input": [[1, 2, 3]]}, "input", "not token ids"),
    ({"input": "x", "messages": []}, "input", "not both or neither"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages", "fetches no URL"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"x")}}, {"type": "text", "text": "a cat"}]}]},
     "messages", "holds 2 parts; this model embeds one image or one text"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, "messages",
     r"messages\[0\].content\[0\] must be a text part or an image_url part"),
    ({"input": [data_url(b"BAD image")]}, "input", r"image 0 \(bytes\): not an image file"),
    ({"input": "hello", "dimensions": 4}, "dimensions", "'dimensions' is not supported"),
])
def test_serve_bad_image_requests_are_400s_naming_the_field(body, param, message):
    import re

    from rlx_core.serve import create_app

    app = create_app({"vis": FakeVision()})
    status, resp = _post(app, {"model": "vis", **body})
    assert status == 400, resp
    assert resp["error"]["param"] == param and re.search(message, resp["error"]["message"]), resp
    assert "/srv/private" not in resp["error"]["message"]


@needs_serve
def test_serve_texts_to_an_image_only_model_and_images_to_a_text_encoder():
    from tiny_models import tiny_bert

    from rlx_core.serve import create_app

    app = create_app({"vis": FakeVision(texts=False), "enc": tiny_bert(np.random.default_rng(0))})
    status, resp = _post(app, {"model": "vis", "input": "a cat"})
    assert status == 400 and "embeds images only" in resp["error"]["message"]
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"x")}}]}]
    status, resp = _post(app, {"model": "enc", "messages": msg})
    assert status == 400 and resp["error"]["param"] == "messages" and "embeds texts" in resp["error"]["message"]


# ----------------------------------------------------------------------------- end to end
VISION = importlib.util.find_spec("rlx_blocks_vision") is not None
needs_vision = pytest.mark.skipif(not VISION, reason="rlx-blocks-vision is not installed")
WORDS = ["<pad>", "<bos>", "<unk>", "<eos>", "a", "photo", "of", "cat", "dog", "red", "car", "two", "the"]
TINY = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48)


def _images(n: int) -> list:
    """Encoded PNG / JPEG / WebP bytes of random RGB images of odd sizes."""
    from PIL import Image

    rng = np.random.default_rng(21)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (41 + 6 * i, 57 - 4 * i, 3), np.uint8)).save(
            buf, ("PNG", "JPEG", "WEBP")[i % 3])
        out.append(buf.getvalue())
    return out


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    """(folder of a tiny ViT, folder of a tiny CLIP with tokenizer.json, the HF models)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    torch.manual_seed(0)
    vit = transformers.ViTModel(transformers.ViTConfig(image_size=32, patch_size=16, **TINY)).eval()
    vit_dir = tmp_path_factory.mktemp("vit")
    vit.save_pretrained(vit_dir)
    (vit_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32}, "resample": 3}))
    text = dict(TINY, vocab_size=len(WORDS), max_position_embeddings=12, pad_token_id=0, bos_token_id=1,
                eos_token_id=3)
    clip = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=text, vision_config=dict(TINY, image_size=33, patch_size=16), projection_dim=24)).eval()
    clip_dir = tmp_path_factory.mktemp("clip")
    clip.save_pretrained(clip_dir)
    (clip_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 38},
         "crop_size": {"height": 33, "width": 33}}))
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                      special_tokens=[("<bos>", 1), ("<eos>", 3)])
    tk.save(str(clip_dir / "tokenizer.json"))
    return str(vit_dir), str(clip_dir), vit, clip, tk


def _hf_pixels(folder: str, images: list):
    from PIL import Image
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(folder, backend="pil")
    return proc([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"]


def _close(got, want) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@needs_vision
def test_cli_embed_images_end_to_end(tiny_vision, tmp_path):
    import torch
    from click.testing import CliRunner

    from rlx_core.cli import main

    vit_dir, _, vit, _, _ = tiny_vision
    images = _images(3)
    paths = []
    for i, data in enumerate(images):
        p = tmp_path / f"img{i}.{('png', 'jpg', 'webp')[i]}"
        p.write_bytes(data)
        paths.append(str(p))
    r = CliRunner().invoke(main, ["embed", vit_dir, "--image", *paths, "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.output)
    with torch.no_grad():
        want = vit(pixel_values=_hf_pixels(vit_dir, images)).pooler_output.numpy()
    assert body["count"] == 3 and body["dim"] == want.shape[1]
    _close(body["embeddings"], _unit(want))
    r = CliRunner().invoke(main, ["embed", vit_dir, "--image", str(tmp_path / "missing.png")])
    assert r.exit_code != 0 and "missing.png: no such image file" in r.output
    r = CliRunner().invoke(main, ["embed", vit_dir, "a photo"])
    assert r.exit_code != 0 and "embeds images only" in r.output


@needs_vision
@needs_serve
def test_serve_images_and_texts_end_to_end(tiny_vision):
    import openai
    import torch
    from serve_tiny import Server

    import rlx_core
    from rlx_core.serve import create_app

    vit_dir, clip_dir, vit, clip, tk = tiny_vision
    images = _images(4)
    server = Server(create_app({"vit": rlx_core.load(vit_dir, backend="numpy", progress=False),
                                "clip": rlx_core.load(clip_dir, backend="numpy", progress=False)}))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        kinds = ("png", "jpeg", "webp", "png")
        r = client.embeddings.create(model="vit", input=[data_url(b, k) for b, k in zip(images, kinds)])
        with torch.no_grad():
            want = vit(pixel_values=_hf_pixels(vit_dir, images)).pooler_output.numpy()
        _close([d.embedding for d in sorted(r.data, key=lambda d: d.index)], _unit(want))

        with torch.no_grad():
            want_img = clip.get_image_features(pixel_values=_hf_pixels(clip_dir, images[:1]))
            captions = ["a photo of a cat", "two red car"]
            ids = [e.ids for e in tk.encode_batch(captions)]
            width = max(map(len, ids))
            input_ids = torch.tensor([r + [0] * (width - len(r)) for r in ids])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
            want_txt = clip.get_text_features(input_ids=input_ids, attention_mask=mask)
        want_img = getattr(want_img, "pooler_output", want_img).numpy()
        want_txt = getattr(want_txt, "pooler_output", want_txt).numpy()
        r = client.embeddings.create(model="clip", input=captions)
        _close([d.embedding for d in r.data], _unit(want_txt))
        from serve_tiny import request_json

        msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images[0])}}]}]
        status, body = request_json(f"http://127.0.0.1:{server.port}/v1/embeddings",
                                    {"model": "clip", "messages": msg})
        assert status == 200, body
        _close([body["data"][0]["embedding"]], _unit(want_img))
        status, body = request_json(f"http://127.0.0.1:{server.port}/v1/embeddings",
                                    {"model": "vit", "input": data_url(images[0][: len(images[0]) // 2])})
        assert status == 400 and "truncated or corrupt" in body["error"]["message"]
        assert os.path.dirname(vit_dir) not in body["error"]["message"]
    finally:
        server.stop()
