"""What a mixture-of-experts config says about its experts, read once and checked.

The families differ only in data (`MoeFamily`): which key sizes an expert's MLP, the
router's order (softmax then top-k, or top-k then softmax) and whether `norm_topk_prob`
rescales the chosen weights, whether some layers keep a dense MLP (Qwen2/3-MoE's
`mlp_only_layers` / `decoder_sparse_step`), and whether a sigmoid-gated shared expert of
`shared_expert_intermediate_size` runs beside the routed ones (Qwen2-MoE). Every key read
here is honoured or refused with a ModelError naming it. Training-only keys are ignored on
purpose: `output_router_logits`, `router_aux_loss_coef`, `router_jitter_noise` (noise only
while training), `attention_dropout`.
"""
from __future__ import annotations

import attrs

from rlx_core.ir.errors import ModelError
from rlx_core.weights.config import config_source

TRAINING_ONLY = ("output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout")


@attrs.frozen
class MoeFamily:
    """A family's MoE conventions (HF config field names)."""
    inter_key: str                   # the key of one expert's intermediate size
    order: str                       # moe_route's order
    reads_norm_topk: bool            # `norm_topk_prob` (default false) renormalizes the top-k
    dense_layers: bool = False       # `mlp_only_layers` / `decoder_sparse_step` pick dense layers
    shared_expert: bool = False      # a gated shared expert (`shared_expert_intermediate_size`)


FAMILIES = {
    "qwen3_moe": MoeFamily("moe_intermediate_size", "softmax_topk", True, dense_layers=True),
    "qwen2_moe": MoeFamily("moe_intermediate_size", "softmax_topk", True, dense_layers=True,
                           shared_expert=True),
    "mixtral": MoeFamily("intermediate_size", "topk_softmax", False),
    "olmoe": MoeFamily("intermediate_size", "softmax_topk", True),
}


@attrs.frozen
class Routing:
    """One MoE layer's experts: E experts of intermediate size `inter`, k chosen per token;
    `shared`: the shared expert's intermediate size (0: none)."""
    experts: int
    k: int
    inter: int
    order: str
    normalize: bool
    shared: int = 0


def _count(cfg: dict, key: str, lo: int, default=None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise ModelError(f"{config_source(cfg)}: {key} is missing; expected an integer >= {lo}")
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ModelError(f"{config_source(cfg)}: {key} = {v!r}; expected an integer >= {lo}")
    return v


def num_experts(cfg: dict) -> int:
    """E: `num_experts` or `num_local_experts` (transformers writes either, as the class maps
    them); both present must agree."""
    keys = [k for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None]
    if not keys:
        raise ModelError(f"{config_source(cfg)}: num_experts (or num_local_experts) is missing; "
                         "expected the number of experts")
    values = {k: _count(cfg, k, 0) for k in keys}
    if len(set(values.values())) > 1:
        raise ModelError(f"{config_source(cfg)}: num_experts = {values['num_experts']} and "
                         f"num_local_experts = {values['num_local_experts']} disagree; expected one count")
    return values[keys[0]]


def family_of(cfg: dict) -> MoeFamily:
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ModelError(f"{config_source(cfg)}: model_type {mt!r} is not a mixture-of-experts family "
                         f"this plugin builds ({', '.join(FAMILIES)})")
    return FAMILIES[mt]


def routing(cfg: dict) -> Routing:
    """The routed experts of `cfg` (the same in every sparse layer)."""
    fam = family_of(cfg)
    e = num_experts(cfg)
    k = _count(cfg, "num_experts_per_tok", 1)
    if k > e:
        raise ModelError(f"{config_source(cfg)}: num_experts_per_tok = {k} exceeds the {e} experts "
                         "(num_experts); expected 1 <= num_experts_per_tok <= num_experts")
    normalize = False
    if fam.reads_norm_topk:
        normalize = cfg.get("norm_topk_prob", False)
        if not isinstance(normalize, bool):
            raise ModelError(f"{config_source(cfg)}: norm_topk_prob = {normalize!r}; expected true or false")
    shared = _count(cfg, "shared_expert_intermediate_size", 1) if fam.shared_expert else 0
    return Routing(e, k, _count(cfg, fam.inter_key, 1), fam.order, normalize, shared)


def sparse_layers(cfg: dict) -> frozenset:
    """The layers whose MLP is routed experts. Qwen3-MoE: layer i unless it is in
    `mlp_only_layers`, and only every `decoder_sparse_step`-th ((i + 1) % step == 0), as
    transformers builds it; with no experts at all, none. The others: every layer."""
    n = _count(cfg, "num_hidden_layers", 1)
    if not family_of(cfg).dense_layers:
        return frozenset(range(n))
    step = _count(cfg, "decoder_sparse_step", 1, default=1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                             for i in only):
        raise ModelError(f"{config_source(cfg)}: mlp_only_layers = {only!r}; expected a list of layer "
                         f"indices in [0, {n})")
    if num_experts(cfg) == 0:
        return frozenset()
    return frozenset(i for i in range(n) if i not in only and (i + 1) % step == 0)


def check_moe_config(cfg: dict) -> None:
    """Every MoE key of `cfg` read and checked now (a bad one is named before any build)."""
    if sparse_layers(cfg):
        routing(cfg)


__all__ = ["FAMILIES", "MoeFamily", "Routing", "TRAINING_ONLY", "check_moe_config", "family_of",
           "num_experts", "routing", "sparse_layers"]
