"""Recipes: BertFlow (HF `BertModel`, model_type "bert") and NomicBertFlow (model_type
"nomic_bert"): read the HF config.json, check it is a variant these blocks compute, and build
the encoder flow for any batch and sequence length, with the `encoder` profile preset."""
from __future__ import annotations

from typing import Callable

import numpy as np

from rlx_core.ir.errors import ModelError
from rlx_core.profile import CompileProfile
from rlx_core.weights.config import check_config, config_source

from .blocks import BertFlowBuilder, BertSpec, NomicSpec, ir_activation, pool_stage

PACKED_OPS = {"varlen_attention", "segment_pool"}     # the packed layout's per-text ops
# heads of BertFor*/NomicBertFor* checkpoints: the encoder does not use them
HEADS = ("cls.", "classifier.", "qa_outputs.", "lm_head.", "pooler.")


def _where(cfg: dict) -> str:
    name = cfg.get("_name_or_path") or ""
    return f"{name}: " if name else ""


def _need(cfg: dict, keys: list, family: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ModelError(f"{_where(cfg)}{family} config.json is missing {missing}")


def _int(cfg: dict, key: str, family: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelError(f"{_where(cfg)}{family} config.json: {key} must be a positive integer, got {v!r}")
    return v


def bert_config(cfg: dict) -> dict:
    """The facts of an HF BertConfig the flow needs; a ModelError names what is unsupported."""
    check_config(cfg, config_source(cfg), ModelError)
    _need(cfg, ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                "vocab_size"], "BERT")
    pet = cfg.get("position_embedding_type", "absolute") or "absolute"
    if pet != "absolute":
        raise ModelError(f"{_where(cfg)}BERT position_embedding_type {pet!r} is not supported "
                         "(only 'absolute')")
    for flag in ("is_decoder", "add_cross_attention"):
        if cfg.get(flag):
            raise ModelError(f"{_where(cfg)}BERT {flag}=true is not supported (encoders only)")
    c = {k: _int(cfg, k, "BERT") for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                           "intermediate_size", "vocab_size")}
    if c["hidden_size"] % c["num_attention_heads"]:
        raise ModelError(f"{_where(cfg)}BERT hidden_size {c['hidden_size']} is not a multiple of "
                         f"{c['num_attention_heads']} attention heads")
    type_vocab = cfg.get("type_vocab_size", 2)
    if isinstance(type_vocab, bool) or not isinstance(type_vocab, int) or type_vocab < 0:
        raise ModelError(f"{_where(cfg)}BERT type_vocab_size must be an integer >= 0, got {type_vocab!r}")
    return dict(
        hidden=c["hidden_size"], heads=c["num_attention_heads"], layers=c["num_hidden_layers"],
        intermediate=c["intermediate_size"], vocab=c["vocab_size"], type_vocab=type_vocab,
        max_positions=_int(dict(cfg, max_position_embeddings=cfg.get("max_position_embeddings", 512)),
                           "max_position_embeddings", "BERT"),
        eps=float(cfg.get("layer_norm_eps", 1e-12)),
        act=ir_activation(cfg.get("hidden_act", "gelu")))


# nomic activation_function -> (mlp kind, IR activation), as modeling_hf_nomic_bert picks them
NOMIC_MLP = {"swiglu": ("gated", "silu"), "geglu": ("gated", "gelu"), "glu": ("gated", "sigmoid"),
             "gelu": ("plain", "gelu"), "gelu_new": ("plain", "gelu_tanh"), "relu": ("plain", "relu")}


def nomic_config(cfg: dict) -> dict:
    """The facts of a nomic_bert config.json (GPT-2 style names: n_embd, n_head, ...)."""
    check_config(cfg, config_source(cfg), ModelError)
    _need(cfg, ["n_embd", "n_head", "n_layer", "vocab_size"], "NomicBERT")
    refuse = {"prenorm": "pre-norm blocks", "parallel_block": "parallel blocks", "causal": "causal attention",
              "use_rms_norm": "RMSNorm"}
    for key, what in refuse.items():
        if cfg.get(key):
            raise ModelError(f"{_where(cfg)}NomicBERT {key}=true ({what}) is not supported; "
                             "supported: the post-norm LayerNorm encoder of nomic-bert-2048")
    if cfg.get("moe_every_n_layers") or cfg.get("num_experts"):
        raise ModelError(f"{_where(cfg)}NomicBERT mixture-of-experts layers (moe_every_n_layers / "
                         "num_experts) are not supported")
    act = cfg.get("activation_function", "swiglu")
    if act not in NOMIC_MLP:
        raise ModelError(f"{_where(cfg)}NomicBERT activation_function {act!r} is not supported; "
                         f"supported: {sorted(NOMIC_MLP)}")
    hidden = _int(cfg, "n_embd", "NomicBERT")
    heads = _int(cfg, "n_head", "NomicBERT")
    if hidden % heads:
        raise ModelError(f"{_where(cfg)}NomicBERT n_embd {hidden} is not a multiple of n_head {heads}")
    frac = float(cfg.get("rotary_emb_fraction", 0.0) or 0.0)
    if not 0.0 <= frac <= 1.0:
        raise ModelError(f"{_where(cfg)}NomicBERT rotary_emb_fraction must be in [0, 1], got {frac}")
    head_dim = hidden // heads
    rot = int(frac * head_dim)
    if rot % 2:
        raise ModelError(f"{_where(cfg)}NomicBERT rotary dim {rot} (rotary_emb_fraction x head dim) is odd")
    if rot and cfg.get("rotary_emb_scale_base"):
        raise ModelError(f"{_where(cfg)}NomicBERT rotary_emb_scale_base (xPos) is not supported")
    n_pos = _int(dict(cfg, n_positions=cfg.get("n_positions", 2048)), "n_positions", "NomicBERT")
    max_len = n_pos
    if rot and cfg.get("rotary_scaling_factor"):
        # dynamic NTK scaling only changes the frequencies past max_trained_positions: within
        # it the model is exactly the unscaled one, so inputs are capped there
        max_len = min(n_pos, int(cfg.get("max_trained_positions") or 2048))    # null reads as absent
    mlp, ir_act = NOMIC_MLP[act]
    inter = cfg.get("n_inner") or 4 * hidden
    type_vocab = cfg.get("type_vocab_size", 2)
    if isinstance(type_vocab, bool) or not isinstance(type_vocab, int) or type_vocab < 0:
        raise ModelError(f"{_where(cfg)}NomicBERT type_vocab_size must be an integer >= 0, "
                         f"got {type_vocab!r}")
    return dict(
        hidden=hidden, heads=heads, layers=_int(cfg, "n_layer", "NomicBERT"), intermediate=int(inter),
        vocab=_int(cfg, "vocab_size", "NomicBERT"), type_vocab=type_vocab, max_positions=max_len,
        rotary_dim=rot, rope_theta=float(cfg.get("rotary_emb_base", 10000.0)),
        rope_style="interleaved" if cfg.get("rotary_emb_interleaved") else "half",
        eps=float(cfg.get("layer_norm_epsilon", 1e-5)), mlp=mlp, act=ir_act,
        qkv_bias=bool(cfg.get("qkv_proj_bias", False)), fc1_bias=bool(cfg.get("mlp_fc1_bias", False)),
        fc2_bias=bool(cfg.get("mlp_fc2_bias", False)), absolute_positions=rot == 0)


def encoder_tensors(tensors, prefix: str = "bert.") -> dict:
    """Checkpoint tensors as the encoder flow names them: a `bert.` prefix (BertFor* /
    NomicBertForPreTraining checkpoints) stripped, task heads and the pooler dropped, old
    LayerNorm `gamma`/`beta` names mapped to `weight`/`bias`."""
    out = {}
    prefixed = any(k.startswith(prefix) for k in tensors) and not any(
        k.startswith(("embeddings.", "encoder.")) for k in tensors)
    for k, v in tensors.items():
        if prefixed:
            if not k.startswith(prefix):
                if k.startswith(HEADS):
                    continue
            else:
                k = k[len(prefix):]
        if k.startswith(HEADS) or k == "embeddings.position_ids":
            continue
        if "LayerNorm." in k and k.endswith((".gamma", ".beta")):
            k = k[: k.rfind(".")] + (".weight" if k.endswith(".gamma") else ".bias")
        out[k] = v
    return out


def _layout(layout: str) -> str:
    if layout not in ("padded", "packed"):
        raise ModelError(f"layout must be 'padded' or 'packed', got {layout!r}")
    return layout


class _Hooks:
    """The recipe hooks of Llama32Flow, for encoders: `.layer(fn)`, `before_layers`,
    `after_layers`, `patch_flow`, `taps`, `profile_near`."""
    family = "bert"

    def _init_hooks(self):
        self._layer: Callable | None = None
        self._before: list = []
        self._after: list = []
        self._patches: list = []
        self._taps = False
        self._profile = CompileProfile.preset("encoder")

    def layer(self, fn: Callable):
        """Override each layer: `fn(i, default_stage)` returns a stage or flow (or None: default)."""
        self._layer = fn
        return self

    def before_layers(self, fn: Callable):
        self._before.append(fn)
        return self

    def after_layers(self, fn: Callable):
        self._after.append(fn)
        return self

    def patch_flow(self, fn: Callable):
        self._patches.append(fn)
        return self

    def taps(self, on: bool = True):
        """Expose every layer's output as `layer.<i>`."""
        self._taps = on
        return self

    def profile(self, p):
        self._profile = CompileProfile.preset(p) if isinstance(p, str) else p
        return self

    def profile_near(self, path):
        from rlx_core.runtime.model import resolve_profile

        self._profile = resolve_profile(None, self._profile.name, str(path))
        return self

    def _layer_fn(self, default: Callable):
        if self._layer is None:
            return None
        return lambda i: self._layer(i, default(i))

    def _inputs(self, f: BertFlowBuilder, token_types: bool) -> None:
        if self.layout == "packed":
            f.packed_inputs(token_types=token_types)
        else:
            f.encoder_inputs(self.batch, self.seq, token_types=token_types)

    def _head(self, f: BertFlowBuilder) -> BertFlowBuilder:
        for fn in self._after:
            f = fn(f) or f
        f.output("last_hidden_state")
        f.pool(self.pooling).output("pooled").l2_normalize().output("embedding")
        for fn in self._patches:
            f = fn(f) or f
        return f

    def build(self, weights, **kw):
        """The BuiltModel (graph + params) for `weights` (checkpoint names, see encoder_tensors)."""
        return self.flow().build(weights, self.cfg, **kw)


class BertFlow(_Hooks):
    """Recipe flow for HF BertModel: word + position + token-type embeddings, LayerNorm,
    N BERT layers; outputs `last_hidden_state` [B,S,H], `pooled` [B,H] and `embedding`
    (pooled, L2-normalized). Symbolic `batch` and `seq`: one graph serves every shape."""
    family = "bert"

    def __init__(self, cfg: dict, batch="batch", seq="seq", pooling: str = "mean", fused_qkv: bool = True,
                 layout: str = "padded"):
        self.layout = _layout(layout)
        self.cfg = dict(cfg)
        self.c = bert_config(self.cfg)
        pool_stage(pooling)                        # checks the name
        self.batch, self.seq, self.pooling, self.fused_qkv = batch, seq, pooling, fused_qkv
        self.name = f"{cfg.get('model_type', self.family)}_encoder"
        self._init_hooks()

    def spec(self) -> BertSpec:
        c = self.c
        return BertSpec(hidden=c["hidden"], heads=c["heads"], intermediate=c["intermediate"], eps=c["eps"],
                        act=c["act"], fused_qkv=self.fused_qkv)

    def flow(self) -> BertFlowBuilder:
        c = self.c
        f = BertFlowBuilder(self.name, "encoder.layer")
        f.profile(self._profile)
        self._inputs(f, c["type_vocab"] > 0)
        f.embed("embeddings.word_embeddings.weight", c["vocab"], c["hidden"])
        f.gather_add("positions", "embeddings.position_embeddings.weight", c["max_positions"])
        if c["type_vocab"] > 0:
            f.gather_add("token_type_ids", "embeddings.token_type_embeddings.weight", c["type_vocab"])
        f.layer_norm("embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias", c["eps"])
        for fn in self._before:
            f = fn(f) or f
        spec = self.spec()
        from .blocks import BertEncoderLayer

        f.repeat_bert_layers(c["layers"], spec, layer=self._layer_fn(lambda i: BertEncoderLayer(spec)),
                             taps=self._taps)
        return self._head(f)


class NomicBertFlow(_Hooks):
    """Recipe flow for nomic_bert (nomic-bert-2048, nomic-embed-text-v1/v1.5): word (+
    token-type) embeddings, emb_ln, N rotary SwiGLU post-norm layers, the same outputs as
    BertFlow."""
    family = "nomic_bert"

    def __init__(self, cfg: dict, batch="batch", seq="seq", pooling: str = "mean",
                 layout: str = "padded"):
        self.layout = _layout(layout)
        self.cfg = dict(cfg)
        self.c = nomic_config(self.cfg)
        pool_stage(pooling)
        self.batch, self.seq, self.pooling = batch, seq, pooling
        self.name = f"{cfg.get('model_type', self.family)}_encoder"
        self._init_hooks()

    def spec(self) -> NomicSpec:
        c = self.c
        return NomicSpec(hidden=c["hidden"], heads=c["heads"], intermediate=c["intermediate"], eps=c["eps"],
                         rotary_dim=c["rotary_dim"], rope_theta=c["rope_theta"], rope_style=c["rope_style"],
                         max_positions=c["max_positions"], mlp=c["mlp"], act=c["act"],
                         qkv_bias=c["qkv_bias"], fc1_bias=c["fc1_bias"], fc2_bias=c["fc2_bias"])

    def flow(self) -> BertFlowBuilder:
        c = self.c
        f = BertFlowBuilder(self.name, "encoder.layers")
        f.profile(self._profile)
        self._inputs(f, c["type_vocab"] > 0)
        f.embed("embeddings.word_embeddings.weight", c["vocab"], c["hidden"])
        if c["absolute_positions"]:
            f.gather_add("positions", "embeddings.position_embeddings.weight", c["max_positions"])
        if c["type_vocab"] > 0:
            f.gather_add("token_type_ids", "embeddings.token_type_embeddings.weight", c["type_vocab"])
        f.layer_norm("emb_ln.weight", "emb_ln.bias", c["eps"])
        for fn in self._before:
            f = fn(f) or f
        spec = self.spec()
        from .blocks import NomicEncoderLayer

        f.repeat_nomic_layers(c["layers"], spec, layer=self._layer_fn(lambda i: NomicEncoderLayer(spec)),
                              taps=self._taps)
        return self._head(f)


class BertRecipe:
    """Registered recipe: a BERT checkpoint -> rlx_core.runtime.encoder.Encoder."""
    name = "bert"
    model_types = ("bert",)
    flow_class = BertFlow
    default_profile = "encoder"
    ignore_unused = ()

    def config(self, cfg: dict) -> dict:
        return self.flow_class(cfg).c

    def max_positions(self, cfg: dict) -> int:
        return int(self.config(cfg)["max_positions"])

    def embedding_dim(self, cfg: dict) -> int:
        return int(self.config(cfg)["hidden"])

    def flow(self, cfg: dict, pooling: str = "mean", taps: bool = False, backend=None,
             layout: str | None = None, **kw):
        """The encoder flow. layout: "padded" ([batch, seq] + key mask) or "packed" (texts
        concatenated into one row of tokens, no padding; attention and pooling per text by
        the table's varlen_attention and segment_pool). Both run on any backend; None picks
        packed where `backend` has kernels for those two ops (a backend that legalizes them
        would attend over all tokens of a batch with a mask: padded is cheaper there)."""
        if layout is None:
            native = backend is not None and not isinstance(backend, str) and \
                PACKED_OPS <= backend.supported_ops()
            layout = "packed" if native else "padded"
        return self.flow_class(cfg, pooling=pooling, layout=layout, **kw).taps(taps).flow()

    def tensors(self, tensors) -> dict:
        return encoder_tensors(tensors)

    def build(self, ckpt, backend=None, profile=None, **kw):
        from rlx_core.runtime.encoder import Encoder, sentence_transformers_config

        cfg = dict(ckpt.config)
        self.config(cfg)                           # an unsupported variant fails here, by name
        st = sentence_transformers_config(ckpt.path)
        return Encoder(self, cfg, self.tensors(ckpt.tensors), ckpt.tokenizer, backend, profile,
                       source=ckpt.path, st=st, **kw)


    # -- the conformance kit's tiny model (rlx_core.testing.recipes)
    def tiny_config(self) -> dict:
        """A small BERT: 3 heads, token types, GELU."""
        return dict(model_type="bert", vocab_size=50, hidden_size=24, num_attention_heads=3,
                    num_hidden_layers=2, intermediate_size=40, max_position_embeddings=32, type_vocab_size=2,
                    layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random HF-named tensors for `cfg` (LayerNorm weights around 1)."""
        c = bert_config(cfg)
        h, inter = c["hidden"], c["intermediate"]
        shapes = {"embeddings.word_embeddings.weight": (c["vocab"], h),
                  "embeddings.position_embeddings.weight": (c["max_positions"], h),
                  "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
        if c["type_vocab"]:
            shapes["embeddings.token_type_embeddings.weight"] = (c["type_vocab"], h)
        for i in range(c["layers"]):
            p = f"encoder.layer.{i}."
            for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                      "attention.output.dense"):
                shapes[p + n + ".weight"], shapes[p + n + ".bias"] = (h, h), (h,)
            shapes[p + "intermediate.dense.weight"] = (inter, h)
            shapes[p + "intermediate.dense.bias"] = (inter,)
            shapes[p + "output.dense.weight"], shapes[p + "output.dense.bias"] = (h, inter), (h,)
            for n in ("attention.output.LayerNorm", "output.LayerNorm"):
                shapes[p + n + ".weight"], shapes[p + n + ".bias"] = (h,), (h,)
        return random_tensors(shapes, rng)


def random_tensors(shapes: dict, rng) -> dict:
    """float32 N(0, 0.2^2) tensors of `shapes`; norm weights 1 + that (no norm is the identity)."""
    def norm(k):
        return k.endswith(".weight") and any(x in k for x in ("LayerNorm", "emb_ln", "norm1", "norm2"))

    return {k: (0.2 * rng.standard_normal(s) + (1.0 if norm(k) else 0.0)).astype(np.float32)
            for k, s in shapes.items()}


class NomicBertRecipe(BertRecipe):
    name = "nomic_bert"
    model_types = ("nomic_bert",)
    flow_class = NomicBertFlow

    def tiny_config(self) -> dict:
        """nomic-bert-2048's shape, small: rotary SwiGLU layers, post-norm, no biases."""
        return dict(model_type="nomic_bert", architectures=["NomicBertModel"], vocab_size=61, n_embd=48,
                    n_head=4, n_layer=2, n_inner=80, n_positions=128, type_vocab_size=2,
                    layer_norm_epsilon=1e-12, activation_function="swiglu", rotary_emb_base=1000,
                    rotary_emb_fraction=1.0, rotary_emb_interleaved=False, qkv_proj_bias=False,
                    mlp_fc1_bias=False, mlp_fc2_bias=False, prenorm=False, causal=False, use_rms_norm=False,
                    rotary_scaling_factor=None, max_trained_positions=2048, pad_vocab_size_multiple=1)

    def tiny_tensors(self, cfg: dict, rng) -> dict:
        """Random tensors for `cfg` under nomic's names (LayerNorm weights around 1)."""
        c = nomic_config(cfg)
        h, inter = c["hidden"], c["intermediate"]
        shapes = {"embeddings.word_embeddings.weight": (c["vocab"], h), "emb_ln.weight": (h,),
                  "emb_ln.bias": (h,)}
        if c["type_vocab"]:
            shapes["embeddings.token_type_embeddings.weight"] = (c["type_vocab"], h)
        if c["absolute_positions"]:
            shapes["embeddings.position_embeddings.weight"] = (c["max_positions"], h)
        for i in range(c["layers"]):
            p = f"encoder.layers.{i}."
            shapes[p + "attn.Wqkv.weight"], shapes[p + "attn.out_proj.weight"] = (3 * h, h), (h, h)
            if c["qkv_bias"]:
                shapes[p + "attn.Wqkv.bias"], shapes[p + "attn.out_proj.bias"] = (3 * h,), (h,)
            for fc in (("fc11", "fc12") if c["mlp"] == "gated" else ("fc1",)):
                shapes[p + f"mlp.{fc}.weight"] = (inter, h)
                if c["fc1_bias"]:
                    shapes[p + f"mlp.{fc}.bias"] = (inter,)
            shapes[p + "mlp.fc2.weight"] = (h, inter)
            if c["fc2_bias"]:
                shapes[p + "mlp.fc2.bias"] = (h,)
            for n in ("norm1", "norm2"):
                shapes[p + f"{n}.weight"], shapes[p + f"{n}.bias"] = (h,), (h,)
        return random_tensors(shapes, rng)


__all__ = ["BertFlow", "NomicBertFlow", "BertRecipe", "NomicBertRecipe", "bert_config", "nomic_config",
           "encoder_tensors", "random_tensors", "NOMIC_MLP", "HEADS", "PACKED_OPS"]
