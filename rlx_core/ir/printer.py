"""Readable text for every level: one line per node with its shapes (like a jaxpr)."""
from __future__ import annotations


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, tuple):
        return "(" + ",".join(_fmt(x) for x in v) + ")"
    if getattr(v, "_rlx_graph_attr", False):
        return f"@{v.name}"
    return str(v)


def ref_text(ref) -> str:
    return f"%{ref[0]}" if ref[1] == 0 else f"%{ref[0]}:{ref[1]}"


def node_text(i: int, node, extra: str = "") -> str:
    outs = ", ".join(str(s) for s in node.outs)
    lhs = f"%{i}" if len(node.outs) == 1 else ",".join(f"%{i}:{k}" for k in range(len(node.outs)))
    if node.op in ("input", "param", "state", "constant"):
        body = f'{node.op} "{node.name}"'
        if node.a.get("scheme"):
            body += f" packed {node.a['scheme']}"
        if node.a.get("shard"):
            src, axis, start, length, padded = node.a["shard"]
            pad = f" padded to {padded}" if padded != length else ""
            body += f' shard of "{src}" axis {axis} [{start}:{start + length}]{pad}'
    else:
        args = ", ".join(ref_text(r) for r in node.inputs)
        at = " ".join(f"{k}={_fmt(v)}" for k, v in node.attrs)
        body = f"{node.op}({args})" + (f" {{{at}}}" if at else "")
    return f"  {lhs} = {body} : {outs}{extra}"


def graph_text(g, annotate=None) -> str:
    lines = [f"graph {g.name} ({g.level}) {{"]
    for i, n in enumerate(g.nodes):
        lines.append(node_text(i, n, annotate(i) if annotate else ""))
        for k, v in n.attrs:                       # control-flow bodies, nested and indented
            if getattr(v, "_rlx_graph_attr", False):
                lines.extend(f"    {k}: {ln}" if j == 0 else f"    {ln}"
                             for j, ln in enumerate(graph_text(v).split("\n")))
    outs = ", ".join(f"{name}={ref_text(r)}" for name, r in g.outputs)
    lines.append(f"  return {outs}")
    lines.append("}")
    return "\n".join(lines)
