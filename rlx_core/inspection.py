"""What `rlx inspect MODEL` shows: a model's recipe and config, the stages its flow emitted by
layer, what every compile pass did, where fusion fired, the buffer plan, the params and the
placement of every node — as plain data (`report()`, the `--json` form) and as text.

Nothing here compiles kernels or binds weights: the flow is built on the checkpoint's
tensors, optimized by a pipeline that keeps each pass's graph, and planned (LIR) with every
symbolic dim bound, by `--dim` or a default, so the buffer plan has numbers.
"""
from __future__ import annotations

import collections
import os

import attrs

from .ir.graph import Graph
from .ir.layers import AFTER, hoisted_layers, json_layer, node_layers
from .ir.lir import LirModule, packed_logical, param_group
from .ir.ops import get_op

# dims bound when --dim does not: one sequence of a short prompt (a packed encoder batch: one
# text of 16 tokens), a KV cache of one context bucket (runtime/model.py CTX_BUCKET); any
# other dim gets OTHER_DIM
DEFAULT_DIMS = {"batch": 1, "seq": 16, "ctx": 128, "tokens": 16, "seqs": 1}
OTHER_DIM = 16
LEAVES = ("input", "param", "state", "constant")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def file_format(path: str) -> str:
    """'gguf' for a GGUF file, else 'safetensors' (`path`: the file or folder a model was
    read from, its `source`)."""
    if os.path.isdir(path):
        return "safetensors"
    with open(path, "rb") as f:
        return "gguf" if f.read(4) == b"GGUF" else "safetensors"


def config_sources(path: str, fmt: str) -> dict:
    """Config key -> the GGUF metadata key it was read from (none for a config.json)."""
    if fmt != "gguf":
        return {}
    from .weights.gguf_io import gguf_config, read_gguf

    sources: dict = {}
    gguf_config(read_gguf(path), sources)
    return sources


def stored_dtypes(path: str, fmt: str, tensors) -> dict:
    """Checkpoint tensor -> its dtype as the file stores it (a GGUF's ggml type), so the report
    says which weights were converted to the dtype they are bound in."""
    if fmt != "gguf":
        return {k: _dtype_name(v.dtype) for k, v in tensors.items() if hasattr(v, "dtype")
                and getattr(v, "scheme", None) is None}
    from gguf import GGMLQuantizationType

    from .weights.gguf_io import hf_name, read_gguf

    gf = read_gguf(path)
    out = {}
    for t in gf.tensors:
        name = hf_name(gf.metadata["general.architecture"], t.name)
        if name is not None:
            out[name] = _dtype_name(GGMLQuantizationType(t.ggml_type).name)
    return out


def _dtype_name(dt) -> str:
    """An RLX dtype name ('f16') where there is one, else as a scheme or numpy names it ('q4_1')."""
    from .ir.dtype import DType
    from .ir.errors import DTypeError

    try:
        return DType.parse(dt.lower() if isinstance(dt, str) else dt).value
    except DTypeError:
        return str(dt).lower()


def _ops(g: Graph, ids=None) -> collections.Counter:
    nodes = g.nodes if ids is None else (g.nodes[i] for i in ids)
    return collections.Counter(n.op for n in nodes)


def kernel_name(n) -> str:
    """The kernel a backend runs for node `n`: its op, with the variant that picks one."""
    a = n.a
    if n.op == "custom":
        return f"custom:{a['name']}"
    if n.op == "fused_elementwise":
        return f"fused_elementwise[{len(a['program'])} ops]"
    if n.op in ("dequant_matmul", "dequantize", "fake_quantize", "quantize"):
        return f"{n.op}[{a['scheme']}]"
    return n.op


@attrs.define
class Inspection:
    """One graph of a model taken through the pipeline, with everything needed to report it."""
    target: str
    path: str
    fmt: str
    model: object
    mode: str | None
    built: object                 # BuiltModel
    pipe: object                  # CompilePipeline, with .graphs kept
    mir: Graph
    sources: dict
    dims: dict = attrs.field(factory=dict)        # every dim of the graph, bound
    defaulted: tuple = ()                         # the dims bound by default, not by --dim
    lir: LirModule | None = None
    prologue: Graph | None = None

    # -- building
    @classmethod
    def load(cls, target: str, mode: str | None = None, backend=None, profile=None) -> "Inspection":
        """Load `target` (HF folder, GGUF file or packaged name), build the flow of `mode`
        (None: the model's default: prefill for a causal LM, the layout an encoder runs) and
        optimize it."""
        from .ir.errors import ModelError
        from .pipeline import CompilePipeline
        from .runtime.model import load
        from .weights import resolve_model_path

        path = resolve_model_path(target)
        model = load(path, backend=backend, profile=profile, progress=False)
        modes = tuple(getattr(model, "graph_modes", ()))
        if mode is not None and mode not in modes:
            raise ModelError(f"mode {mode!r} is not a graph of this {type(model).__name__}; "
                             f"expected one of {list(modes)}")
        built = model.built(mode) if mode is not None else model.built()
        pipe = CompilePipeline(model.profile, model.backend)
        pipe.graphs = []
        mir = pipe.optimize(built.graph)
        source = str(getattr(model, "source", path))        # the file or folder read
        fmt = file_format(source)
        return cls(target, source, fmt, model, mode, built, pipe, mir, config_sources(source, fmt))

    def bind(self, dims: dict) -> None:
        """Plan the graph the executable runs (param-only parts hoisted to load time) with
        `dims` bound and the rest by default, with the backend's layouts (its views and
        concat parts written in place) as the executable plans it."""
        from .passes.transform import hoist_params
        from .pipeline import specialize
        from .ir.lir import plan

        symbols = self.mir.symbols()
        self.defaulted = tuple(sorted(symbols - set(dims)))
        self.dims = {s: dims.get(s, DEFAULT_DIMS.get(s, OTHER_DIM)) for s in sorted(symbols)}
        main, self.prologue = hoist_params(self.mir)
        g = specialize(main, self.dims)
        self.lir = plan(g, *self.pipe.backend.planned_layouts(g))

    # -- the report, section by section
    def header(self) -> dict:
        m, recipe = self.model, self.model.recipe
        return {"target": self.target, "path": self.path, "format": self.fmt,
                "model_type": m.config.get("model_type") or m.config.get("_class_name"),
                "recipe": getattr(recipe, "name", ""),
                "recipe_class": type(recipe).__name__, "model_class": type(m).__name__,
                "mode": self.mode, "graph": self.built.graph.name, "profile": m.profile.name,
                "backend": m.backend.name, "layers": m.config.get("num_hidden_layers")}

    def config(self) -> list:
        """Every config key the recipe got, with where the checkpoint states it ("derived":
        the GGUF loader computes it, as transformers' does)."""
        return [{"key": k, "value": v,
                 "from": self.sources.get(k, "derived") if self.fmt == "gguf" else "config.json"}
                for k, v in self.model.config.items() if not k.startswith("_")]

    def stages(self) -> list:
        """The flow's stages in emit order; one outside every layer scope (a tap between
        layers) is listed with the layer before it."""
        records = sorted(self.built.stages, key=lambda r: (r.start, r.depth))
        layered = [i for i, r in enumerate(records) if r.layer is not None]
        out = []
        for i, r in enumerate(records):
            layer = r.layer
            if layer is None:
                layer = "before" if not layered or i < layered[0] else "after" if i > layered[-1] \
                    else out[-1]["layer"]
            ops = _ops(self.built.graph, range(r.start, r.end))
            out.append({"layer": layer, "stage": r.name, "key": r.key, "depth": r.depth,
                        "hir_nodes": [r.start, r.end], "ops": dict(sorted(ops.items()))})
        return out

    def streams(self) -> list:
        """Each stream of the flow (rlx_core.flow.stream): the input it was bound to, and the
        stages that wrote and read it with their layers."""
        out: dict = {}
        for r in getattr(self.built, "streams", ()):
            row = out.setdefault(r.stream, {"stream": r.stream, "bound_to": "", "written_by": {}, "read_by": {}})
            if r.source:
                row["bound_to"] = r.source
            layers = row["written_by" if r.action == "write" else "read_by"].setdefault(r.stage, [])
            if r.layer not in layers:
                layers.append(r.layer)
        return list(out.values())

    def passes(self) -> list:
        rows = [{"pass": "input", "level": self.built.graph.level, "nodes": len(self.built.graph.nodes),
                 "ms": 0.0, "added": {}, "removed": {}}]
        prev = _ops(self.built.graph)
        for (name, n, secs), (_, g) in zip(self.pipe.trace, self.pipe.graphs):
            now = _ops(g)
            rows.append({"pass": name, "level": g.level, "nodes": n, "ms": round(secs * 1e3, 3),
                         "added": dict(sorted((now - prev).items())),
                         "removed": dict(sorted((prev - now).items()))})
            prev = now
        return rows

    def fusion(self) -> list:
        labels: dict = {}
        out = []
        for hit in self.pipe.fusion_log:
            g = hit.graph
            if id(g) not in labels:
                labels[id(g)] = node_layers(g)
            n = g.nodes[hit.node]
            out.append({"rule": hit.rule, "layer": json_layer(labels[id(g)][hit.node]), "root_op": n.op,
                        "shape": str(n.outs[0])})
        return out

    def legalized(self) -> list:
        names = [name for name, _ in self.pipe.graphs]
        if not self.pipe.legalized or "legalize" not in names:
            return []
        before = self.pipe.graphs[names.index("legalize") - 1][1]
        lay = node_layers(before)
        out = []
        for op in self.pipe.legalized:
            ids = [i for i, n in enumerate(before.nodes) if n.op == op]
            how = ("decomposed by its composite (rlx_core.ir.composites) into ops it has" if ids else
                   "emitted by another op's composite, and decomposed by its own in turn")
            out.append({"op": op, "nodes": len(ids),
                        "layers": sorted({json_layer(lay[i]) for i in ids}, key=str),
                        "reason": f"backend {self.pipe.backend.name!r} has no kernel for {op}; {how}"})
        return out

    def buffers(self) -> dict:
        lir = self.lir
        homes = collections.Counter()
        for s in lir.slots.values():
            homes["in_place" if s.home == "arena" and s.base is not None else s.home] += 1
        lay = node_layers(lir.graph, hoisted_layers(self.prologue))
        arena = sorted(((s.nbytes, k) for k, s in lir.slots.items() if s.home == "arena"), reverse=True)
        pro = self.prologue
        derived = [] if pro is None else [pro.shape_of(r) for _, r in pro.outputs]
        return {"dims": self.dims, "defaulted": list(self.defaulted),
                "arena_bytes": lir.arena_bytes, "liveness_bound_bytes": lir.lower_bound,
                "values": dict(sorted(homes.items())),
                "largest": [{"node": k[0], "op": lir.graph.nodes[k[0]].op, "bytes": b,
                             "layer": json_layer(lay[k[0]])} for b, k in arena[:5]],
                "derived_at_load": {"tensors": len(derived), "bytes": sum(s.nbytes() for s in derived)}}

    def params(self) -> dict:
        """Every bound param; `stored`: its dtype in the file, where it is converted from that
        (an f16 norm bound f32, a bf16 checkpoint, a GGUF block dequantized) to `scheme`."""
        tensors = []
        stored = stored_dtypes(self.path, self.fmt, self.model.tensors)
        for n in self.mir.nodes:
            if n.op != "param":
                continue
            s, scheme = n.outs[0], n.a.get("scheme", "")
            tensors.append({"name": n.name, "group": param_group(n.name), "dtype": s.dtype.value,
                            "shape": list(s.dims), "scheme": scheme or s.dtype.value,
                            "stored": stored.get(n.name, scheme or s.dtype.value),
                            "logical_shape": list(packed_logical(scheme, s.dims) if scheme else s.dims),
                            "bytes": s.nbytes()})
        groups: dict = {}
        for t in tensors:
            g = groups.setdefault(t["group"], {"group": t["group"], "count": 0, "bytes": 0, "schemes": {}})
            g["count"] += 1
            g["bytes"] += t["bytes"]
            g["schemes"][t["scheme"]] = g["schemes"].get(t["scheme"], 0) + 1
        bound = {t["name"] for t in tensors}
        return {"count": len(tensors), "bytes": sum(t["bytes"] for t in tensors),
                "groups": list(groups.values()), "tensors": tensors,
                "not_bound": sorted(k for k in self.model.tensors if k not in bound)}

    def placement(self) -> list:
        g, lir = self.lir.graph, self.lir
        lay = node_layers(g, hoisted_layers(self.prologue))
        out = []
        for i, n in enumerate(g.nodes):
            s = lir.slots[(i, 0)]
            d = get_op(n.op)
            if n.op in LEAVES:
                kernel = "-"
            elif s.home == "view" and not d.effect:          # (kv_write writes: a kernel)
                kernel = "view"
            else:
                kernel = kernel_name(n)
            home = "in_place" if s.home == "arena" and s.base is not None else s.home
            out.append({"node": i, "op": n.op, "layer": json_layer(lay[i]),
                        "shapes": [str(x) for x in n.outs], "kernel": kernel, "home": home,
                        "buffer": lir.slot_text(i)})
        return out

    def memory(self) -> dict | None:
        """Bytes the planned graph holds at the bound dims: resident weights (params and
        those derived at load), KV cache (states; `state_bytes` the part without a context
        axis: recurrent states, ring buffers), arena; a running model's own numbers
        (pool overhead included, on cuda) come from model.memory_report()."""
        if self.lir is None:
            return None
        g = self.lir.graph
        held = {k: sum(n.outs[0].nbytes() for n in g.nodes if n.op == op)
                for k, op in (("weights_bytes", "param"), ("kv_bytes", "state"))}
        # states without a context axis (recurrent states, ring buffers): the same bytes at any context
        fixed = {n.name for n in self.mir.nodes if n.op == "state" and "ctx" not in n.outs[0].dims}
        held["state_bytes"] = sum(n.outs[0].nbytes() for n in g.nodes if n.op == "state" and n.name in fixed)
        out = {**held, "arena_bytes": self.lir.arena_bytes, "dims": self.dims}
        out["total_bytes"] = out["weights_bytes"] + out["kv_bytes"] + out["arena_bytes"]
        return out

    def report(self) -> dict:
        """Everything, as JSON-ready data (`rlx inspect MODEL --json`)."""
        return {"model": self.header(), "config": self.config(), "stages": self.stages(),
                "streams": self.streams(), "passes": self.passes(), "fusion": self.fusion(), "legalized": self.legalized(),
                "lir": self.buffers() if self.lir is not None else None,
                "params": self.params(), "memory": self.memory(),
                "placement": {"backend": self.pipe.backend.name,
                              "graph": "the LIR above (node ids as in `lir.text()`)",
                              "nodes": self.placement() if self.lir is not None else []}}

    def text(self, nodes_of: set | None = None) -> str:
        return report_text(self.report(), nodes_of)


# ============================================================================ text
def _runs(rows: list) -> list:
    """(key, signature) rows -> (keys, signature) with consecutive int keys of one
    signature merged: thirty identical layers print as one line."""
    out: list = []
    for key, sig in rows:
        if out and isinstance(key, int) and isinstance(out[-1][0][-1], int) \
                and out[-1][0][-1] == key - 1 and out[-1][1] == sig:
            out[-1][0].append(key)
        else:
            out.append(([key], sig))
    return out


def layers_text(keys: list) -> str:
    """[0..29] -> 'layers 0-29', [3] -> 'layer 3', ['before'] -> 'before layers'."""
    k = keys[0]
    if not isinstance(k, int):
        return f"{k} layers"
    return f"layer {k}" if len(keys) == 1 else f"layers {k}-{keys[-1]}"


def _counts(c: dict) -> str:
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in c.items())


def _by_layer(rows: list) -> list:
    """(layer, rows) in graph order: before, 0, 1, ..., after."""
    rank = {"before": -1, "after": AFTER, None: AFTER + 1}
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["layer"], []).append(r)
    return sorted(groups.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else rank[kv[0]])


def _stages_text(rows: list) -> str:
    """'a (2) | b (5) [ c (2) | d (3) ]' from stage rows in emit order (depth nests)."""
    out, depth = "", 0
    for r in rows:
        n = r["hir_nodes"][1] - r["hir_nodes"][0]
        item = r["stage"] + (f" {r['key']}" if r["key"] else "") + (f" ({n})" if n else "")
        if r["depth"] > depth:
            out += " [ " + item
        else:
            out += " ]" * (depth - r["depth"]) + (" | " if out else "") + item
        depth = r["depth"]
    return out + " ]" * depth


def _layer_span(layers: list) -> str:
    """[None] -> 'outside layers', [0, 1, 2] -> 'layers 0-2', mixed -> both."""
    ints = sorted(x for x in layers if isinstance(x, int))
    parts = ["outside layers"] if any(x is None for x in layers) else []
    if ints:
        parts.append(layers_text(ints) if ints == list(range(ints[0], ints[-1] + 1)) else
                     "layers " + ",".join(map(str, ints)))
    return ", ".join(parts)


def report_text(rep: dict, nodes_of: set | None = None) -> str:
    """The report as text; with `nodes_of` (a set of layers, or every layer when empty) the
    placement of each of those nodes is listed too."""
    h = rep["model"]
    lines = [f"# {h['target']}: {h['model_type']} through recipe {h['recipe']} ({h['recipe_class']} -> "
             f"{h['model_class']}), graph {h['graph']}" + (f" (mode {h['mode']})" if h["mode"] else "")
             + f"; profile {h['profile']}, backend {h['backend']}",
             f"#   {h['path']} ({h['format']})"]
    cfg = rep["config"]
    lines.append(f"\n# config ({len(cfg)} keys; where the checkpoint states each)")
    w = max((len(c["key"]) for c in cfg), default=0)
    for c in cfg:
        v = c["value"]
        v = f"[{len(v)} values: {v[0]!r}, ...]" if isinstance(v, list) and len(v) > 4 else v
        lines.append(f"  {c['key']:<{w}}  {str(v):<24}  {c['from']}")

    lines.append("\n# stages the flow emitted, by layer (HIR nodes each added; [ ]: stages inside one)")
    for keys, sig in _runs([(layer, _stages_text(rs)) for layer, rs in _by_layer(rep["stages"])]):
        lines.append(f"  {layers_text(keys):<14} {sig}")

    if rep.get("streams"):
        lines.append("\n# streams (bound to an input; stages writing / reading each, by layer)")
        for st in rep["streams"]:
            lines.append(f"  {st['stream']}" + (f" <- {st['bound_to']}" if st["bound_to"] else ""))
            for what in ("written_by", "read_by"):
                if st[what]:
                    lines.append(f"    {what.replace('_', ' ')}: " + ", ".join(
                        f"{name} ({_layer_span(ls)})" for name, ls in st[what].items()))

    p = rep["passes"]
    lines.append(f"\n# passes: {p[0]['level'].upper()} {p[0]['nodes']} nodes -> {p[-1]['level'].upper()} "
                 f"{p[-1]['nodes']} nodes")
    for r in p[1:]:
        delta = ", ".join([f"+{k} {v}" for k, v in r["added"].items()]
                          + [f"-{k} {v}" for k, v in r["removed"].items()])
        lines.append(f"  {r['pass']:<14} {r['nodes']:>6}  {r['ms']:>8.1f} ms  {delta}")

    fu = rep["fusion"]
    lines.append(f"\n# fusion: {len(fu)} rewrites" + (", by layer" if fu else ""))
    for keys, sig in _runs([(layer, tuple(collections.Counter(r["rule"] for r in rs).items()))
                            for layer, rs in _by_layer(fu)]):
        lines.append(f"  {layers_text(keys):<14} {_counts(dict(sig))}" + (" (each)" if len(keys) > 1 else ""))

    lg = rep["legalized"]
    if not lg:
        lines.append(f"\n# legalized: nothing (backend {h['backend']} has a kernel for every op)")
    else:
        lines.append("\n# legalized (decomposed into primitives)")
        for r in lg:
            lines.append(f"  {r['op']}: {r['nodes']} nodes, layers {r['layers']}; {r['reason']}")

    b = rep["lir"]
    if b is not None:
        dims = ", ".join(f"{k}={v}" for k, v in b["dims"].items()) or "static"
        dflt = f"; {', '.join(b['defaulted'])} by default: set with --dim NAME=N" if b["defaulted"] else ""
        lines.append(f"\n# LIR buffer plan ({dims}{dflt})")
        a, lb = b["arena_bytes"], b["liveness_bound_bytes"]
        over = f" (+{100 * (a - lb) / lb:.1f}%)" if lb else ""
        lines.append(f"  arena {human_bytes(a)}; liveness lower bound {human_bytes(lb)}{over}")
        v = b["values"]
        lines.append("  values: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in v.items()))
        d = b["derived_at_load"]
        if d["tensors"]:
            lines.append(f"  {d['tensors']} weights derived once at load time ({human_bytes(d['bytes'])}), "
                         "outside the arena")
        if b["largest"]:
            lines.append("  largest: " + ", ".join(f"%{x['node']} {x['op']} {human_bytes(x['bytes'])}"
                                                    for x in b["largest"][:3]))

    pa = rep["params"]
    lines.append(f"\n# params: {pa['count']} tensors, {human_bytes(pa['bytes'])} as bound "
                 "(packed weights at their packed size)")
    members: dict = {}
    for t in pa["tensors"]:
        members.setdefault(t["group"], []).append(t)
    rows = []
    for g in pa["groups"]:
        stem, _, num = g["group"].rpartition(".")
        sig = (stem, g["count"], g["bytes"], _counts(g["schemes"]))
        rows.append((int(num), sig) if num.isdigit() else (g["group"], sig))
    for keys, (stem, count, nbytes, schemes) in _runs(rows):
        if isinstance(keys[0], int):
            name = f"{stem}.{keys[0]}" + (f"-{keys[-1]}" if len(keys) > 1 else "")
            each = " each" if len(keys) > 1 else ""
            lines.append(f"  {name:<22} {count} tensors{each}, {human_bytes(nbytes)}{each}: {schemes}")
        else:
            lines.append(f"  {keys[0]:<22} " + "; ".join(
                f"{t['name']} {t['scheme']} {human_bytes(t['bytes'])}" for t in members[keys[0]]))
    converted: dict = {}
    for t in pa["tensors"]:
        if t["stored"] != t["scheme"]:
            converted.setdefault(f"{t['stored']} -> {t['scheme']}", []).append(t["name"])
    for how, names in converted.items():
        lines.append(f"  converted when loaded: {len(names)} stored {how}"
                     + (f" ({', '.join(names)})" if len(names) <= 3 else ""))
    if pa["not_bound"]:
        lines.append(f"  checkpoint tensors the graph does not read: {pa['not_bound']}")

    mem = rep.get("memory")
    if mem:
        fixed = (f" (of which fixed-size states, the same at any context: {human_bytes(mem['state_bytes'])})"
                 if mem.get("state_bytes") else "")
        lines.append(f"\n# memory at the dims above: weights {human_bytes(mem['weights_bytes'])}, KV cache "
                     f"{human_bytes(mem['kv_bytes'])}{fixed}, arena {human_bytes(mem['arena_bytes'])}; total "
                     f"{human_bytes(mem['total_bytes'])} (a loaded model: model.memory_report())")

    pl = rep["placement"]["nodes"]
    if pl:
        lines.append(f"\n# placement on {h['backend']}: LIR nodes by kernel" + ("" if nodes_of is not None
                     else " (--nodes lists each)"))
        by: dict = {}
        for r in pl:
            if r["kernel"] != "-":
                by.setdefault(r["kernel"], []).append(r)
        for kernel, rs in sorted(by.items(), key=lambda kv: -len(kv[1])):
            lay = sorted({r["layer"] for r in rs if isinstance(r["layer"], int)})
            where = f"layers {lay[0]}-{lay[-1]}" if len(lay) > 1 else f"layer {lay[0]}" if lay else ""
            extra = sorted({r["layer"] for r in rs if isinstance(r["layer"], str)})
            where = ", ".join([where] * bool(where) + [f"{x} layers" for x in extra])
            lines.append(f"  {kernel:<28} {len(rs):>5}  {where}")
        if nodes_of is not None:
            lines.append("\n# nodes (LIR ids): kernel, output shapes, buffer, layer")
            for r in pl:
                if r["kernel"] != "-" and (not nodes_of or r["layer"] in nodes_of):
                    lines.append(f"  %{r['node']:<5} {r['kernel']:<26} {', '.join(r['shapes']):<24} "
                                 f"{r['buffer']:<28} {r['layer'] if r['layer'] is not None else ''}")
    return "\n".join(lines)


__all__ = ["Inspection", "DEFAULT_DIMS", "human_bytes", "kernel_name", "report_text", "layers_text"]
