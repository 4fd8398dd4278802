"""Writing a checkpoint as a GGUF file with packed weights (`rlx quantize`).

The inverse of `gguf_io`'s loading: HF names become llama.cpp's, values get what llama.cpp's
converter does to them (row permutations, norms stored as 1 + w: the family's registered
`GGUFArchitecture` says which), the config becomes GGUF metadata, and every matmul weight whose
rows split into whole blocks is quantized with the scheme (the rest stays f32, as llama.cpp's
own quantizer keeps norms); a 3-D stack of them (routed experts, numpy [E, rows, cols]) is
quantized as llama.cpp's ffn_*_exps are, ggml ne [cols, rows, E]. The HF tokenizer travels
as `tokenizer.huggingface.json`, plus llama.cpp's BPE fields for byte-level BPE vocabularies,
so both RLX and llama.cpp read the file.

`f16` and `bf16` write the matmul weights unquantized in that float type (llama.cpp's F16 /
BF16 files, what its converter writes before `llama-quantize`), everything else as above.

RLX's own int8/int4 blocks have no GGUF type: they are stored as GGUF I8 bytes
[(E,) rows, bytes per row] with the scheme and logical shape under `rlx.scheme.<tensor>`
("<scheme>:<rows>x<cols>", or "<scheme>:<E>x<rows>x<cols>"), which RLX reads back and
llama.cpp does not.

The file is written under a temporary name beside DST and renamed at the end, so a failed run
leaves no partial file and never the old DST half-written; DST may not be a file of the source
model's folder (see `destination`).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets

import gguf
import ml_dtypes
import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.flow.rope import rope_params
from rlx_core.ir.quant import QuantScheme

from .checkpoint import Checkpoint
from .config import check_config
from .gguf_arch import GGUFArchitecture, gguf_architecture
from .gguf_io import GGUF_MAGIC, SCHEME_KEY
from .tokenizer import HF_TOKENIZER_KEY, RLX_TOKENIZER_KEY


# the config keys every GGUF of these families needs (the rest have defaults), and the keys
# written as GGUF's uint32 and float32 values
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
_U32 = _REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                    "bos_token_id", "eos_token_id", "pad_token_id")
_F32 = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
        "attn_logit_softcapping", "final_logit_softcapping")
_F32_MAX = float(np.finfo(np.float32).max)


def gguf_name(arch: str, hf: str) -> str:
    """The GGUF name of HF tensor `hf` in architecture `arch`; WeightError when it has none."""
    name = gguf_architecture("", arch).gguf_name(hf)
    if name is None:
        raise WeightError(f"tensor {hf!r} has no GGUF name for architecture {arch!r}")
    return name


def _metadata(w, mapping: GGUFArchitecture, cfg: dict) -> None:
    """The generic llama.cpp keys, the family's own (`write_metadata`), then the token ids."""
    def get(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        return default

    heads = cfg["num_attention_heads"]
    head_dim = get("head_dim", default=cfg["hidden_size"] // heads)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(get("max_position_embeddings", default=2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(get("num_key_value_heads", default=heads))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(get("rms_norm_eps", default=1e-6)))
    w.add_rope_freq_base(float(get("rope_theta", default=10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    mapping.write_metadata(w, cfg, head_dim)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int) and not isinstance(v, bool):
            add(v)


def _tokenizer(w, tok) -> None:
    """The HF tokenizer as `tokenizer.huggingface.json` plus what RLX's Tokenizer knows beside it
    (`rlx.tokenizer`), and llama.cpp's fields for a byte-level BPE vocabulary."""
    text = tok.backend.to_str()
    w.add_string(HF_TOKENIZER_KEY, text)
    w.add_string(RLX_TOKENIZER_KEY, json.dumps({
        "special_tokens": tok.special_tokens, "eos_token_ids": list(tok.eos_token_ids),
        "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    doc = json.loads(text)
    model = doc.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return                          # llama.cpp's fields only for byte-level BPE
    added = {t["id"]: t["content"] for t in doc.get("added_tokens", [])}
    vocab = {**{i: t for t, i in model["vocab"].items()}, **added}
    n = max(vocab) + 1
    w.add_tokenizer_model("gpt2")
    w.add_token_list([vocab.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([3 if i in added else 1 for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])


def destination(dst, *sources) -> str:
    """The real path to write `dst` to (links resolved), checked before any work: not a folder,
    in a folder that exists, and not a file of a source (see `_source_files`). WeightError
    naming `dst` and what was expected otherwise."""
    given = os.fspath(dst)
    if not given or given.endswith(os.sep) or os.path.isdir(given):
        what = "is a folder" if given else "is empty"
        raise WeightError(f"destination {given!r} {what}; expected the path of the .gguf file to write")
    path = os.path.realpath(given)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise WeightError(f"{given}: the folder {folder} does not exist (or is not a folder); "
                          f"expected the .gguf file's path in an existing folder")
    if os.path.exists(path) and not os.path.isfile(path):       # renaming over it would replace it
        raise WeightError(f"{given}: is not a regular file (a device, pipe or socket); expected the "
                          f"path of the .gguf file to write")
    if os.path.exists(path):
        for f in _source_files(sources):
            if os.path.samefile(path, f):
                raise WeightError(f"{given}: is {f}, a file of the source model; rlx quantize never "
                                  f"overwrites its input: choose a path outside it (or a new name)")
    return path


def _source_files(sources) -> list:
    """What a destination may not be: each source file, and every file in a source's folder
    but GGUF files (a safetensors checkpoint never reads one; an earlier run may have written it)."""
    out = []
    for src in sources:
        src = os.fspath(src)
        folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
        out += [src] if os.path.isfile(src) else []
        try:
            with os.scandir(folder) as it:
                out += [e.path for e in it if e.is_file() and not _is_gguf(e.path)]
        except OSError as e:
            raise WeightError(f"{src}: cannot list the source folder {folder} ({e.strerror})") from None
    return out


def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _temporary(path: str, given: str) -> str:
    """A new empty file beside `path` to write into: the check that its folder takes a file."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError as e:
        raise WeightError(f"{given}: cannot write a file in {folder} ({e.strerror}); expected a "
                          f"writable folder") from None
    return tmp


def _check_for_gguf(cfg: dict, source: str) -> None:
    """What check_config leaves to the writer: every value written as a GGUF uint32 or float32
    fits it, and rope scaling is linear (or none) with a positive factor."""
    for key in _U32:
        v = cfg.get(key)
        if any(x >= 2**32 for x in (v if isinstance(v, list) else [v]) if x is not None):
            raise WeightError(f"{source}: {key} = {v!r} does not fit GGUF's 32-bit field (expected < 2**32)")
    for key in _F32:
        if cfg.get(key) is not None and abs(cfg[key]) > _F32_MAX:
            raise WeightError(f"{source}: {key} = {cfg[key]!r} does not fit GGUF's float32 "
                              f"(expected at most {_F32_MAX:.4g})")
    scaling = cfg.get("rope_scaling") or {}
    kind, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
    if kind not in (None, "default", "linear"):
        raise WeightError(f"{source}: rope_scaling type {kind!r} cannot be written to GGUF (only linear)")
    real = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if kind == "linear" and not (real and 0 < factor <= _F32_MAX):
        raise WeightError(f"{source}: rope_scaling factor {factor!r}: expected a finite number > 0")


def _reads_back(tmp: str, source: str, dst: str) -> None:
    """The written file loads as RLX loads a GGUF (gguf_io's checks of metadata and tensors):
    a config the model could not run from is named here, not when DST is first used."""
    from .checkpoint import load_checkpoint

    try:
        load_checkpoint(tmp, packed=True)
    except WeightError as e:
        raise WeightError(f"{source}: the GGUF written from it would not load, so {dst} is not written: "
                          f"{str(e).replace(tmp, 'the GGUF')}") from None


def _rope_keys_of_gguf(cfg: dict) -> dict:
    """The config with its RoPE base and scaling as `rope_theta` / `rope_scaling`, the keys
    GGUF's metadata follows: transformers 5 saves them inside `rope_parameters` instead."""
    if not isinstance(cfg.get("rope_parameters"), dict):
        return cfg
    theta, scaling = rope_params(cfg)
    return {**cfg, "rope_theta": theta, "rope_scaling": scaling}


# the float types matmul weights can be written in unquantized: GGUF type, file type, numpy dtype
FLOAT_TYPES = {
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16, np.dtype(np.float16)),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16, np.dtype(ml_dtypes.bfloat16)),
}


def parse_scheme(scheme: QuantScheme | str) -> QuantScheme | str:
    """A packed scheme, or the name of a float type of FLOAT_TYPES (`rlx quantize -s f16`)."""
    if isinstance(scheme, str) and scheme.lower() in FLOAT_TYPES:
        return scheme.lower()
    return QuantScheme.parse(scheme)


def write_gguf(ckpt: Checkpoint, dst: str, scheme: QuantScheme | str, echo=print) -> dict:
    """Write `ckpt` (an HF folder's checkpoint) to `dst` with matmul weights in `scheme` (a
    packed scheme, or "f16" / "bf16": unquantized). Returns {"quantized": n (the matmul weights
    written in the scheme), "kept": [names kept in f32]}."""
    q = parse_scheme(scheme)
    ckpt = _as_gguf_holds_it(ckpt)
    cfg = _rope_keys_of_gguf(ckpt.config)
    arch = _architecture_of(ckpt.path, cfg.get("model_type"))
    source = os.path.join(ckpt.path, "config.json")
    _check_for_gguf(check_config(cfg, source, required=_REQUIRED), source)
    path = destination(dst, ckpt.path)
    tmp = _temporary(path, os.fspath(dst))
    try:
        done = _write(ckpt, cfg, tmp, arch, q, echo)
        _reads_back(tmp, source, os.fspath(dst))
        os.replace(tmp, path)                       # all of it, or the old DST untouched
    except OSError as e:
        raise WeightError(f"{os.fspath(dst)}: cannot write ({e.strerror or e})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)                          # gone already once renamed
    return done


def _as_gguf_holds_it(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint as its family's GGUF holds it: a recipe may define
    `gguf_checkpoint(ckpt)` (experts stacked into 3-D tensors, a model type llama.cpp spells
    otherwise); other families' checkpoints are written as they are."""
    from rlx_core.plugins import registry

    recipe = registry().recipes.get(ckpt.config.get("model_type"))
    convert = getattr(recipe, "gguf_checkpoint", None)
    return convert(ckpt) if callable(convert) else ckpt


def _architecture_of(path: str, model_type) -> str:
    """The GGUF architecture a plugin registered for `model_type` (the first, in registration order)."""
    from rlx_core.plugins import registry

    archs = registry().gguf_architectures
    arch = next((a for a, m in archs.items() if m.model_type == model_type), None)
    if arch is None:
        raise WeightError(f"{path}: model_type {model_type!r} cannot be written to GGUF; "
                          f"supported: {sorted({m.model_type for m in archs.values()})}")
    return arch


def _add_packed(writer, name: str, x: np.ndarray, q: QuantScheme, hf: str) -> None:
    """A matrix [rows, cols] or a stack of them [E, rows, cols] (routed experts) quantized in
    llama.cpp's layout: the bytes [.., rows, bytes per row], ggml ne [cols, rows(, E)]."""
    raw = (np.stack([q.quantize(m, name=hf) for m in x]) if x.ndim == 3     # (an expert's temporaries at a time)
           else q.quantize(x, name=hf)).reshape(x.shape[:-1] + (-1,))
    if q.gguf_type is not None:
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(q.gguf_type))
    else:
        writer.add_string(SCHEME_KEY + name, f"{q.name}:" + "x".join(str(d) for d in x.shape))
        writer.add_tensor(name, raw.view(np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)


# general.file_type: llama.cpp's name for a file whose matrices are in one scheme (not the
# ggml type id: q8_0's type is 8, its file type 7); RLX's own schemes: "guessed"
_FILE_TYPE = gguf.LlamaFileType                 # gguf-py's enum of general.file_type
_FILE_TYPES = {"q4_0": _FILE_TYPE.MOSTLY_Q4_0, "q4_1": _FILE_TYPE.MOSTLY_Q4_1, "q5_0": _FILE_TYPE.MOSTLY_Q5_0,
               "q5_1": _FILE_TYPE.MOSTLY_Q5_1, "q8_0": _FILE_TYPE.MOSTLY_Q8_0, "q4_k": _FILE_TYPE.MOSTLY_Q4_K_S,
               "q5_k": _FILE_TYPE.MOSTLY_Q5_K_S, "q6_k": _FILE_TYPE.MOSTLY_Q6_K}


def _add_float(writer, name: str, x: np.ndarray, kind: str) -> None:
    """A matrix or expert stack unquantized in the float type `kind` (round to nearest even)."""
    gtype, _, dtype = FLOAT_TYPES[kind]
    y = x.astype(dtype)
    if kind == "f16":
        writer.add_tensor(name, y)
    else:                                       # gguf-py knows BF16 only as raw bytes
        writer.add_tensor(name, y.view(np.uint16), raw_shape=y.shape, raw_dtype=gtype)


def _add_matrix(writer, name: str, x: np.ndarray, q: QuantScheme | str, hf: str) -> bool:
    """A matmul weight (or expert stack) in `q`; False where its rows are not whole blocks of
    the packed scheme (the caller keeps it in f32)."""
    if isinstance(q, str):
        _add_float(writer, name, x, q)
    elif x.shape[-1] % q.block_size == 0:
        _add_packed(writer, name, x, q, hf)
    else:
        return False
    return True


def _write(ckpt: Checkpoint, cfg: dict, path: str, arch: str, q: QuantScheme | str, echo) -> dict:
    mapping = gguf_architecture(ckpt.path, arch)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(os.path.basename(os.path.normpath(ckpt.path)))
    writer.add_file_type(FLOAT_TYPES[q][1] if isinstance(q, str) else _FILE_TYPES.get(q.name, _FILE_TYPE.GUESSED))
    _metadata(writer, mapping, cfg)
    if ckpt.tokenizer is not None:
        _tokenizer(writer, ckpt.tokenizer)
    kept, quantized = [], 0
    tied = cfg.get("tie_word_embeddings", False)
    for hf in sorted(ckpt.tensors):
        if tied and hf == "lm_head.weight":
            continue
        name = gguf_name(arch, hf)
        x = mapping.to_gguf(name, np.asarray(ckpt.tensors[hf], np.float32), cfg, hf)
        if x.ndim in (2, 3) and _add_matrix(writer, name, x, q, hf):
            quantized += 1
        else:
            writer.add_tensor(name, x)
            if x.ndim in (2, 3):
                kept.append(hf)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    if kept:
        echo(f"kept in f32 (rows do not split into whole {getattr(q, 'name', q)} blocks): {', '.join(kept)}")
    return {"quantized": quantized, "kept": kept}


__all__ = ["write_gguf", "parse_scheme", "FLOAT_TYPES", "destination", "gguf_name", "SCHEME_KEY"]
