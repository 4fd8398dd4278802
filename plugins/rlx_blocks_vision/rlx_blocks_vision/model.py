"""VisionModel: what `rlx_core.load(folder)` returns for ViT, DINOv2, CLIP and SigLIP
checkpoints. `embed(images=...)` gives HF's pooler_output (image_embeds after the projection
for a CLIP model), `embed(texts=...)` the text tower's text_embeds (CLIP / SigLIP), and
`similarity(images, texts)` HF's logits_per_image.

Images go through the checkpoint's own preprocessing (rlx_blocks_vision.images.ImageProcessor,
from preprocessor_config.json) to pixels [N, 3, H, W]; `embed_pixels` takes such pixels
directly. One executable per image size (the position table is resized for its patch grid
when the graph is built, then hoisted to load time), its batch dim symbolic. Non-finite
pixels are found by the graph itself (flows.PixelCheck, on the model's backend: no host pass
over the pixels before a GPU upload) and raised as a ModelError naming the image."""
from __future__ import annotations

import warnings

import numpy as np

from rlx_core.flow.vision import grid_position_weights
from rlx_core.ir.dtype import F32
from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import select_backend
from rlx_core.runtime.args import bool_arg, int_arg
from rlx_core.runtime.model import backend_lock, resolve_profile

from .flows import PIXEL_CHECK, naflex_flow, text_flow, vision_flow


def _l2(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.normalize over the last axis."""
    n = np.sqrt(np.sum(x.astype(np.float64) ** 2, -1, keepdims=True))
    return (x / np.maximum(n, 1e-12)).astype(np.float32)


def pixel_array(pixel_values, channels: int) -> np.ndarray:
    """Pixels as float32 [N, C, H, W], or a ModelError saying what was expected (their values
    are checked by the graph: checked_pixels)."""
    try:
        a = np.asarray(pixel_values)
    except (TypeError, ValueError) as e:
        raise ModelError(f"pixel_values: not an array ({e})") from None
    if a.dtype.kind not in "fiu" or a.ndim != 4 or a.shape[1] != channels or 0 in a.shape:
        raise ModelError(f"pixel_values: expected a float array [N, {channels}, height, width], got "
                         f"{a.dtype} of shape {list(a.shape)}")
    return np.ascontiguousarray(a, dtype=np.float32)


def checked_pixels(out: dict, first: int = 0) -> dict:
    """The vision graph's outputs `out` without its pixel_check, after a ModelError naming the
    first image (counting from `first`) that holds a NaN or inf."""
    check = out.pop(PIXEL_CHECK)
    bad = np.flatnonzero(~np.isfinite(check))
    if bad.size:
        raise ModelError(f"pixel_values: image {first + int(bad[0])} has non-finite values (NaN or inf); "
                         "expected finite pixels")
    return out


class VisionModel:
    """A vision encoder (and, for CLIP / SigLIP, its text tower) compiled from the recipe's flows."""

    def __init__(self, recipe, config: dict, tensors: dict, tokenizer=None, backend=None, profile=None,
                 source: str = "", interpolate_pos_encoding: bool | None = None):
        self.recipe, self.config, self.tensors, self.tokenizer = recipe, dict(config), tensors, tokenizer
        self.source = str(source or config.get("_name_or_path") or "model")
        self.profile = resolve_profile(profile, recipe.default_profile, source or None)
        self.backend = select_backend(backend or self.profile.backend.name or None)
        self.arch = recipe.vision_arch(self.config, tensors)
        self.text = recipe.text_arch(self.config, tokenizer)
        self.interpolate = bool_arg("interpolate_pos_encoding", recipe.interpolate_default
                                    if interpolate_pos_encoding is None else interpolate_pos_encoding)
        self.embeds_images = True
        self.embeds_texts = self.text is not None
        self.graph_modes = ("vision", "text") if self.embeds_texts else ("vision",)
        self._lock = backend_lock(self.backend)
        self._exes: dict = {}
        self._shared: dict = {}
        self._processor = None
        self._truncating = None
        # both graphs built once now: a checkpoint that does not fit fails at load, naming its tensors
        probe = self.built("vision")
        if self.embeds_texts:
            self.built("text")
        self.embedding_dim = self._dim_of(probe)
        self.dim = self.embedding_dim

    @staticmethod
    def _dim_of(built) -> int:
        g = built.graph
        for name, ref in g.outputs:
            if name == "embedding":
                return int(g.shape_of(ref).dims[-1])
        raise ModelError("the vision flow has no 'embedding' output")

    def __repr__(self) -> str:
        a = self.arch
        return (f"VisionModel({self.source!r}, model_type={self.config.get('model_type')!r}, {a.layers} layers, "
                f"hidden {a.hidden}, patch {a.patch}, dim {self.embedding_dim}, texts={self.embeds_texts}, "
                f"backend={self.backend.name!r})")

    # -- graphs
    @property
    def image_size(self) -> int:
        return self.arch.image_size

    def built(self, mode: str = "vision", height: int | None = None, width: int | None = None):
        """The flow of `mode` ("vision" for [batch, 3, height, width] pixels, by default the
        config's image_size; "text") built on the model's tensors: what `executable` compiles
        and `rlx inspect` shows."""
        if mode == "vision" and self.arch.naflex:
            flow = naflex_flow(self.arch, profile=self.profile)
        elif mode == "vision":
            h, w = height or self.image_size, width or self.image_size
            flow = vision_flow(self.arch, h, w, self.interpolate, profile=self.profile)
        elif mode == "text":
            if self.text is None:
                raise ModelError(f"mode 'text': a {self.config.get('model_type')} model has no text tower")
            flow = text_flow(self.text, profile=self.profile)
        else:
            raise ModelError(f"mode {mode!r} is not a graph of this VisionModel; expected one of "
                             f"{list(self.graph_modes)}")
        other = ("text_model.", "text_projection.") if mode == "vision" else ("vision_model.", "visual_projection.")
        tower = {k: v for k, v in self.tensors.items() if not k.startswith(other)}
        # the other tower's tensors are left out; the logit scale / bias are read on the host
        unused = tuple(self.recipe.ignore_unused) + tuple(k for k in self.recipe.logit_keys() if k)
        return flow.build(tower, self.config, F32, ignore_unused=unused)

    def executable(self, mode: str = "vision", height: int | None = None, width: int | None = None):
        key = (mode, height, width)
        with self._lock:
            if key not in self._exes:
                self._exes[key] = self.built(mode, height, width).compile(self.backend, self.profile,
                                                                          shared=self._shared)
            return self._exes[key]

    # -- images
    @property
    def processor(self):
        """The checkpoint's image preprocessing (preprocessor_config.json beside config.json)."""
        if self._processor is None and self.arch.naflex:
            from .naflex import NaflexProcessor

            self._processor = NaflexProcessor.from_folder(self.source)
        elif self._processor is None:
            from .images import ImageProcessor

            self._processor = ImageProcessor.from_folder(self.source)
        return self._processor

    def pixel_run(self, pixel_values, pixel_attention_mask=None, spatial_shapes=None) -> tuple:
        """(executable, feed) of the vision graph for pixels [N, C, H, W] or, for a NaFlex
        model, the processor's patches [N, T, p*p*C] with their pixel_attention_mask [N, T]
        and spatial_shapes [N, 2]."""
        if self.arch.naflex:
            return self.executable("vision"), self.naflex_feed(pixel_values, pixel_attention_mask, spatial_shapes)
        if pixel_attention_mask is not None or spatial_shapes is not None:
            raise ModelError("pixel_attention_mask / spatial_shapes are for NaFlex (siglip2) models")
        feed = {"pixel_values": pixel_array(pixel_values, self.arch.channels)}
        return self.executable("vision", *feed["pixel_values"].shape[2:]), feed

    def forward_pixels(self, pixel_values, pixel_attention_mask=None, spatial_shapes=None, fetch=None) -> dict:
        """The outputs of the vision graph (last_hidden_state, pooled, embedding; `fetch` names
        some, so a GPU copies back only those) for pixel_run's arguments."""
        exe, feed = self.pixel_run(pixel_values, pixel_attention_mask, spatial_shapes)
        with self._lock:
            out = exe.run(feed, fetch=None if fetch is None else (*fetch, PIXEL_CHECK))
        return checked_pixels(out)

    def naflex_feed(self, pixel_values, pixel_attention_mask, spatial_shapes) -> dict:
        """The NaFlex graph's inputs: the patches, each image's position-resize weights (its
        spatial shape's grid), and the key mask."""
        a = self.arch
        x = np.asarray(pixel_values)
        width = a.channels * a.patch * a.patch
        if x.dtype.kind not in "fiu" or x.ndim != 3 or x.shape[2] != width or 0 in x.shape:
            raise ModelError(f"pixel_values: expected patches [N, tokens, {width}] (the NaFlex processor's), "
                             f"got {x.dtype} of shape {list(x.shape)}")
        n, t = x.shape[:2]
        shapes = np.asarray(spatial_shapes if spatial_shapes is not None else np.zeros((0,)))
        if shapes.shape != (n, 2) or shapes.dtype.kind not in "iu":
            raise ModelError(f"spatial_shapes: expected [{n}, 2] integers (patch rows, cols per image), got "
                             f"{list(shapes.shape)}")
        mask = np.asarray(pixel_attention_mask) if pixel_attention_mask is not None else \
            (np.arange(t)[None, :] < shapes.prod(-1)[:, None])
        if mask.shape != (n, t):
            raise ModelError(f"pixel_attention_mask: expected [{n}, {t}], got {list(mask.shape)}")
        for i, (h, w) in enumerate(shapes):
            if h < 1 or w < 1 or h * w > t:
                raise ModelError(f"spatial_shapes: image {i} has a {h}x{w} patch grid; expected at least 1x1 "
                                 f"and at most {t} patches")
        weights = np.stack([grid_position_weights(a.grid, (int(h), int(w)), t) for h, w in shapes])
        x = np.ascontiguousarray(x, np.float32)
        return {"pixel_values": x, "pos_weights": weights,
                "key_mask": np.ascontiguousarray(mask.astype(bool)[:, None, None, :])}

    def embed_pixels(self, pixel_values, normalize: bool = False, batch_size: int = 16,
                     pixel_attention_mask=None, spatial_shapes=None) -> np.ndarray:
        """Embeddings [N, dim] of preprocessed pixels [N, C, H, W] (NaFlex: the processor's
        patches, pixel_attention_mask and spatial_shapes)."""
        bs = int_arg("batch_size", batch_size, lo=1)
        n = len(pixel_values) if hasattr(pixel_values, "__len__") else 0
        if not n:
            raise ModelError("pixel_values: no images")

        def part(i: int) -> tuple:
            at = slice(i, i + bs)
            return self.pixel_run(pixel_values[at], None if pixel_attention_mask is None else pixel_attention_mask[at],
                                  None if spatial_shapes is None else spatial_shapes[at])
        # each batch is submitted before the one before it is collected, so on a GPU the host's
        # staging of batch i+1 overlaps the device's run of batch i (no host round trip between
        # batches); the lock is held throughout, as a runner stages into two slots: no other
        # run may come between
        out, pending = [], None
        with self._lock:
            for i in range(0, n, bs):
                exe, feed = part(i)
                submitted = exe.submit(feed, ("embedding", PIXEL_CHECK))
                if pending is not None:
                    out.append(checked_pixels(pending[1](), pending[0])["embedding"])
                pending = (i, submitted)
            out.append(checked_pixels(pending[1](), pending[0])["embedding"])
        e = np.concatenate(out).astype(np.float32)
        return _l2(e) if bool_arg("normalize", normalize) else e

    def _pixels_of(self, images) -> dict:
        """embed_pixels' arguments for images (pixels [N, C, H, W], or a NaFlex processor's
        dict of pixel_values / pixel_attention_mask / spatial_shapes, pass through)."""
        if isinstance(images, dict):
            return dict(images)
        if isinstance(images, np.ndarray) and images.dtype.kind == "f" and images.ndim == 4 \
                and not self.arch.naflex:
            return {"pixel_values": images}
        if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
            images = [images]
        out = self.processor(list(images))
        return dict(out) if isinstance(out, dict) else {"pixel_values": out}

    # -- texts
    def _tokens(self, texts: list) -> list:
        t = self.text
        if self.tokenizer is None:
            raise ModelError(f"{self.source} has no tokenizer (expected tokenizer.json beside config.json); "
                             "the text tower needs one")
        for i, s in enumerate(texts):
            if not isinstance(s, str):
                raise ModelError(f"text {i}: expected a string, got {type(s).__name__}")
        encs = list(self.tokenizer.backend.encode_batch(texts))
        long = [i for i, e in enumerate(encs) if len(e.ids) > t.max_positions]
        if long:
            warnings.warn(f"{len(long)} text(s) longer than {t.max_positions} tokens truncated (text {long[0]}: "
                          f"{len(encs[long[0]].ids)} tokens)", stacklevel=4)
            if self._truncating is None:
                from tokenizers import Tokenizer as TkTokenizer

                tk = TkTokenizer.from_str(self.tokenizer.backend.to_str())
                tk.no_padding()
                tk.enable_truncation(t.max_positions)
                self._truncating = tk
            for i, e in zip(long, self._truncating.encode_batch([texts[i] for i in long])):
                encs[i] = e
        rows = [list(e.ids) for e in encs]
        if any(not r for r in rows):
            raise ModelError(f"text {next(i for i, r in enumerate(rows) if not r)}: no tokens")
        return rows

    def text_feed(self, rows: list) -> dict:
        """The text graph's inputs for token-id rows: right-padded with the pad id (SigLIP:
        to max_position_embeddings, as its processor pads), and the pooled token per row
        (CLIP: the first EOS, or the largest id for configs with the legacy eos_token_id 2;
        SigLIP: the last)."""
        t = self.text
        s = t.max_positions if t.pooling == "last" else max(len(r) for r in rows)
        ids = np.full((len(rows), s), t.pad_id, np.int64)
        for b, r in enumerate(rows):
            if len(r) > t.max_positions:
                raise ModelError(f"text {b}: {len(r)} tokens, the model takes at most {t.max_positions}")
            ids[b, :len(r)] = r
        if np.any(ids < 0) or np.any(ids >= t.vocab):
            raise ModelError(f"token id out of range [0, {t.vocab})")
        if t.pooling == "last":
            at = np.full(len(rows), s - 1)
        elif t.eos_id == 2:
            at = ids.argmax(-1)
        else:
            hit = ids == t.eos_id
            if not hit.any(-1).all():
                bad = int(np.flatnonzero(~hit.any(-1))[0])
                raise ModelError(f"text {bad}: no EOS token (id {t.eos_id}); CLIP pools the EOS token's "
                                 "state (the tokenizer's post-processor adds it)")
            at = hit.argmax(-1)
        pos = np.broadcast_to(np.arange(s, dtype=np.int64), ids.shape)
        onehot = np.zeros(ids.shape, np.float32)
        onehot[np.arange(len(rows)), at] = 1.0
        return {"ids": ids, "positions": np.ascontiguousarray(pos), "pool_onehot": onehot}

    def forward_ids(self, rows, fetch=None) -> dict:
        """The outputs of the text graph (all, or those `fetch` names) for token-id rows (lists
        of ints)."""
        if self.text is None:
            raise ModelError(f"a {self.config.get('model_type')} model has no text tower")
        feed = self.text_feed([list(map(int, r)) for r in rows])
        exe = self.executable("text")
        with self._lock:
            return exe.run(feed, fetch=fetch)

    def embed_texts(self, texts, normalize: bool = False, batch_size: int = 16) -> np.ndarray:
        if self.text is None:
            raise ModelError(f"{self.source}: a {self.config.get('model_type')} model embeds images only "
                             "(no text tower)")
        texts = [texts] if isinstance(texts, str) else list(texts)
        bs = int_arg("batch_size", batch_size, lo=1)
        rows = self._tokens(texts)
        out = [self.forward_ids(rows[i:i + bs], fetch=("embedding",))["embedding"] for i in range(0, len(rows), bs)]
        e = np.concatenate(out).astype(np.float32) if out else np.zeros((0, self.embedding_dim), np.float32)
        return _l2(e) if bool_arg("normalize", normalize) else e

    # -- the interface
    def embed(self, texts=None, images=None, normalize: bool = False, batch_size: int = 16) -> np.ndarray:
        """[n, dim] embeddings of `images` (paths, bytes, HWC uint8 arrays, PIL images, or
        pixels [N, C, H, W]) or of `texts`; L2-normalized only when `normalize`."""
        if (texts is None) == (images is None):
            raise ModelError("embed() takes texts or images (one of them)")
        if images is not None:
            return self.embed_pixels(normalize=normalize, batch_size=batch_size, **self._pixels_of(images))
        return self.embed_texts(texts, normalize, batch_size)

    def logit_scale_bias(self) -> tuple:
        """(exp(logit_scale), logit_bias) as HF's CLIPModel / SiglipModel apply them."""
        scale_key, bias_key = self.recipe.logit_keys()
        if not scale_key or scale_key not in self.tensors:
            raise ModelError(f"{self.source}: similarity needs a two-tower model with {scale_key or 'logit_scale'}")
        scale = float(np.exp(np.asarray(self.tensors[scale_key], np.float32).reshape(-1)[0]))
        bias = float(np.asarray(self.tensors[bias_key], np.float32).reshape(-1)[0]) if bias_key else 0.0
        return scale, bias

    def similarity(self, images, texts, batch_size: int = 16) -> np.ndarray:
        """HF's logits_per_image [n_images, n_texts]: exp(logit_scale) * cosine (+ logit_bias
        for SigLIP)."""
        scale, bias = self.logit_scale_bias()
        img = self.embed(images=images, normalize=True, batch_size=batch_size)
        txt = self.embed(texts=texts, normalize=True, batch_size=batch_size)
        return (img @ txt.T * np.float32(scale) + np.float32(bias)).astype(np.float32)

    # -- rlx_core.testing's batch and fused/composed checks (this model takes pixels)
    def kit_rows(self, rng) -> list:
        """Three single images at the config's size (and, with a text tower, a text each)."""
        size, rows = self.image_size, []
        for n in (3, 5, 2):
            if self.arch.naflex:        # grids 2x3, 3x2, 1x4 padded to 7 patches
                g = {3: (2, 3), 5: (3, 2), 2: (1, 4)}[n]
                r = {"pixel_values": rng.standard_normal((1, 7, self.arch.channels * self.arch.patch ** 2))
                     .astype(np.float32), "spatial_shapes": np.array([g], np.int64)}
            else:
                r = {"pixel_values": rng.standard_normal((1, self.arch.channels, size, size)).astype(np.float32)}
            if self.text is not None:
                r["ids"] = [[int(x) for x in rng.integers(1, self.text.vocab, n)]
                            + ([self.text.eos_id] if self.text.eos_id is not None else [])]
            rows.append(r)
        return rows

    @staticmethod
    def kit_batch(rows: list) -> dict:
        out = {k: np.concatenate([r[k] for r in rows]) for k in ("pixel_values", "spatial_shapes") if k in rows[0]}
        if "ids" in rows[0]:
            out["ids"] = [x for r in rows for x in r["ids"]]
        return out

    def kit_outputs(self, feed: dict) -> dict:
        out = {f"image.{k}": v for k, v in self.forward_pixels(feed["pixel_values"], None,
                                                                feed.get("spatial_shapes")).items()
               if k in ("pooled", "embedding")}
        if "ids" in feed:
            out.update({f"text.{k}": v for k, v in self.forward_ids(feed["ids"]).items()
                        if k in ("pooled", "embedding")})
        return out


__all__ = ["VisionModel", "pixel_array", "checked_pixels"]
