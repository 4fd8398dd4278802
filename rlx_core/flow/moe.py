"""The mixture-of-experts FFN block: a router, the routed experts, and an optional shared
expert, over the IR's moe_route and moe_experts (rlx_core.ir.moe).

Generic on purpose: the block takes the checkpoint names it reads (relative to the layer
prefix and its own `prefix`) and the router variant as arguments; a family plugin maps its
checkpoint's names and config onto them. The expert stacks are [E, I, H] (gate, up) and
[E, H, I] (down) tensors, each expert an nn.Linear weight; packed stacks (GGUF's
ffn_*_exps) stay packed (passes/packed.py sets moe_experts' schemes).
"""
from __future__ import annotations

import attrs

from ..ir.errors import ModelError
from ..ir.moe import ROUTE_ORDERS
from ..ir.ops import ACTIVATIONS
from .blocks import gated_mlp

EXPERT_STACKS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


@attrs.frozen
class SharedExpert:
    """A dense gated MLP every token goes through beside the routed experts; with `gate` (the
    key of a [1, H] weight) its output is scaled by sigmoid(x @ gate^T) (a gated shared expert).
    `prefix` holds gate_proj/up_proj/down_proj .weight, relative to the MoE block's prefix."""
    inter: int
    prefix: str = "shared_expert"
    gate: str | None = None


@attrs.frozen
class MoeFfn:
    """x [B, S, H] -> router logits [B, S, E] (linear, optional bias) -> moe_route (k of E,
    `order`, `normalize`) -> moe_experts over the stacks -> [B, S, H], plus the shared expert
    if any. `tap`: the router logits also become output f"{tap}.{layer}" (HF's
    router_logits)."""
    experts: int
    k: int
    inter: int
    prefix: str = "mlp"
    router: str = "gate.weight"
    router_bias: str | None = None
    stacks: tuple = EXPERT_STACKS            # keys of the gate, up and down stacks
    order: str = "softmax_topk"
    normalize: bool = False
    act: str = "silu"
    shared: SharedExpert | None = None
    tap: str | None = None

    def key(self, ctx, name: str) -> str:
        return ctx.key(f"{self.prefix}.{name}" if self.prefix else name)

    def check(self, ctx) -> None:
        where = f"moe_ffn {ctx.key(self.prefix) or '(top level)'}"
        if not 1 <= self.k <= self.experts:
            raise ModelError(f"{where}: k={self.k} experts per token, expected 1 <= k <= the "
                             f"{self.experts} experts")
        if self.order not in ROUTE_ORDERS:
            raise ModelError(f"{where}: router order {self.order!r}, expected one of {list(ROUTE_ORDERS)}")
        if self.act not in ACTIVATIONS:
            raise ModelError(f"{where}: activation {self.act!r}, expected one of {list(ACTIVATIONS)}")
        if len(self.stacks) != 3:
            raise ModelError(f"{where}: stacks must name the gate, up and down stacks, got {self.stacks!r}")

    def route(self, ctx, x):
        """(weights, ids) of each token's k experts; the router logits tapped if asked."""
        m, e = ctx.m, self.experts
        w = ctx.param(self.key(ctx, self.router), (e, x.dims[-1]))
        b = ctx.param(self.key(ctx, self.router_bias), (e,)) if self.router_bias else None
        logits = m.linear(x, w, b)
        if self.tap:
            layer = ctx._index
            ctx.outputs[self.tap if layer is None else f"{self.tap}.{layer}"] = logits
        return m.add("moe_route", (logits,), k=self.k, order=self.order, normalize=self.normalize)

    def routed(self, ctx, x, weights, ids):
        e, i, h = self.experts, self.inter, x.dims[-1]
        shapes = ((e, i, h), (e, i, h), (e, h, i))
        gate, up, down = (ctx.param(self.key(ctx, name), shp) for name, shp in zip(self.stacks, shapes))
        return ctx.m.add("moe_experts", (x, weights, ids, gate, up, down), act=self.act)

    def shared_expert(self, ctx, s: SharedExpert, x):
        m, h = ctx.m, x.dims[-1]
        p = self.key(ctx, s.prefix)
        y = gated_mlp(m, x, ctx.param(f"{p}.gate_proj.weight", (s.inter, h)),
                      ctx.param(f"{p}.up_proj.weight", (s.inter, h)),
                      ctx.param(f"{p}.down_proj.weight", (h, s.inter)), self.act)
        if s.gate:
            y = y * m.sigmoid(m.linear(x, ctx.param(self.key(ctx, s.gate), (1, h))))
        return y

    def emit(self, ctx, x):
        self.check(ctx)
        y = self.routed(ctx, x, *self.route(ctx, x))
        return y if self.shared is None else y + self.shared_expert(ctx, self.shared, x)


__all__ = ["MoeFfn", "SharedExpert", "EXPERT_STACKS"]
