"""Writing a checkpoint as a GGUF file with packed weights (`rlx quantize`).

The inverse of `gguf_io`'s loading: HF names become llama.cpp's, llama's Q/K rows get the
converter's rope permutation, gemma's norms get the `+1` llama.cpp stores, the config becomes
GGUF metadata, and every matmul weight whose rows split into whole blocks is quantized with
the scheme (the rest stays f32, as llama.cpp's own quantizer keeps norms). The HF tokenizer
travels as `tokenizer.huggingface.json`, plus llama.cpp's BPE fields for byte-level BPE
vocabularies, so both RLX and llama.cpp read the file.

RLX's own int8/int4 blocks have no GGUF type: they are stored as GGUF I8 bytes
[rows, bytes per row] with the scheme under `rlx.scheme.<tensor>`, which RLX reads back and
llama.cpp does not.
"""
from __future__ import annotations

import json
import os

import gguf
import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.ir.quant import QuantScheme

from .checkpoint import Checkpoint
from .gguf_io import _LAYER_NAMES, _MODEL_TYPES, _TOP_NAMES, SCHEME_KEY
from .tokenizer import HF_TOKENIZER_KEY, RLX_TOKENIZER_KEY


def _gguf_names(arch: str) -> dict:
    """HF tensor name -> GGUF name, as a function of the layer index."""
    layer = {hf: g for g, hf in _LAYER_NAMES[arch].items()}
    top = {hf: g for g, hf in _TOP_NAMES.items()}
    return layer, top


def gguf_name(arch: str, hf: str) -> str:
    layer, top = _gguf_names(arch)
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        idx, _, leaf = stem[len("model.layers."):].partition(".")
        if leaf in layer:
            return f"blk.{idx}.{layer[leaf]}.{kind}"
    elif stem in top:
        return f"{top[stem]}.{kind}"
    raise WeightError(f"tensor {hf!r} has no GGUF name for architecture {arch!r}")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter rope permutation of Q/K rows (convert_hf_to_gguf.py `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w, arch: str, cfg: dict) -> None:
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
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default"):
        if kind != "linear":
            raise WeightError(f"config rope_scaling type {kind!r} cannot be written to GGUF (only linear)")
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    if arch.startswith("gemma"):
        if cfg.get("sliding_window") is not None:
            w.add_sliding_window(cfg["sliding_window"])
        w.add_float32(f"{arch}.attention.query_pre_attn_scalar",
                      float(get("query_pre_attn_scalar", default=head_dim)))
        types = cfg.get("layer_types")
        if types:
            w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in types])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(float(get("rope_local_base_freq", default=10000.0)))
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                w.add_float32(f"{arch}.{key}", float(cfg[key]))
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


def write_gguf(ckpt: Checkpoint, dst: str, scheme: QuantScheme | str, echo=print) -> dict:
    """Write `ckpt` (an HF folder's checkpoint) to `dst` with matmul weights in `scheme`.
    Returns {"quantized": n, "kept": [names kept in f32]}."""
    q = QuantScheme.parse(scheme)
    cfg = ckpt.config
    model_type = cfg.get("model_type")
    arch = next((a for a, (mt, _) in _MODEL_TYPES.items() if mt == model_type), None)
    if arch is None:
        raise WeightError(f"{ckpt.path}: model_type {model_type!r} cannot be written to GGUF; "
                          f"supported: {sorted(mt for mt, _ in _MODEL_TYPES.values())}")
    writer = gguf.GGUFWriter(os.fspath(dst), arch)
    writer.add_name(os.path.basename(os.path.normpath(ckpt.path)))
    writer.add_file_type(q.gguf_type if q.gguf_type is not None else 0)
    _metadata(writer, arch, cfg)
    if ckpt.tokenizer is not None:
        _tokenizer(writer, ckpt.tokenizer)
    kept, quantized = [], 0
    tied = cfg.get("tie_word_embeddings", False)
    for hf in sorted(ckpt.tensors):
        if tied and hf == "lm_head.weight":
            continue
        name = gguf_name(arch, hf)
        x = np.asarray(ckpt.tensors[hf], np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            x = _permute(x, cfg["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"])
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if x.ndim == 2 and x.shape[1] % q.block_size == 0:
            raw = q.quantize(x, name=hf)
            if q.gguf_type is not None:
                writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(q.gguf_type))
            else:
                writer.add_string(SCHEME_KEY + name, f"{q.name}:{x.shape[0]}x{x.shape[1]}")
                writer.add_tensor(name, raw.view(np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
            quantized += 1
        else:
            writer.add_tensor(name, x)
            if x.ndim == 2:
                kept.append(hf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if kept:
        echo(f"kept in f32 (rows do not split into {q.block_size}-element blocks): {', '.join(kept)}")
    return {"quantized": quantized, "kept": kept}


__all__ = ["write_gguf", "gguf_name", "SCHEME_KEY"]
