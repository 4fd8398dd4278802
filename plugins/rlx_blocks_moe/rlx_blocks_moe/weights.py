"""HF checkpoints' expert tensors as the three stacks the MoE block reads.

Real checkpoints store one tensor per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`;
Mixtral `model.layers.N.block_sparse_moe.experts.E.w1|w3|w2.weight`, router
`block_sparse_moe.gate.weight`); transformers 5 holds them fused in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and a checkpoint
may be saved that way. Every form becomes, once at load, the canonical names

    model.layers.N.mlp.gate.weight                 router   [E, H]
    model.layers.N.mlp.experts.gate_proj.weight    [E, I, H]
    model.layers.N.mlp.experts.up_proj.weight      [E, I, H]
    model.layers.N.mlp.experts.down_proj.weight    [E, H, I]

which are also what the GGUF mappings name `ffn_gate_inp` / `ffn_{gate,up,down}_exps`. A fused
gate_up is split by views (no copy); per-expert tensors are stacked, one copy each.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from rlx_core.ir.errors import WeightError
from rlx_core.ir.quant import PackedTensor

from .config import num_experts, sparse_layers

EXPERT_STACKS = ("gate", "up", "down")
# a per-expert tensor's leaf -> its stack (LLaMA-style names and Mixtral's w1/w3/w2)
_LEAF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                    r"(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.(weight|bias)$")


class LazyStack:
    """E same-shaped expert matrices that become one [E, rows, cols] array each time one is
    asked for (np.asarray): `rlx quantize` walks a model's tensors one at a time, so a writer
    holds one stack, not the whole model's experts (a model's build stacks them eagerly)."""

    def __init__(self, parts: tuple):
        self.parts = parts
        self.shape = (len(parts),) + tuple(np.shape(parts[0]))
        self.dtype = np.asarray(parts[0][:0]).dtype
        self.ndim = len(self.shape)

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, dtype or self.dtype)
        for e, part in enumerate(self.parts):
            out[e] = part
        return out


def stack_name(layer: int, which: str) -> str:
    """The canonical name of layer `layer`'s `which` ("gate", "up", "down") expert stack."""
    return f"model.layers.{layer}.mlp.experts.{which}_proj.weight"


def router_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def stack_experts(tensors: Mapping, cfg: dict, source: str, count: str = "num_experts",
                  lazy: bool = False) -> dict:
    """`tensors` with every MoE layer's experts as the canonical stacks (module docstring;
    `lazy`: LazyStacks, for a writer); the rest unchanged. A missing, extra or mis-shaped expert tensor is a WeightError naming
    it and what was expected (`count`: where the expert count came from, for the message)."""
    sparse = sparse_layers(cfg)
    experts = num_experts(cfg) if sparse else 0
    out: dict = {}
    per: dict = {}                  # (layer, which) -> {expert: (name, tensor)}
    for name, t in tensors.items():
        if m := _PER_EXPERT.match(name):
            layer, e, leaf = int(m[1]), int(m[2]), m[3]
            if e >= experts:
                dense = "" if layer in sparse else f" and layer {layer} is dense"
                raise WeightError(f"{source}: tensor {name!r} is expert {e}, but the config has {experts} "
                                  f"experts (num_experts){dense}")
            per.setdefault((layer, _LEAF[leaf]), {})[e] = (name, t)
        elif m := _FUSED.match(name):
            layer, leaf = int(m[1]), m[2]
            if leaf == "gate_up_proj":
                out.update(_split_gate_up(name, t, layer, source))
            else:
                out[stack_name(layer, leaf[:-len("_proj")])] = t
        elif m := _ROUTER.match(name):
            out[f"model.layers.{m[1]}.mlp.gate.{m[2]}"] = t
        else:
            out[name] = t
    for (layer, which), found in sorted(per.items()):
        out[stack_name(layer, which)] = _stack(found, experts, layer, which, source, lazy)
    for layer in sorted(sparse):
        for which in EXPERT_STACKS:
            _check_stack(out.get(stack_name(layer, which)), layer, which, experts, source, count)
    return out


def _split_gate_up(name: str, t, layer: int, source: str) -> dict:
    """transformers 5's fused [E, 2I, H] gate_up as gate = rows [:I], up = rows [I:] (views)."""
    shape = tuple(np.shape(t))
    if isinstance(t, PackedTensor) or len(shape) != 3 or shape[1] % 2:
        raise WeightError(f"{source}: tensor {name!r} of shape {list(shape)}: expected a fused gate_up "
                          "stack [experts, 2 * intermediate, hidden] (gate rows first)")
    half = shape[1] // 2
    return {stack_name(layer, "gate"): t[:, :half], stack_name(layer, "up"): t[:, half:]}


def _stack(found: dict, experts: int, layer: int, which: str, source: str, lazy: bool):
    """Expert tensors 0..E-1 of one stack as one [E, rows, cols] array (all of one shape)."""
    missing = [e for e in range(experts) if e not in found]
    if missing:
        some = next(iter(found.values()))[0]
        want = re.sub(r"\.experts\.\d+\.", f".experts.{missing[0]}.", some)
        raise WeightError(f"{source}: tensor {want!r} is missing: layer {layer} has {len(found)} of its "
                          f"{experts} {which} expert tensors (missing experts {missing[:8]})")
    first_name, first = found[0]
    shape = tuple(np.shape(first))
    for e in range(experts):
        name, t = found[e]
        if isinstance(t, PackedTensor) or len(np.shape(t)) != 2 or tuple(np.shape(t)) != shape:
            raise WeightError(f"{source}: tensor {name!r} has shape {list(np.shape(t))}; expected "
                              f"{list(shape)} like {first_name!r} (a dense [rows, cols] matrix)")
    stack = LazyStack(tuple(found[e][1] for e in range(experts)))
    return stack if lazy else np.asarray(stack)


def _check_stack(t, layer: int, which: str, experts: int, source: str, count: str) -> None:
    """A sparse layer's stack is present with E experts (its inner sizes the build checks)."""
    name = stack_name(layer, which)
    if t is None:
        raise WeightError(f"{source}: layer {layer} is a mixture-of-experts layer but has no {which} "
                          f"expert tensors (expected {name!r}, or model.layers.{layer}.mlp.experts.<e>."
                          f"{which}_proj.weight for each of its {experts} experts)")
    shape = tuple(np.shape(t))
    if len(shape) != 3 or shape[0] != experts:
        raise WeightError(f"{source}: tensor {name!r} has shape {list(shape)}; expected [{experts}, rows, "
                          f"cols]: one matrix per expert, as {count} = {experts} says")


__all__ = ["EXPERT_STACKS", "router_name", "stack_experts", "stack_name"]
