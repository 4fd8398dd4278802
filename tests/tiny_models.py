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


def tiny_llama_folder(path, seed: int = 2) -> str:
    """An HF folder (config.json, model.safetensors, tokenizer.json) of the tiny LLaMA with
    random weights from `seed` and the word tokenizer: what `rlx serve` and `rlx_core.load` take."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    save_file(llama_tensors(LLAMA, np.random.default_rng(seed)), str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(word_tokenizer(False).backend.to_str(), encoding="utf-8")
    return str(path)
