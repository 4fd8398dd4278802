"""Checkpoint: config + tensors + tokenizer of one model, from an HF folder or a GGUF file.

Only safetensors and GGUF are read: pickle-based `.bin`/`.pt` files can run code when loaded.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping

import attrs
import numpy as np

from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import WeightError
from rlx_core.ir.quant import PackedTensor

from .config import check_config, check_layer_counts
from .gguf_io import GGUF_MAGIC, load_gguf
from .packaged import resolve_model_path
from .safetensors_io import iter_safetensors, read_safetensors_header
from .tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf


@attrs.frozen(eq=False, repr=False)
class Checkpoint:
    path: str  # the file or folder it came from
    format: str  # "safetensors" | "gguf"
    config: dict  # HF config.json (synthesized from metadata for GGUF)
    tensors: Mapping[str, np.ndarray]  # HF names -> arrays (GGUF: float32; safetensors: as stored)
    tokenizer: Tokenizer | None

    def architecture(self) -> str:
        """The HF `model_type`, as config.json names it; for a diffusers model folder
        (no model_type) its `_class_name`, the transformer's class name."""
        arch = self.config.get("model_type") or self.config.get("_class_name")
        if not isinstance(arch, str) or not arch:
            raise WeightError(f"{self.path}: config has no 'model_type' (nor a diffusers '_class_name')")
        return arch

    def packed_names(self) -> list:
        return [k for k, t in self.tensors.items() if isinstance(t, PackedTensor)]

    def held_as(self, weights: str) -> "Checkpoint":
        """This checkpoint with its packed weights as `[precision] weights` asks: "packed" keeps
        them, "f32"/"f16"/"bf16" dequantizes them now."""
        if weights == "packed" or not self.packed_names():
            return self
        dt = DType.parse(weights).np
        return attrs.evolve(self, tensors={k: t.dequantize(dt) if isinstance(t, PackedTensor) else t
                                           for k, t in self.tensors.items()})

    def __repr__(self) -> str:
        return (
            f"Checkpoint({self.path!r}, format={self.format!r}, "
            f"model_type={self.config.get('model_type')!r}, tensors={len(self.tensors)}, "
            f"tokenizer={'yes' if self.tokenizer else 'no'})"
        )


def load_checkpoint(path: str | os.PathLike, progress: bool = False, packed: bool = False) -> Checkpoint:
    """Load an HF model folder (config.json + safetensors), a .gguf file, or a packaged model name.
    `packed`: a GGUF's quantized matmul weights stay packed (PackedTensor over the mapped file)."""
    path = resolve_model_path(os.fspath(path))
    if os.path.isdir(path):
        folder = _model_folder(path)
        if isinstance(folder, tuple):  # a folder holding just one .gguf file
            return _load_gguf(folder[0], progress, packed)
        return _load_folder(folder, progress)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise WeightError(f"{path}: cannot read ({e})") from e
    if magic == GGUF_MAGIC:
        return _load_gguf(path, progress, packed)
    if path.endswith(".safetensors"):
        return _load_folder(os.path.dirname(os.path.abspath(path)), progress, files=[path])
    raise WeightError(f"{path}: not a GGUF file (no b'GGUF' magic) nor a .safetensors file")


def _load_gguf(path: str, progress: bool, packed: bool = False) -> Checkpoint:
    config, tensors, gf = load_gguf(path, progress, packed)
    return Checkpoint(path, "gguf", config, tensors, tokenizer_from_gguf(path, gf.metadata))


def _model_folder(path: str) -> str | tuple[str]:
    """The folder holding config.json: `path` itself, or the transformer module of a
    sentence-transformers layout (modules.json), or its single subfolder with a config.json."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return (ggufs[0],)
    modules = os.path.join(path, "modules.json")
    if os.path.isfile(modules):
        try:
            with open(modules, encoding="utf-8") as f:
                entries = json.load(f)
            for entry in entries:
                if entry.get("type", "").endswith("models.Transformer"):
                    sub = os.path.join(path, entry.get("path", ""))
                    if os.path.isfile(os.path.join(sub, "config.json")):
                        return sub
        except (OSError, ValueError, RecursionError, AttributeError, TypeError):
            pass  # fall through to the subfolder search
    subs = sorted(d for d in glob.glob(os.path.join(path, "*", "config.json")))
    if len(subs) == 1:
        return os.path.dirname(subs[0])
    found = f"; several subfolders have one: {[os.path.dirname(s) for s in subs]}" if subs else ""
    extra = f"; it holds several .gguf files, pass one: {ggufs}" if ggufs else ""
    raise WeightError(
        f"{path}: no config.json (expected an HF model folder with config.json and *.safetensors)"
        f"{found}{extra}"
    )


def _weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise WeightError(
                f"{index}: not a valid safetensors index (expected a 'weight_map' object of file names): {e!r}"
            ) from None
        shards = [os.path.join(folder, s) for s in dict.fromkeys(weight_map.values())]
        missing = [s for s in shards if not os.path.isfile(s)]
        if missing:
            raise WeightError(f"{index}: lists shards that are missing: {missing}")
        return shards
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    pickles = [
        os.path.basename(p)
        for p in glob.glob(os.path.join(folder, "*.bin")) + glob.glob(os.path.join(folder, "*.pt"))
    ]
    hint = (
        f" (it has {pickles}: pickle files are never loaded; convert them to safetensors)" if pickles else ""
    )
    raise WeightError(
        f"{folder}: no model weights (expected model.safetensors or model.safetensors.index.json){hint}"
    )


def _load_folder(folder: str, progress: bool, files: list[str] | None = None) -> Checkpoint:
    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise WeightError(
            f"{folder}: no config.json (expected an HF model folder with config.json and *.safetensors)"
        ) from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
        raise WeightError(f"{cfg_path}: cannot read config ({type(e).__name__}: {e})") from None
    check_config(config, cfg_path)

    files = files or _weight_files(folder)
    names = [n for p in files for n in read_safetensors_header(p)[0]]
    check_layer_counts(config, names, cfg_path, blocks=False)
    total = len(names)
    bar = None
    if progress:
        from rlx_core.progress import tqdm_class

        bar = tqdm_class()(total=total, desc=f"loading {os.path.basename(folder.rstrip(os.sep))}",
                           unit="tensor")
    tensors: dict[str, np.ndarray] = {}
    try:
        for p in files:
            for name, array in iter_safetensors(p):
                if name in tensors:
                    raise WeightError(f"{p}: tensor {name!r} also appears in another shard")
                tensors[name] = array
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return Checkpoint(folder, "safetensors", config, tensors, tokenizer_from_folder(folder, config))
