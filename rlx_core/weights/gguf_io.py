"""Reading GGUF files: metadata -> HF-style config, tensors -> float32 arrays under HF names.

The header is parsed here because `gguf.GGUFReader` builds a numpy view per array element and takes
~15 s on a 262k-token vocabulary; `gguf.quants.dequantize` still does all the unpacking. What the
tensors look like after loading follows transformers' GGUF loader exactly (see
`transformers/modeling_gguf_pytorch_utils.py`); what differs per family (tensor names, value
transforms such as row permutations, extra metadata) comes from the `GGUFArchitecture` its plugin
registered (`gguf_arch`).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from typing import Any, NamedTuple

import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.ir.quant import GGUF_SCHEMES, PackedTensor, QuantScheme
from rlx_core.pipeline import release_file_pages
from rlx_core.weights.config import check_layer_count
from rlx_core.weights.gguf_meta import meta_int

GGUF_MAGIC = b"GGUF"
# RLX's own int blocks: "<scheme>:<rows>x<cols>" (a stack: "<scheme>:<E>x<rows>x<cols>") per i8 tensor
SCHEME_KEY = "rlx.scheme."
_MAX_DIMS = 4  # GGML_MAX_DIMS

# metadata value types: fixed-size scalars by struct format; 8 is string, 9 is array
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}

class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions fastest-first, i.e. reversed)
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int = 0


class GGUFFile(NamedTuple):
    path: str
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int


# ---------------------------------------------------------------------------------------------- header


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table (no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise WeightError(f"{path}: not a GGUF file (expected the magic bytes b'GGUF' at offset 0)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf)
    except OSError as e:
        raise WeightError(f"{path}: cannot read GGUF file ({e})") from e
    except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError, RecursionError) as e:
        raise WeightError(f"{path}: GGUF header is truncated or corrupt ({type(e).__name__}: {e})") from None


def _parse(path: str, buf: mmap.mmap) -> GGUFFile:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise WeightError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise ValueError(f"string of {n} bytes at offset {pos} runs past the end of the file")
        s = buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace")
        pos += 8 + n
        return s

    def strings(count: int) -> list:
        nonlocal pos
        out, p, end, unpack = [], pos, len(buf), struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, p)
            if p + 8 + n > end:
                raise ValueError(f"string of {n} bytes at offset {p} runs past the end of the file")
            out.append(buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"))
            p += 8 + n
        pos = p
        return out

    def value(vtype: int):
        nonlocal pos
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR:  # numeric arrays (scores, token types): one numpy read
                dt = np.dtype(_SCALAR[etype])
                if pos + count * dt.itemsize > len(buf):
                    raise ValueError(f"array of {count} values at offset {pos} runs past the end of the file")
                arr = np.frombuffer(buf[pos : pos + count * dt.itemsize], dtype=dt)
                pos += count * dt.itemsize
                return arr.tolist()
            if etype == 8:        # string arrays (a vocabulary): one loop, no call per string
                return strings(count)
            return [value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype} at offset {pos}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key in metadata:
            raise WeightError(f"{path}: GGUF metadata key {key!r} appears twice")
        metadata[key] = value(vtype)
    align = meta_int(path, metadata, "general.alignment", 32)
    if align & (align - 1):
        raise WeightError(f"{path}: GGUF metadata general.alignment = {align}, expected a power of two")
    _check_tokenizer(path, metadata)

    tensors, names = [], set()
    expect = 0  # llama.cpp's rule: each tensor starts where the previous one's padded bytes end
    for _ in range(n_tensors):
        name = string()
        (ndim,) = struct.unpack_from("<I", buf, pos)
        if ndim > _MAX_DIMS:
            raise WeightError(f"{path}: tensor {name!r} has {ndim} dimensions (expected at most {_MAX_DIMS})")
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        if name in names:
            raise WeightError(f"{path}: tensor {name!r} appears twice in the tensor table")
        names.add(name)
        info = TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, offset)
        info = info._replace(nbytes=_nbytes(info, path))
        if offset != expect:
            raise WeightError(
                f"{path}: tensor {name!r} starts at data offset {offset}, expected {expect} (the end of "
                f"the tensor before it, padded to the {align}-byte alignment); misaligned, overlapping "
                "or corrupt tensor table"
            )
        expect = offset + (info.nbytes + align - 1) // align * align
        tensors.append(info)

    data_start = (pos + align - 1) // align * align
    end = max((data_start + t.offset + t.nbytes for t in tensors), default=0)
    if end > len(buf):
        raise WeightError(
            f"{path}: tensor data ends at byte {end} but the file has {len(buf)}; the file is truncated"
        )
    if tensors and len(buf) > data_start + expect:
        # bytes past the last tensor's padding: some tensor's header understates its size (an F32
        # tensor retyped F16 would be read as half its bytes, reinterpreted)
        last = max(tensors, key=lambda t: t.offset)
        raise WeightError(
            f"{path}: the tensors end at byte {data_start + expect} (padded) but the file has "
            f"{len(buf)}; bytes no tensor owns follow {last.name!r} (ggml type {last.ggml_type}, "
            f"{last.nbytes} bytes): a tensor's type or shape is wrong, or the file is corrupt"
        )
    return GGUFFile(path, metadata, tensors, data_start)


def _check_tokenizer(path: str, md: dict) -> None:
    """The tokenizer metadata's types, lengths and ids (a vocabulary index must be in it)."""
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    # (the types of a parsed list, compared as a set: the values are the parser's own ints,
    # floats, bools and strs, and a loop of isinstance over a 262k vocabulary costs 50 ms)
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {str}:
        raise WeightError(f"{path}: GGUF metadata tokenizer.ggml.tokens is not a list of strings")
    for key, kind in (("scores", {int, float, bool}), ("token_type", {int, bool})):
        v = md.get(f"tokenizer.ggml.{key}")
        if v is not None and (
            not isinstance(v, list) or len(v) != len(tokens) or not set(map(type, v)) <= kind
        ):
            raise WeightError(
                f"{path}: GGUF metadata tokenizer.ggml.{key} is not a list of {len(tokens)} numbers "
                "(one per token)"
            )
    merges = md.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or not set(map(type, merges)) <= {str}):
        raise WeightError(f"{path}: GGUF metadata tokenizer.ggml.merges is not a list of strings")
    if md.get("tokenizer.ggml.model") == "gpt2" and not merges:
        raise WeightError(
            f"{path}: GGUF metadata has a BPE ('gpt2') vocabulary but no tokenizer.ggml.merges; "
            "the tokenizer cannot be built without them"
        )
    for key in ("bos", "eos", "eot", "unknown", "padding", "seperator"):
        k = f"tokenizer.ggml.{key}_token_id"
        if k in md:
            meta_int(path, md, k, lo=0, hi=len(tokens) - 1)
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise WeightError(f"{path}: GGUF metadata tokenizer.chat_template is not a string")


# ---------------------------------------------------------------------------------------------- tensors


_F32, _F16 = 0, 1
# (block, bytes per block) of the types RLX reads itself: with these a model loads without
# importing the gguf package (~50 ms of a warm start); other types ask gguf's table
_SIZES = {_F32: (1, 4), _F16: (1, 2), 30: (1, 2)} | {
    s.gguf_type: (s.block_size, s.bytes_per_block) for s in GGUF_SCHEMES}


def _nbytes(info: TensorInfo, path: str) -> int:
    size = _SIZES.get(info.ggml_type)
    if size is None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            raise WeightError(
                f"{path}: tensor {info.name!r} has unknown ggml type {info.ggml_type} "
                f"(expected one of {sorted(int(t) for t in GGML_QUANT_SIZES)})"
            ) from None
    block, type_size = size
    if (info.shape[-1] if info.shape else 1) % block:
        raise WeightError(
            f"{path}: tensor {info.name!r} row length {info.shape[-1] if info.shape else 1} is not a "
            f"multiple of its block size {block}"
        )
    return math.prod(info.shape) // block * type_size  # Python ints: no overflow


def dequantize_tensor(gf: GGUFFile, info: TensorInfo, blob: np.ndarray) -> np.ndarray:
    """One tensor as a float32 array of shape `info.shape` (numpy order, e.g. [out, in] for a matmul);
    F32 and F16 (a model's norms and biases) as gguf.quants.dequantize converts them, without it."""
    start = gf.data_start + info.offset
    nbytes = info.nbytes
    if start + nbytes > blob.size:
        raise WeightError(
            f"{gf.path}: tensor {info.name!r} needs bytes [{start}, {start + nbytes}) but the file has "
            f"{blob.size}; the file is truncated"
        )
    if nbytes == 0:  # no elements: gguf.quants cannot unpack zero blocks
        return np.zeros(info.shape, np.float32)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    raw = blob[start : start + nbytes].reshape(rows, -1)
    if info.ggml_type == _F32:      # a copy: not a view of the mapped file
        return raw.view(np.float32).reshape(info.shape).copy()
    if info.ggml_type == _F16:
        return raw.view(np.float16).astype(np.float32).reshape(info.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    try:
        out = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)
    except NotImplementedError:
        raise WeightError(
            f"{gf.path}: tensor {info.name!r} uses ggml type {qtype.name}, which cannot be dequantized"
        ) from None
    return out


# ---------------------------------------------------------------------------------------------- names

def hf_name(arch: str, gguf_name: str) -> str | None:
    """The transformers parameter name for a GGUF tensor name of architecture `arch` (see
    `GGUFArchitecture.hf_name`); None for one transformers drops."""
    from .gguf_arch import gguf_architecture

    return gguf_architecture("", arch).hf_name(gguf_name)


# ---------------------------------------------------------------------------------------------- config


def gguf_config(gf: GGUFFile, sources: dict | None = None) -> dict:
    """An HF-style config.json dict synthesized from GGUF metadata, every value type- and range-checked:
    the generic llama.cpp keys here, the family's own through its registered `GGUFArchitecture`.
    `sources` (a dict) gets config key -> the metadata key it was read from (`rlx inspect`)."""
    from .gguf_arch import MetadataReader, gguf_architecture

    md, path = gf.metadata, gf.path
    arch = md.get("general.architecture")
    mapping = gguf_architecture(path, arch)
    m = MetadataReader(path, md, arch, sources if sources is not None else {})
    num, real = m.num, m.real
    m.took("general.architecture", "model_type")
    m.took("general.architecture", "architectures")
    hidden = num("embedding_length", to="hidden_size")
    heads = num("attention.head_count", to="num_attention_heads")
    layers = num("block_count", to="num_hidden_layers")
    held = check_layer_count(path, f"GGUF metadata {arch}.block_count", layers, (t.name for t in gf.tensors),
                             blocks=False)      # (0: a vocabulary-only file, read for its tokenizer)
    kv_heads = num("attention.head_count_kv", heads, to="num_key_value_heads")
    if heads % kv_heads:
        raise WeightError(
            f"{path}: GGUF metadata {arch}.attention.head_count = {heads} is not a multiple of "
            f"{arch}.attention.head_count_kv = {kv_heads}"
        )
    head_dim = num("attention.key_length", None, to="head_dim") or mapping.head_dim(m)
    if not head_dim:
        if hidden % heads:
            raise WeightError(
                f"{path}: GGUF metadata {arch}.embedding_length = {hidden} is not a multiple of "
                f"{arch}.attention.head_count = {heads}, and no {arch}.attention.key_length gives the "
                "head size"
            )
        head_dim = hidden // heads
    names = {t.name: t for t in gf.tensors}
    tokens = md.get("tokenizer.ggml.tokens")
    embd = names.get("token_embd.weight")
    vocab = num("vocab_size", len(tokens) if tokens else embd.shape[0] if embd and embd.shape else None,
                to="vocab_size")
    m.took("tokenizer.ggml.tokens", "vocab_size")
    cfg = {
        "model_type": mapping.model_type,
        "architectures": [mapping.hf_class],
        "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length", to="intermediate_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": real("attention.layer_norm_rms_epsilon", 1e-6, to="rms_norm_eps"),
        "rope_theta": real("rope.freq_base", 10000.0, to="rope_theta"),
        "max_position_embeddings": num("context_length", 2048, to="max_position_embeddings"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
    }
    for key, gkey in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        hi = vocab - 1 if vocab is not None else None
        m.took(f"tokenizer.ggml.{gkey}_token_id", f"{key}_token_id")
        cfg[f"{key}_token_id"] = meta_int(path, md, f"tokenizer.ggml.{gkey}_token_id", None, 0, hi)
    if (scaling := md.get(f"{arch}.rope.scaling.type")) not in (None, "none"):
        if scaling != "linear":
            # other kinds need low/high frequency factors that GGUF metadata has no keys for (llama.cpp
            # bakes them into a rope_freqs tensor, which transformers drops); yarn is not implemented
            raise WeightError(
                f"{path}: GGUF metadata {arch}.rope.scaling.type = {scaling!r} is not supported "
                "(expected 'none' or 'linear' with rope.scaling.factor)"
            )
        m.took(f"{arch}.rope.scaling.type", "rope_scaling")
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": real("rope.scaling.factor", 1.0)}
        if (orig := num("rope.scaling.original_context_length", None)) is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = orig
    mapping.config(m, cfg, held)
    check_expert_tensors(gf, arch)
    return cfg


# llama.cpp's expert tensors, whatever the family: the stacks blk.N.ffn_*_exps (numpy
# [E, rows, cols], ggml ne [cols, rows, E]; a bias [E, rows]) and the router blk.N.ffn_gate_inp
# ([E, hidden]; a bias [E]): each holds one slice per expert along its first numpy dim
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(?:\w+_exps|gate_inp)\.(?:weight|bias)$")


def check_expert_tensors(gf: GGUFFile, arch) -> None:
    """Every expert tensor's first dim is `{arch}.expert_count`: a WeightError naming the
    tensor, its shape and the key otherwise (or naming the key a file with experts lacks)."""
    experts = [t for t in gf.tensors if _EXPERT_TENSOR.match(t.name)]
    if not experts:
        return
    key = f"{arch}.expert_count"
    n = meta_int(gf.path, gf.metadata, key, None)
    if n is None:
        raise WeightError(f"{gf.path}: tensor {experts[0].name!r} holds experts but the GGUF metadata "
                          f"lacks {key} (expected the number of experts)")
    for t in experts:
        if not t.shape or t.shape[0] != n:
            raise WeightError(f"{gf.path}: tensor {t.name!r} of shape {list(t.shape)} holds "
                              f"{t.shape[0] if t.shape else 0} experts, but GGUF metadata {key} = {n}; "
                              f"expected its first dim to be {n}")


def _packed(gf: GGUFFile, info: TensorInfo, blob: np.ndarray) -> PackedTensor | None:
    """A matrix, or a stack of them (routed experts' [E, rows, cols]), in a packed scheme as
    its bytes (a view of the mapped file, [rows of all, bytes per row]), or None."""
    start = gf.data_start + info.offset
    rlx = gf.metadata.get(SCHEME_KEY + info.name)
    if rlx is not None:             # RLX's own int blocks, stored as i8 bytes (gguf_write)
        try:
            name, _, dims = rlx.partition(":")
            shape = tuple(int(d) for d in dims.split("x"))
        except (AttributeError, ValueError):
            raise WeightError(f"{gf.path}: metadata {SCHEME_KEY + info.name} = {rlx!r}; expected "
                              "'<scheme>:<rows>x<cols>' or '<scheme>:<E>x<rows>x<cols>'") from None
        scheme = QuantScheme.parse(name)
    else:
        try:
            scheme = QuantScheme.from_gguf_type(info.ggml_type, info.name)
        except WeightError:
            return None             # f32/f16/bf16 and types without a kernel: loaded as floats
        shape = info.shape
    if len(shape) not in (2, 3) or shape[-1] % scheme.block_size or 0 in shape:
        return None
    rows, per_row = scheme.packed_shape(shape, info.name)
    if info.nbytes != rows * per_row or start + info.nbytes > blob.size:
        raise WeightError(f"{gf.path}: tensor {info.name!r} holds {info.nbytes} bytes; {scheme.name} "
                          f"of shape {list(shape)} needs {rows * per_row}")
    return PackedTensor(blob[start:start + info.nbytes].reshape(rows, per_row), scheme, shape, info.name)


def load_gguf(path: str, progress: bool = False, packed: bool = False
              ) -> tuple[dict, dict[str, np.ndarray], GGUFFile]:
    """`(config, tensors, header)` of a GGUF file: every tensor dequantized to float32, or with
    `packed` the quantized matmul weights (and expert stacks) as PackedTensors over the
    memory-mapped file."""
    from .gguf_arch import gguf_architecture

    gf = read_gguf(path)
    config = gguf_config(gf)
    mapping = gguf_architecture(path, gf.metadata["general.architecture"])
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    items = gf.tensors
    if progress:
        from rlx_core.progress import tqdm_class

        items = tqdm_class()(items, desc=f"loading {os.path.basename(path)}", unit="tensor")
    tensors = {}
    for info in items:
        name = mapping.hf_name(info.name)
        if name is None:
            continue
        p = _packed(gf, info, blob)
        if p is None:
            tensors[name] = mapping.from_gguf(info.name, dequantize_tensor(gf, info, blob), config, path)
        elif packed:
            raw = mapping.from_gguf(info.name, p.raw, config, path)    # a row permutation at most
            if raw is not p.raw:                  # a copy: the file's pages of it are not read again
                release_file_pages(p.raw)
                p = PackedTensor(np.ascontiguousarray(raw), p.scheme, p.shape, p.name)
            tensors[name] = p
        else:
            tensors[name] = mapping.from_gguf(info.name, p.dequantize(), config, path)
    del blob
    return config, tensors, gf
