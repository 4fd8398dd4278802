"""Reading GGUF files: metadata -> HF-style config, tensors -> float32 arrays under HF names.

The header is parsed here because `gguf.GGUFReader` builds a numpy view per array element and takes
~15 s on a 262k-token vocabulary; `gguf.quants.dequantize` still does all the unpacking. What the
tensors look like after loading follows transformers' GGUF loader exactly (see
`transformers/modeling_gguf_pytorch_utils.py`): llama's Q/K rows are un-permuted, gemma's norms
lose the `+1` llama.cpp baked in.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from typing import Any, NamedTuple

import numpy as np

from rlx_core.ir.errors import WeightError

GGUF_MAGIC = b"GGUF"

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

# GGUF architecture -> HF model_type / class
_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions fastest-first, i.e. reversed)
    ggml_type: int
    offset: int  # from the start of the data section


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
    except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as e:
        raise WeightError(f"{path}: GGUF header is truncated or corrupt ({e})") from e


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
            return [value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype} at offset {pos}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        metadata[key] = value(vtype)

    tensors = []
    for _ in range(n_tensors):
        name = string()
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        tensors.append(TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))

    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    return GGUFFile(path, metadata, tensors, data_start)


# ---------------------------------------------------------------------------------------------- tensors


def _nbytes(info: TensorInfo, path: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    except (ValueError, KeyError):
        raise WeightError(f"{path}: tensor {info.name!r} has unknown ggml type {info.ggml_type}") from None
    count = int(np.prod(info.shape, dtype=np.int64))
    if info.shape and info.shape[-1] % block:
        raise WeightError(
            f"{path}: tensor {info.name!r} row length {info.shape[-1]} is not a multiple of "
            f"its block size {block}"
        )
    return count // block * type_size


def dequantize_tensor(gf: GGUFFile, info: TensorInfo, blob: np.ndarray) -> np.ndarray:
    """One tensor as a float32 array of shape `info.shape` (numpy order, e.g. [out, in] for a matmul)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    start = gf.data_start + info.offset
    nbytes = _nbytes(info, gf.path)
    if start + nbytes > blob.size:
        raise WeightError(
            f"{gf.path}: tensor {info.name!r} needs bytes [{start}, {start + nbytes}) but the file has "
            f"{blob.size}; the file is truncated"
        )
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    raw = blob[start : start + nbytes].reshape(rows, -1)
    qtype = GGMLQuantizationType(info.ggml_type)
    try:
        out = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)
    except NotImplementedError:
        raise WeightError(
            f"{gf.path}: tensor {info.name!r} uses ggml type {qtype.name}, which cannot be dequantized"
        ) from None
    return out.copy() if qtype == GGMLQuantizationType.F32 else out  # F32 is a view of the mapped file


# ---------------------------------------------------------------------------------------------- names

_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_LAYER_NAMES = {
    "llama": {**_COMMON, "ffn_norm": "post_attention_layernorm"},
    "qwen3": {**_COMMON, "ffn_norm": "post_attention_layernorm"},
    # gemma has four norms per block: around attention and around the MLP
    "gemma2": {
        **_COMMON,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_NAMES["gemma3"] = _LAYER_NAMES["gemma2"]
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DROPPED = {"rope_freqs.weight"}  # llama3 rope factors; transformers rebuilds them from the config
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The transformers parameter name for a GGUF tensor name; None for one transformers drops."""
    if gguf_name in _DROPPED:
        return None
    if m := _BLOCK.match(gguf_name):
        layer, leaf, kind = m.groups()
        if leaf in _LAYER_NAMES[arch]:
            return f"model.layers.{layer}.{_LAYER_NAMES[arch][leaf]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _TOP_NAMES:
            return f"{_TOP_NAMES[stem]}.{kind}"
    return gguf_name  # unknown: kept under its GGUF name so a model builder can report it


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope row permutation (`permute` in convert_hf_to_gguf.py), as transformers does."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def fix_tensor(arch: str, gguf_name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """Undo what llama.cpp's converter did to a tensor's values, so it equals the HF original."""
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads = config["num_attention_heads"] if ".attn_q." in gguf_name else config["num_key_value_heads"]
        return _unpermute(w, heads)
    if arch.startswith("gemma") and "norm.weight" in gguf_name:
        return w - np.float32(1.0)  # llama.cpp stores gemma's (1 + w) RMSNorm scale
    return w


# ---------------------------------------------------------------------------------------------- config


def gguf_config(gf: GGUFFile) -> dict:
    """An HF-style config.json dict synthesized from GGUF metadata."""
    md = gf.metadata
    arch = md.get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise WeightError(
            f"{gf.path}: GGUF architecture {arch!r} is not supported (expected one of {sorted(_MODEL_TYPES)})"
        )

    def key(name, default=None):
        return md.get(f"{arch}.{name}", default)

    required = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
    missing = [f"{arch}.{k}" for k in required if key(k) is None]
    if missing:
        raise WeightError(f"{gf.path}: GGUF metadata lacks {', '.join(missing)}")
    model_type, hf_class = _MODEL_TYPES[arch]
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    # llama files state the head size only as the rotary width, which is the whole head there
    head_dim = int(
        key("attention.key_length") or (arch == "llama" and key("rope.dimension_count")) or hidden // heads
    )
    names = {t.name for t in gf.tensors}
    vocab = key("vocab_size", len(md.get("tokenizer.ggml.tokens", ())) or None)
    cfg = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(vocab) if vocab is not None else None,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }
    if arch.startswith("gemma"):
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        cfg["hidden_act"] = "silu"
    if (scaling := key("rope.scaling.type")) not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(key("rope.scaling.factor", 1.0))}
        if (orig := key("rope.scaling.original_context_length")) is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    if arch.startswith("gemma"):
        pattern = key("attention.sliding_window_pattern", 6 if arch == "gemma3" else 2)
        if isinstance(pattern, list):  # newer files: one flag per layer, true where attention slides
            sliding = [bool(p) for p in pattern]
            pattern = sliding.index(False) + 1 if False in sliding else len(sliding) + 1
        else:  # every `pattern`-th layer is global, as in transformers' configs
            sliding = [bool((i + 1) % int(pattern)) for i in range(cfg["num_hidden_layers"])]
        cfg |= {
            "sliding_window": key("attention.sliding_window"),
            "query_pre_attn_scalar": key("attention.query_pre_attn_scalar", head_dim),
            "sliding_window_pattern": int(pattern),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        }
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = key("attn_logit_softcapping")
        cfg["final_logit_softcapping"] = key("final_logit_softcapping")
    return cfg


def load_gguf(path: str, progress: bool = False) -> tuple[dict, dict[str, np.ndarray], GGUFFile]:
    """`(config, tensors, header)` of a GGUF file, every tensor dequantized to float32."""
    gf = read_gguf(path)
    config = gguf_config(gf)
    arch = gf.metadata["general.architecture"]
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    end = max((gf.data_start + t.offset + _nbytes(t, path) for t in gf.tensors), default=0)
    if end > blob.size:  # fail before spending time on the tensors that are there
        raise WeightError(
            f"{path}: tensor data ends at byte {end} but the file has {blob.size}; the file is truncated"
        )
    items = gf.tensors
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc=f"loading {os.path.basename(path)}", unit="tensor")
    tensors = {}
    for info in items:
        name = hf_name(arch, info.name)
        if name is not None:
            tensors[name] = fix_tensor(arch, info.name, dequantize_tensor(gf, info, blob), config)
    del blob
    return config, tensors, gf
