"""Graph pictures: any level as Graphviz DOT (the `graphviz` package), SVG/PNG through
Graphviz's `dot` program when it is installed.

Nodes show their id, op, output shapes and dtype (LIR: where the value lives). Fused and
kernel-level ops are filled with one colour per op, so what fusion built stands out; leaves
are grey (params), blue (inputs) or yellow (states, such as KV caches); views are dashed.
Nodes are grouped by layer (`layers.node_layers`); drawing only some layers collapses each
run of the others into one box, with the edges into and out of it counted, so a 30-layer
model stays readable.
"""
from __future__ import annotations

import shutil
import zlib
from pathlib import Path

from .errors import GraphError
from .layers import AFTER, BEFORE, label, node_layers
from .ops import OPS, Level, get_op

# kernel-level ops of MIR that fusion rebuilds from primitive chains (besides Level.FUSED)
KERNEL_OPS = {"rms_norm", "layer_norm", "softmax", "rope", "attention"}
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
           "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f", "#d9d9d9", "#a6cee3", "#fdbf6f")
LEAF_COLOURS = {"param": "#eeeeee", "input": "#cde4ff", "state": "#ffe9b3", "constant": "#f7f7f7"}
FORMATS = ("dot", "gv", "svg", "png", "pdf")
INSTALL_DOT = ("install Graphviz for it: `apt install graphviz` (Debian/Ubuntu), "
               "`brew install graphviz` (macOS) or `conda install -c conda-forge graphviz`")


def _coloured_ops() -> list:
    return sorted(n for n, d in OPS.items() if d.level in (Level.FUSED, Level.HIR) or n in KERNEL_OPS)


def op_colour(op: str) -> str | None:
    """The fill of a fused or kernel-level op (the same in every picture); None for others."""
    known = _coloured_ops()
    if op in known:
        return PALETTE[known.index(op) % len(PALETTE)]
    if op in OPS and OPS[op].level in (Level.PRIM, Level.LEAF):
        return None
    return PALETTE[zlib.crc32(op.encode()) % len(PALETTE)]   # a plugin's op


def _hint(n) -> str:
    """The attr that tells nodes of one op apart: binary's op, activation's fn, a scheme, ..."""
    a = n.a
    if n.op == "custom":
        return a["name"]
    if n.op == "fused_elementwise":
        return f"{len(a['program'])} ops"
    for key in ("op", "fn", "scheme", "mask_kind"):
        if isinstance(a.get(key), str):
            return a[key]
    return ""


def _node_attrs(g, i: int, lir) -> dict:
    n = g.nodes[i]
    shapes = ", ".join(str(s) for s in n.outs)
    if n.op in LEAF_COLOURS:
        name = n.name.replace("\\", "\\\\")            # a backslash in DOT starts an escape
        head = f'{n.op} "{name}"' + (f" packed {n.a['scheme']}" if n.a.get("scheme") else "")
        attrs = {"fillcolor": LEAF_COLOURS[n.op], "fontsize": "9"}
    else:
        hint = _hint(n)
        head = f"%{i} {n.op}" + (f" {hint}" if hint else "")
        colour = op_colour(n.op)
        attrs = {"fillcolor": colour} if colour else {}
        d = get_op(n.op)
        if d.view_of is not None and not d.effect:      # a view (kv_write writes: a kernel)
            attrs["style"] = "rounded,dashed"
    lines = [head, shapes] + ([lir.slot_text(i)] if lir is not None else [])
    return {"label": "\\n".join(lines), "tooltip": f"%{i} {n.op}", **attrs}


def _runs(indices) -> list:
    """Sorted ints as (first, last) runs of consecutive values."""
    runs: list = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [tuple(r) for r in runs]


def runs_text(indices) -> str:
    """{0, 1, 2, 5} -> '0-2, 5'."""
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _runs(indices))


def graph_dot(g, layers: set | None = None, title: str = "", leaves: dict | None = None):
    """A `graphviz.Digraph` of `g` (a Graph, or a LirModule: its plan is shown too). With
    `layers`, only those layers' nodes are drawn (and the nodes before and after the
    layers); each run of other layers becomes one box. `leaves`: see `node_layers`.
    Node ids are `n<id>`."""
    import graphviz

    lir = g if hasattr(g, "slots") else None
    g = lir.graph.with_level("lir") if lir is not None else g
    lay = node_layers(g, leaves)
    collapsed = {x for x in lay if x is not None and BEFORE < x < AFTER
                 and layers is not None and x not in layers}
    box_of = {x: f"layers_{a}_{b}" for a, b in _runs(collapsed) for x in range(a, b + 1)}
    consumers = g.consumers()

    def shown(i: int) -> bool:
        if g.nodes[i].inputs:
            return lay[i] not in collapsed
        users = [c for k in range(len(g.nodes[i].outs)) for c in consumers.get((i, k), ()) if c >= 0]
        return layers is None or any(shown(c) for c in users) or (not users and lay[i] not in collapsed)

    keep = [shown(i) for i in range(len(g.nodes))]
    head = title or f"{g.name} ({g.level}): {len(g.nodes)} nodes"
    if collapsed:
        head += f"; layers {runs_text(layers)} drawn, {runs_text(collapsed)} collapsed"
    dot = graphviz.Digraph(g.name, graph_attr={"label": head, "labelloc": "t", "rankdir": "TB",
                                               "fontname": "Helvetica"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white",
                                      "fontname": "Helvetica", "fontsize": "10"},
                           edge_attr={"arrowsize": "0.6"})
    clusters: dict = {}
    for i, n in enumerate(g.nodes):
        if keep[i]:
            clusters.setdefault(lay[i] if isinstance(lay[i], int) and BEFORE < lay[i] < AFTER else None,
                                []).append(i)
    for layer, members in clusters.items():
        if layer is None:
            for i in members:
                dot.node(f"n{i}", **_node_attrs(g, i, lir))
            continue
        with dot.subgraph(name=f"cluster_layer_{layer}") as c:
            c.attr(label=label(layer), style="rounded", color="#999999")
            for i in members:
                c.node(f"n{i}", **_node_attrs(g, i, lir))
    hidden: dict = {}
    for i, n in enumerate(g.nodes):
        if n.inputs and lay[i] in collapsed:
            hidden[box_of[lay[i]]] = hidden.get(box_of[lay[i]], 0) + 1
    for a, b in _runs(collapsed):
        box = f"layers_{a}_{b}"
        what = f"layer {a}" if a == b else f"layers {a}-{b} ({b - a + 1} layers)"
        dot.node(box, label=f"{what}\\n{hidden[box]} nodes, not drawn", shape="box3d",
                 style="filled", fillcolor="#f0f0f0")

    def end(i: int) -> str | None:
        if keep[i]:
            return f"n{i}"
        return box_of.get(lay[i]) if g.nodes[i].inputs else None

    counted: dict = {}
    for i, n in enumerate(g.nodes):
        for r in n.inputs:
            src, dst = end(r[0]), end(i)
            if src is None or dst is None or src == dst:
                continue
            if keep[r[0]] and keep[i]:
                dot.edge(src, dst, **({"label": f"out {r[1]}"} if len(g.nodes[r[0]].outs) > 1 else {}))
            else:
                counted[(src, dst)] = counted.get((src, dst), 0) + 1
    for (src, dst), k in counted.items():
        dot.edge(src, dst, **({"label": f"{k} edges"} if k > 1 else {}))
    for k, (name, r) in enumerate(g.outputs):
        dot.node(f"out{k}", label=f"output {name}", shape="oval", style="filled", fillcolor="#d5f5d5")
        src = end(r[0])
        if src is not None:
            dot.edge(src, f"out{k}")
    ops = sorted({g.nodes[i].op for i in range(len(g.nodes)) if keep[i] and op_colour(g.nodes[i].op)})
    if ops:
        with dot.subgraph(name="cluster_legend") as c:
            c.attr(label="fused and kernel-level ops", style="rounded", color="#cccccc")
            for op in ops:
                c.node(f"legend_{op}", label=op, fillcolor=op_colour(op))
    return dot


def render(dot, fmt: str) -> bytes:
    """The picture in `fmt` (svg, png, pdf); a GraphError saying how to get Graphviz when
    its `dot` program is missing or fails."""
    import graphviz

    if shutil.which("dot") is None:
        raise GraphError(f"Graphviz's `dot` program is not installed, so no {fmt.upper()} can be "
                         f"drawn; {INSTALL_DOT}")
    try:
        return graphviz.Source(dot.source).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise GraphError(f"Graphviz's `dot` program could not be run; {INSTALL_DOT}") from None
    except graphviz.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip()
        raise GraphError(f"Graphviz's `dot` failed: {err or e}") from None


def write(dot, path) -> tuple:
    """Write the drawing to `path` (.dot/.gv: DOT only; .svg/.png/.pdf: the DOT beside it,
    then the picture). Returns (files written, a note: why the picture is missing, or "")."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise GraphError(f"{path}: cannot draw a {path.suffix or 'suffix-less'} file; expected "
                         f"one of {', '.join('.' + f for f in FORMATS)}")
    src = path if fmt in ("dot", "gv") else path.with_suffix(".dot")
    try:
        src.write_text(dot.source, encoding="utf-8")
        if src == path:
            return [str(src)], ""
        try:
            data = render(dot, fmt)
        except GraphError as e:
            return [str(src)], f"{e}; then: dot -T{fmt} {src} -o {path}"
        path.write_bytes(data)
    except OSError as e:
        raise GraphError(f"{path}: cannot write: {e}") from None
    return [str(src), str(path)], ""


def svg_or_none(dot) -> str | None:
    """SVG text for Jupyter's `_repr_svg_`, or None when Graphviz's `dot` is missing or fails
    (Jupyter then shows the plain text repr instead of raising)."""
    try:
        return render(dot, "svg").decode("utf-8")
    except (GraphError, ImportError):
        return None


__all__ = ["graph_dot", "render", "write", "svg_or_none", "op_colour", "runs_text", "INSTALL_DOT"]
