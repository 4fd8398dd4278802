"""Tiny random models for runtime tests (no torch needed): a LLaMA CausalLM and a BERT
Encoder built from random tensors through the registered recipes, with small tokenizers."""
from __future__ import annotations

import numpy as np

LLAMA = dict(model_type="llama", vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
BERT = dict(model_type="bert", vocab_size=50, hidden_size=24, num_attention_heads=3, num_hidden_layers=2,
            intermediate_size=40, max_position_embeddings=32, type_vocab_size=2, layer_norm_eps=1e-12,
            hidden_act="gelu", pad_token_id=0)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(45)]


def _r(rng, *shape):
    return (0.2 * rng.standard_normal(shape)).astype(np.float32)


def llama_tensors(cfg: dict, rng) -> dict:
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    d = h // cfg["num_attention_heads"]
    t = {"model.embed_tokens.weight": _r(rng, cfg["vocab_size"], h), "model.norm.weight": 1 + _r(rng, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (h, h),
                  "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h), "self_attn.o_proj": (h, h),
                  "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
        for n, s in shapes.items():
            t[f"{p}{n}.weight"] = _r(rng, *s) + (1 if "norm" in n else 0)
    return t


def bert_tensors(cfg: dict, rng) -> dict:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    t = {"embeddings.word_embeddings.weight": _r(rng, cfg["vocab_size"], h),
         "embeddings.position_embeddings.weight": _r(rng, cfg["max_position_embeddings"], h),
         "embeddings.token_type_embeddings.weight": _r(rng, cfg["type_vocab_size"], h),
         "embeddings.LayerNorm.weight": 1 + _r(rng, h), "embeddings.LayerNorm.bias": _r(rng, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense"):
            t[p + n + ".weight"], t[p + n + ".bias"] = _r(rng, h, h), _r(rng, h)
        t[p + "intermediate.dense.weight"] = _r(rng, inter, h)
        t[p + "intermediate.dense.bias"] = _r(rng, inter)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = _r(rng, h, inter), _r(rng, h)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = 1 + _r(rng, h), _r(rng, h)
    return t


def word_tokenizer(bert: bool):
    """A WordLevel tokenizer over WORDS (BERT: [CLS] ... [SEP] around each text)."""
    from tokenizers import Tokenizer as Tk
    from tokenizers import models, pre_tokenizers, processors

    from rlx_core.weights.tokenizer import Tokenizer

    vocab = {w: i for i, w in enumerate(WORDS)}
    tk = Tk(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[
            ("[CLS]", 2), ("[SEP]", 3)])
    return Tokenizer(tk, name="words", eos_token_ids=() if bert else (2,))


def tiny_llama(rng, backend: str = "numpy"):
    from rlx_core.runtime.model import CausalLM

    return CausalLM.from_tensors(LLAMA, llama_tensors(LLAMA, rng), tokenizer=word_tokenizer(False),
                                 backend=backend)


def tiny_bert(rng, backend: str = "numpy"):
    from rlx_core.runtime.encoder import Encoder

    return Encoder.from_tensors(BERT, bert_tensors(BERT, rng), tokenizer=word_tokenizer(True),
                                backend=backend)
