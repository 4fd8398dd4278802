"""Tiny random models for runtime tests (no torch needed): a LLaMA CausalLM and a BERT
Encoder built from random tensors through the registered recipes (their `tiny_config` and
`tiny_tensors`), with small tokenizers."""
from __future__ import annotations


def _recipe(model_type: str):
    from rlx_core.runtime.model import find_recipe

    return find_recipe(model_type)


# the recipes' tiny configs and random tensors (what the conformance kit builds, too)
LLAMA = _recipe("llama").tiny_config()
BERT = _recipe("bert").tiny_config()
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(45)]


def llama_tensors(cfg: dict, rng) -> dict:
    return _recipe("llama").tiny_tensors(cfg, rng)


def bert_tensors(cfg: dict, rng) -> dict:
    return _recipe("bert").tiny_tensors(cfg, rng)


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


def _folder(path, cfg: dict, tensors: dict, tokenizer) -> str:
    """An HF folder (config.json, model.safetensors, tokenizer.json) of `cfg` and `tensors`:
    what `rlx serve` and `rlx_core.load` take."""
    import json

    from safetensors.numpy import save_file

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
    return str(path)


def tiny_llama_folder(path, seed: int = 2) -> str:
    """The tiny LLaMA with random weights from `seed` and the word tokenizer, as a folder."""
    import numpy as np

    return _folder(path, LLAMA, llama_tensors(LLAMA, np.random.default_rng(seed)), word_tokenizer(False))


def tiny_bert_folder(path, seed: int = 2, **config) -> str:
    """The tiny BERT (`config` overriding keys) with random weights from `seed` and the word
    tokenizer, as a folder."""
    import numpy as np

    cfg = dict(BERT, **config)
    return _folder(path, cfg, bert_tensors(cfg, np.random.default_rng(seed)), word_tokenizer(True))


# A tiny LLaMA whose matrices are packed in five GGUF schemes (K-quants need K a multiple of
# 256). Row-parallel o_proj (K 256) and down_proj (K 1024) cover every scheme on whole
# blocks at tp 2 and 4, except layer 2's q6_k o_proj: 128 or 64 of K per rank are not whole
# blocks of 256, so it runs replicated.
PACKED_LLAMA = dict(LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                    tie_word_embeddings=False)
PACKED_SCHEMES = {
    "embed_tokens": "q4_1", "lm_head": "q6_k",
    **{f"layers.{layer}.{part}": s for layer, row in enumerate([
        ("q8_0", "q4_1", "q4_k", "q4_0", "q6_k", "q4_0", "q4_k"),
        ("q4_k", "q6_k", "q8_0", "q4_1", "q4_0", "q4_1", "q6_k"),
        ("q4_0", "q4_k", "q4_1", "q6_k", "q8_0", "q6_k", "q8_0")])
       for part, s in zip(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                          row)},
}


def packed_llama_tensors(cfg: dict) -> dict:
    """The recipe's random tensors for `cfg` (seed cfg["_seed"]) with each weight that
    PACKED_SCHEMES names packed (QuantScheme.quantize): a TensorParallel spec's make_tensors."""
    import numpy as np

    from rlx_core.ir.quant import PackedTensor, QuantScheme

    out = {}
    for name, w in llama_tensors(cfg, np.random.default_rng(cfg["_seed"])).items():
        key = name.removeprefix("model.").rsplit(".", 1)[0].replace(".self_attn", "").replace(".mlp", "")
        scheme = PACKED_SCHEMES.get(key)
        if scheme is not None:
            q = QuantScheme.parse(scheme)
            w = PackedTensor(q.quantize(w, name), q, w.shape, name)
        out[name] = w
    return out
