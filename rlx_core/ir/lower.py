"""HIR -> MIR under a FusionPolicy.

`direct`: a block becomes the fused MIR op that implements it.
`fusable`: a block becomes a primitive chain (the `deep` entries of the composite table,
composites.py); the fusion passes re-fuse it for the target. The same table legalizes any op
a backend lacks (`legalize`, re-exported here).
"""
from __future__ import annotations

import enum
from collections.abc import Mapping

from .composites import (COMPOSITES, F32_LOWEST, attention_grad_prims, layer_norm_grad_prims,  # noqa: F401
                         legalize, rms_norm_grad_prims, softmax_prims)
from .control import map_bodies
from .graph import MIR, Graph
from .rewrite import rewrite


class FusionPolicy(str, enum.Enum):
    DIRECT = "direct"
    FUSABLE = "fusable"


class _Builds(Mapping):
    """op -> its composite's `fn(m, inputs, attrs)`: the table under its former name, a view
    of composites.COMPOSITES (shard.py and plugin tests read it)."""

    def __getitem__(self, op):
        return COMPOSITES[op].build

    def __iter__(self):
        return iter(COMPOSITES)

    def __len__(self):
        return len(COMPOSITES)


DECOMPOSE_FUSED = _Builds()


def _direct(m, node, ins):
    a = node.a
    if node.op == "linear":
        if len(ins) > 2:
            return m.add("fused_matmul_bias_act", tuple(ins), trans_b=a["transpose_w"])
        return m.matmul(ins[0], ins[1], trans_b=a["transpose_w"])
    if node.op == "swiglu_mlp":
        t = a["transpose_w"]
        h = m.add("fused_swiglu", (m.matmul(ins[0], ins[1], trans_b=t), m.matmul(ins[0], ins[2], trans_b=t)))
        return m.matmul(h, ins[3], trans_b=t)
    return None


def lower(g: Graph, policy: FusionPolicy | str = FusionPolicy.DIRECT, keep=frozenset()) -> Graph:
    """HIR -> MIR. Under `fusable` every block, norm, softmax, rope and attention becomes
    primitives, leaving the fusion passes to rebuild what the target can fuse; the MIR ops
    named in `keep` stay (value_and_grad keeps those whose backward is a fused op)."""
    policy = FusionPolicy(policy)
    g = map_bodies(g, lambda body: lower(body, policy, keep))        # control-flow bodies first

    def replace(m, node, ins, i, lookup):
        if policy is FusionPolicy.DIRECT:
            return _direct(m, node, ins)
        if node.op in keep:
            return None
        c = COMPOSITES.get(node.op)
        if c is None or not c.deep:
            return None
        return (c.fusable or c.build)(m, ins, node.a)

    return rewrite(g, replace, level=MIR)


__all__ = ["FusionPolicy", "lower", "legalize"]
