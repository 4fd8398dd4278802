"""Which layer of a model each node of a graph belongs to, at any IR level.

Passes rewrite and renumber nodes, so nothing carries a node's origin from HIR to MIR.
What survives every pass is data flow and the names of weights: a layer's params and
states are numbered ('model.layers.3.mlp.up_proj.weight', 'blk.3.attn_q.weight',
'kv.3.k'). A node belongs to the latest layer whose weights it depends on; nodes that
depend on none come before the layers (embeddings, RoPE tables), and nodes that read an
unnumbered weight once the last layer is done come after them (final norm, LM head).
A chain of primitives that reads no weight itself and feeds only the next node (an unfused
norm's first steps, before its weight) takes the layer of the node it feeds; what feeds
several nodes (the residual stream) stays in the layer that computed it.
"""
from __future__ import annotations

BEFORE, AFTER = -1, 1 << 30          # labels of the nodes before and after the layers


def layer_index(name: str) -> int | None:
    """The layer number in a param or state name: its first all-digit dotted part, after
    at least one other part ('model.layers.3.x' -> 3, 'kv.3.k' -> 3, 'norm.weight' -> None).
    Names the compiler makes ('__hoisted.7') number something else: None."""
    parts = name.split(".")
    if name.startswith("__"):
        return None
    return next((int(p) for p in parts[1:] if p.isdigit()), None)


def node_layers(g, leaves: dict | None = None) -> list:
    """Per node: its layer (an int), BEFORE or AFTER for computed nodes outside the layers,
    or None for a leaf that belongs to no layer (an input, a constant, a global weight).
    `leaves` gives the layer of params the names do not tell (hoisted weights: see
    `hoisted_layers`)."""
    leaves = leaves or {}
    out: list = []

    def leaf(n):
        if n.name in leaves:
            return leaves[n.name]
        return layer_index(n.name) if n.op in ("param", "state") else None

    last = max((x for n in g.nodes if not n.inputs and isinstance(x := leaf(n), int)
                and BEFORE < x < AFTER), default=None)
    for n in g.nodes:
        if not n.inputs:
            out.append(leaf(n))
            continue
        seen = [out[r[0]] for r in n.inputs if out[r[0]] is not None]
        reads_global = any(g.nodes[r[0]].op == "param" and out[r[0]] is None for r in n.inputs)
        label = max(seen, default=BEFORE)
        if reads_global and last is not None and label == last:
            label = AFTER
        out.append(label)
    users = g.consumers()
    for i in reversed(range(len(g.nodes))):          # single-consumer chains join their consumer
        n = g.nodes[i]
        use = users.get((i, 0), ())
        if (n.inputs and len(n.outs) == 1 and len(use) == 1 and use[0] >= 0 and out[use[0]] > out[i]
                and not any(g.nodes[r[0]].op in ("param", "state") for r in n.inputs)):
            out[i] = out[use[0]]
    return out


def layers_in(g, leaves: dict | None = None) -> list:
    """The layer numbers of a graph's nodes, sorted."""
    return sorted({x for x in node_layers(g, leaves) if x is not None and BEFORE < x < AFTER})


def hoisted_layers(prologue) -> dict:
    """The layer of each weight a prologue derives at load time (hoist_params names them
    '__hoisted.N'), from the weights it derives them from."""
    if prologue is None:
        return {}
    lay = node_layers(prologue)
    return {name: lay[ref[0]] for name, ref in prologue.outputs}


def label(layer) -> str:
    """'layer 3', 'before layers', 'after layers' (or '' for a leaf of no layer)."""
    if layer is None:
        return ""
    return {BEFORE: "before layers", AFTER: "after layers"}.get(layer, f"layer {layer}")


def json_layer(layer):
    """A layer as JSON: its number, "before", "after" or null."""
    return {BEFORE: "before", AFTER: "after"}.get(layer, layer)


__all__ = ["BEFORE", "AFTER", "layer_index", "node_layers", "layers_in", "hoisted_layers", "label",
           "json_layer"]
