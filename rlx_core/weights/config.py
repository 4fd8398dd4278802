"""Type and range checks of the config.json keys model code reads, in one table.

Checked once where a config enters (the checkpoint loader, a recipe given a config dict), so a
wrong value fails naming the file and key instead of as a ValueError deep in model building.
"""

from __future__ import annotations

import math
import re

from rlx_core.ir.errors import ModelError, RlxError, WeightError

# transformers' ACT2FN names -> the IR activation (rlx_core.ir.ops.ACTIVATIONS) computing the
# same function; a name not here (relu6, mish, ...) has no IR activation and is refused
HF_ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu",                                  # erf GELU
    **dict.fromkeys(("gelu_new", "gelu_fast", "gelu_accurate", "gelu_pytorch_tanh", "gelu_python_tanh"),
                    "gelu_tanh"),                                           # tanh approximation
    "silu": "silu", "swish": "silu", "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh",
    "linear": "identity", "quick_gelu": "quick_gelu",                     # x * sigmoid(1.702 x)
}
_ACTIVATION = (lambda v: isinstance(v, str) and v in HF_ACTIVATIONS, f"one of {sorted(HF_ACTIVATIONS)}")


def hf_activation(config: dict, *keys: str, default: str, error: type[RlxError] = ModelError) -> str:
    """The IR activation of the first of `keys` the config sets (`default`, an ACT2FN name,
    when none is), so a family computes the activation its config names or refuses it."""
    key = next((k for k in keys if config.get(k) is not None), None)
    name = config[key] if key else default
    if not _ACTIVATION[0](name):
        raise error(f"{config_source(config)}: {key or 'the default activation'} must be "
                    f"{_ACTIVATION[1]}, got {name!r}")
    return HF_ACTIVATIONS[name]


def _int(lo):
    want = "a positive integer" if lo == 1 else f"an integer >= {lo}"
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo, want


def _real(lo, strict):
    def ok(v):
        return (
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and (v > lo if strict else v >= lo)
        )

    return ok, f"a finite number {'>' if strict else '>='} {lo}"


def _is_id(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_POS_INT, _NONNEG_INT, _POS, _NONNEG = _int(1), _int(0), _real(0, True), _real(0, False)
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_STR = (lambda v: isinstance(v, str), "a string")
_DICT = (lambda v: isinstance(v, dict), "an object")
_STRS = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")
_ID = (_is_id, "a token id (an integer >= 0)")
_IDS = (
    lambda v: _is_id(v) or (isinstance(v, list) and all(_is_id(x) for x in v)),
    "a token id or a list of them (integers >= 0)",
)
_FRACTION = (lambda v: _NONNEG[0](v) and v <= 1, "a number in [0, 1]")

# key -> (check, what it expects, null allowed)
_SCHEMA = {
    "model_type": (*_STR, False),
    "architectures": (*_STRS, True),
    # null reads as absent: a recipe that needs the key says it is missing
    **{
        k: (*_POS_INT, True)
        for k in (
            "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
            "max_position_embeddings", "n_embd", "n_head", "n_layer", "n_positions",
            "max_trained_positions", "sliding_window_pattern", "num_key_value_heads", "head_dim", "n_inner",
        )
    },
    "type_vocab_size": (*_NONNEG_INT, False),
    "sliding_window": (*_NONNEG_INT, True),
    "max_window_layers": (*_NONNEG_INT, True),
    **{
        k: (*_POS, False)
        for k in ("layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "rotary_emb_base")
    },
    **{k: (*_POS, True) for k in ("rope_local_base_freq", "query_pre_attn_scalar", "rotary_scaling_factor",
                                  "rotary_emb_scale_base")},
    **{k: (*_NONNEG_INT, True) for k in ("moe_every_n_layers", "num_experts")},
    **{k: (*_NONNEG, True) for k in ("attn_logit_softcapping", "final_logit_softcapping")},
    "rotary_emb_fraction": (*_FRACTION, True),
    **{
        k: (*_BOOL, True)
        for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_bidirectional_attention",
                  "use_sliding_window", "is_decoder", "add_cross_attention", "qkv_proj_bias", "mlp_fc1_bias",
                  "mlp_fc2_bias", "rotary_emb_interleaved", "prenorm", "parallel_block", "causal",
                  "use_rms_norm", "guidance_embeds")
    },
    **{k: (*_ACTIVATION, True) for k in ("hidden_act", "hidden_activation")},
    **{k: (*_STR, True) for k in ("activation_function", "position_embedding_type")},
    "bos_token_id": (*_ID, True),
    "pad_token_id": (*_ID, True),
    "eos_token_id": (*_IDS, True),
    "layer_types": (*_STRS, True),
    **{k: (*_DICT, True) for k in ("rope_scaling", "rope_parameters", "text_config")},
}


def check_config(
    config, source: str = "config.json", error: type[RlxError] = WeightError, required: tuple = ()
) -> dict:
    """`config` itself once every key of the table it has holds a value of the expected type
    and range (a multimodal config's `text_config` too) and the `required` keys are set; else
    `error` naming source and key. A negative pad_token_id is read as null."""
    if not isinstance(config, dict):
        raise error(f"{source}: config is {type(config).__name__}, expected a JSON object")
    pad = config.get("pad_token_id")
    if type(pad) is int and pad < 0:
        config["pad_token_id"] = None      # older conversions write -1 for "no pad token"
    for key, (ok, want, nullable) in _SCHEMA.items():
        if key in config and not ((nullable and config[key] is None) or ok(config[key])):
            null = " or null" if nullable else ""
            raise error(f"{source}: {key} must be {want}{null}, got {config[key]!r}")
    missing = [k for k in required if config.get(k) is None]
    if missing:
        raise error(f"{source}: config is missing {missing}")
    vocab = config.get("vocab_size")
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        ids = config.get(key)
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        if vocab is not None and any(i >= vocab for i in ids):
            raise error(f"{source}: {key} must be below vocab_size {vocab}, got {config[key]!r}")
    if isinstance(config.get("text_config"), dict):
        check_config(config["text_config"], f"{source} (text_config)", error)
    return config


def config_source(config: dict) -> str:
    """How an error names a config dict handed over without its file."""
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    return f"{name} config" if isinstance(name, str) and name else "config"


# config keys that count repeated blocks (HF decoders and encoders, GPT-2 style, diffusers)
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_single_layers")
# "model.layers.12.mlp..." -> ("model.layers", "12"); an index of 10 digits or more is no block's
_INDEXED = re.compile(r"^(.*?)\.(\d{1,9})\.")


def layer_runs(names) -> dict:
    """prefix -> how many blocks 0, 1, 2, ... in a row have tensors named `prefix.<i>.*`."""
    seen: dict = {}
    for name in names:
        if m := _INDEXED.match(name):
            seen.setdefault(m[1], set()).add(int(m[2]))
    runs = {}
    for prefix, held in seen.items():
        n = 0
        while n in held:
            n += 1
        runs[prefix] = n
    return runs


def check_layer_count(source: str, key: str, count: int, names, error: type[RlxError] = WeightError,
                      blocks: bool = True) -> int:
    """How many blocks the tensors hold (blocks 0 .. n-1 of one prefix), refusing a `count`
    above it, so a count no file could back (10**9 layers) fails before anything is built for
    it. `blocks=False`: a file without any numbered block passes (a vocabulary-only file is
    read for its tokenizer; building a model from it checks again, with blocks required)."""
    prefix, held = max(layer_runs(names).items(), key=lambda kv: kv[1], default=("", 0))
    if count > held and (held or blocks):
        has = f"{held} ({prefix}.0 to {prefix}.{held - 1})" if held else "no numbered blocks"
        raise error(f"{source}: {key} = {count}, but the tensors hold {has}")
    return held


def check_layer_counts(config: dict, names, source: str = "config.json", blocks: bool = True) -> None:
    """`check_layer_count` for every layer count a config (and its text_config) states."""
    names = list(names)
    for cfg, where in ((config, source), (config.get("text_config"), f"{source} (text_config)")):
        for key in LAYER_KEYS if isinstance(cfg, dict) else ():
            if _POS_INT[0](cfg.get(key)):
                check_layer_count(where, key, cfg[key], names, blocks=blocks)
