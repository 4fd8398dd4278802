"""`rlx bisect`: where a backend's results first leave a reference backend's.

A model's graph runs on both backends with every computed value kept (a copy of the graph
whose outputs are all its nodes, compiled with nothing fused, folded, merged or dropped),
at four levels:

* `hir`    the graph the recipe's flow emitted;
* `mir`    the optimized MIR just before fusion (the candidate backend's pipeline);
* `fused`  the MIR the candidate runs: fused, legalized, in the profile's precision;
* `lir`    that MIR specialized to the input's dims; the real executables (their buffer
           plans, hoisted params) run too, and their outputs are compared.

Nodes are in graph order, so the first node whose value differs beyond its dtype's tolerance
is the culprit of its level: every node before it agrees, so its inputs agree.
`bisect_passes` runs one backend instead: the graph after each pass of the pipeline against
the graph as emitted, and names the first pass after which the model's outputs change.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import attrs
import numpy as np

from .ir.dtype import BF16, F16, F32, F64, DType
from .ir.errors import ModelError
from .ir.graph import Graph
from .ir.layers import label, node_layers
from .ir.printer import node_text, ref_text
from .pipeline import CompilePipeline, Executable, select_backend, specialize

LEVELS = ("hir", "mir", "fused", "lir")
# How far a value deep in a model may be from the reference's, relative to the reference's
# largest magnitude. A node's inputs carry the rounding of every node before it, and
# backends accumulate in other orders (a 135M decoder's q4_1 MLPs: 3e-5 between numba and numpy);
# a wrong kernel is off by far more (order 1). Other dtypes must match exactly.
TOLERANCE = {F32: 1e-3, F16: 5e-2, BF16: 1e-1, F64: 1e-9}
DEFAULT_IDS = tuple(range(1, 9))
LEAVES = ("input", "param", "state", "constant")


# ----------------------------------------------------------------------------- comparing
class Errors(NamedTuple):
    max_abs: float             # the largest abs error
    max_rel: float             # that over the reference's largest finite magnitude
    ok: bool = True            # within tolerance


def errors(got, want) -> Errors:
    """The errors of `got` against `want`. Equal values (infinities, NaN on both sides)
    count 0; NaN on one side or another shape, inf."""
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return Errors(math.inf, math.inf)
    g, w = g.astype(np.float64), w.astype(np.float64)
    diff = np.abs(g - w)
    diff[(g == w) | (np.isnan(g) & np.isnan(w))] = 0.0
    diff[np.isnan(diff)] = math.inf
    worst = float(diff.max(initial=0.0))
    scale = float(np.abs(w[np.isfinite(w)]).max(initial=0.0))
    return Errors(worst, worst / max(scale, 1e-30))


def tolerance(dtype: DType, tol: float | None = None) -> float:
    """The relative tolerance of `dtype` (`tol` overrides it for float types; 0 for others)."""
    if not dtype.is_float:
        return 0.0
    return TOLERANCE[dtype] if tol is None else tol


def checked(got, want, dtype: DType, tol: float | None = None) -> Errors:
    e = errors(got, want)
    return e._replace(ok=e.max_abs == 0.0 or e.max_rel <= tolerance(dtype, tol))


def compare_outputs(g: Graph, got: dict, want: dict, tol: float | None = None) -> Errors:
    """The worst errors over the outputs of `g`; ok when every output is within tolerance."""
    errs = [checked(got[name], want[name], g.shape_of(r).dtype, tol) for name, r in g.outputs]
    return Errors(max(e.max_abs for e in errs), max(e.max_rel for e in errs), all(e.ok for e in errs))


# ----------------------------------------------------------------------------- running
def raw_profile(profile):
    """`profile` running a graph as it is: nothing fused, folded, merged or dropped (HIR is
    still lowered by its policy, and what a backend lacks is legalized)."""
    return profile.evolve(fusion={"skip": True}, passes={"dce": False, "cse": False,
                                                         "constant_folding": False, "verify_each": False})


def exposed(g: Graph) -> list:
    """The values of `g` that depend on an input or state (param-only ones are computed at
    load time): (name, ref) in graph order, named %i or %i:k."""
    live: set = set()
    out = []
    for i, n in enumerate(g.nodes):
        if n.op in ("input", "state") or any(r[0] in live for r in n.inputs):
            live.add(i)
            if n.inputs:
                out += [(ref_text((i, k)), (i, k)) for k in range(len(n.outs))]
    return out


def run_graph(g: Graph, backend, profile, params: dict, feed: dict, every_value: bool = False) -> dict:
    """Outputs of `g` run on `backend` under raw_profile(profile) (host arrays by name); with
    `every_value`, every exposed value too."""
    if every_value:
        g = attrs.evolve(g, outputs=tuple(g.outputs) + tuple(exposed(g)))
    pipe = CompilePipeline(raw_profile(profile), backend)
    return run_executable(pipe.optimize(g), pipe.backend, pipe.profile, params, feed)


def run_executable(mir: Graph, backend, profile, params: dict, feed: dict) -> dict:
    """`mir` run as an Executable runs it (params hoisted, one buffer plan): host outputs."""
    exe = Executable(mir, backend, profile)
    exe.set_params({k: params[k] for k in exe.param_specs})
    out = exe.run({k: v for k, v in feed.items() if k in exe.input_specs})
    return {k: backend.to_host(v) for k, v in out.items()}


def bound_dims(g: Graph, feed: dict) -> dict:
    """The symbolic dims of `g`'s inputs bound by the shapes in `feed`."""
    env = {}
    for name, i in g.inputs.items():
        for d, n in zip(g.nodes[i].outs[0].dims, np.shape(feed[name])):
            if isinstance(d, str):
                env[d] = int(n)
    return env


# ----------------------------------------------------------------------------- inputs
def token_ids(model, text: str | None) -> np.ndarray:
    """[1, n] token ids from `--input`: ids ("1,2,3" or "1 2 3"), else text for the model's
    tokenizer; None: DEFAULT_IDS."""
    from .runtime.args import id_matrix

    vocab = model.config.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    if text is None:
        ids = [i % vocab for i in DEFAULT_IDS] if vocab else list(DEFAULT_IDS)
    elif re.fullmatch(r"\s*\d+(?:[\s,]+\d+)*\s*", text):
        ids = [int(t) for t in re.split(r"[\s,]+", text.strip())]
    elif getattr(model, "tokenizer", None) is None:
        raise ModelError(f"input {text!r}: the model has no tokenizer; pass token ids (e.g. '1,2,3')")
    else:
        ids = model.tokenizer.encode(text)
    return id_matrix([ids], vocab, "input")


def graph_feed(g: Graph, ids: np.ndarray) -> dict:
    """The inputs of a model graph for one row of ids, every token real: ids, positions,
    key_mask, token_type_ids (the CausalLM and Encoder contracts)."""
    b, s = ids.shape
    known = {"ids": ids, "positions": np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)),
             "key_mask": np.ones((b, 1, 1, s), bool), "token_type_ids": np.zeros((b, s), np.int64)}
    unknown = sorted(set(g.inputs) - set(known))
    if unknown:
        raise ModelError(f"graph {g.name!r}: bisect cannot make its input(s) {unknown}; "
                         f"it feeds {sorted(known)}")
    return {k: known[k] for k in g.inputs}


def _model(model, profile=None):
    if isinstance(model, str):
        from .runtime.model import load

        return load(model, profile=profile, progress=False)
    if not hasattr(model, "built") or not hasattr(model, "graph_modes"):
        raise ModelError(f"model: expected a path, a packaged name or a loaded model (rlx_core.load), "
                         f"got {type(model).__name__}")
    return model


def _built(model):
    """The graph bisect runs: every position's logits (a causal LM), the padded encoder."""
    modes = tuple(model.graph_modes)
    return model.built(next((m for m in ("logits", "padded") if m in modes), modes[0]))


def _source(model) -> str:
    return str(getattr(model, "source", "") or "model")


# ----------------------------------------------------------------------------- provenance
def stage_labels(g: Graph, stages) -> list:
    """Per HIR node: the innermost flow stage that emitted it ('layer 3 rms_norm
    (input_layernorm.weight)': its layer, block and checkpoint key), '' outside every stage."""
    out = [""] * len(g.nodes)
    depth = [-1] * len(g.nodes)
    for r in stages:
        if r is None:
            continue
        text = " ".join(x for x in (f"layer {r.layer}" if r.layer is not None else "", r.name,
                                    f"({r.key})" if r.key else "") if x)
        for i in range(r.start, min(r.end, len(g.nodes))):
            if r.depth >= depth[i]:
                out[i], depth[i] = text, r.depth
    return out


def layer_labels(g: Graph) -> list:
    """Per node of any level (passes renumber nodes, so stages are gone): its layer by data
    flow (ir.layers) and the weights it reads."""
    layers = node_layers(g)
    out = []
    for i, n in enumerate(g.nodes):
        weights = ", ".join(g.nodes[r[0]].name for r in n.inputs if g.nodes[r[0]].op == "param")
        out.append(", ".join(x for x in (label(layers[i]), f"reads {weights}" if weights else "") if x))
    return out


# ----------------------------------------------------------------------------- report
@attrs.frozen
class Divergence:
    """The first node of a level whose value leaves the reference's."""
    index: int
    op: str
    line: str                  # the node as `rlx inspect` prints it
    where: str                 # provenance
    errors: Errors
    dtype: str
    tol: float
    inputs: tuple              # lines: each input, its provenance and whether it agrees


@attrs.frozen
class LevelResult:
    level: str
    graph: str
    values: int                # values of the graph compared (those computed from its inputs)
    divergence: Divergence | None
    worst_rel: float           # the largest relative error among the values that agree
    executables: Errors | None = None   # lir: the real executables' outputs

    @property
    def diverged(self) -> bool:
        return self.divergence is not None or (self.executables is not None and not self.executables.ok)

    def summary(self) -> str:
        d, x = self.divergence, self.executables
        what = (f"diverges at %{d.index} {d.op}" if d is not None
                else f"agrees (worst relative error {self.worst_rel:.2g})")
        if x is not None:
            what += (f"; real executables' outputs {'agree' if x.ok else 'DIFFER'} "
                     f"(max abs {x.max_abs:.3g}, rel {x.max_rel:.3g})")
        return f"  {self.level:<6} {self.graph:<22} {self.values:>5} values  {what}"

    def details(self) -> list:
        d = self.divergence
        if d is None:
            return []
        return (["", f"first divergence at {self.level} (graph {self.graph}):", d.line,
                 f"    emitted by: {d.where or '?'}",
                 f"    max abs error {d.errors.max_abs:.4g}, max rel error {d.errors.max_rel:.4g} "
                 f"({d.dtype} tolerance {d.tol:g})", "    inputs:"]
                + [f"      {x}" for x in d.inputs])


@attrs.frozen
class BisectReport:
    model: str
    backend: str
    ref: str
    tokens: int
    levels: tuple

    @property
    def diverged(self) -> bool:
        return any(r.diverged for r in self.levels)

    @property
    def first(self) -> LevelResult | None:
        """The first level (hir, mir, fused, lir) where the backends diverge."""
        return next((r for r in self.levels if r.diverged), None)

    def text(self) -> str:
        lines = [f"rlx bisect {self.model}: backend {self.backend!r} against {self.ref!r}, "
                 f"{self.tokens} tokens"]
        lines += [r.summary() for r in self.levels]
        shown = None
        for r in self.levels:      # the first divergence, and a later level's where another op is to blame
            if r.divergence is not None and r.divergence.op != shown:
                lines += r.details()
                shown = r.divergence.op
        if not self.diverged:
            lines.append("no divergence: every value agrees at every level")
        return "\n".join(lines)

    __str__ = text


def compare_level(level: str, g: Graph, want: dict, got: dict, where: list, tol: float | None) -> LevelResult:
    """The first value of `g` (in graph order) where `got` leaves `want`."""
    worst = 0.0
    errs: dict = {}
    values = exposed(g)
    for name, ref in values:
        dt = g.shape_of(ref).dtype
        errs[ref] = e = checked(got[name], want[name], dt, tol)
        if e.ok:
            worst = max(worst, e.max_rel)
            continue
        node = g.nodes[ref[0]]
        inputs = tuple(_input_line(g, tuple(r), errs, where) for r in node.inputs)
        div = Divergence(ref[0], node.op, node_text(ref[0], node), where[ref[0]], e, dt.value,
                         tolerance(dt, tol), inputs)
        return LevelResult(level, g.name, len(values), div, worst)
    return LevelResult(level, g.name, len(values), None, worst)


def _input_line(g: Graph, r: tuple, errs: dict, where: list) -> str:
    src = g.nodes[r[0]]
    if src.op in LEAVES:
        desc, state = f'{src.op} "{src.name}"', "leaf"
    else:
        e = errs[r]
        desc, state = src.op, f"{'agrees' if e.ok else 'differs'} (rel {e.max_rel:.2g})"
    return f"{ref_text(r)} {desc} : {g.shape_of(r)}  {state}  {where[r[0]]}".rstrip()


def bisect(model, backend: str, ref: str = "numpy", input: str | None = None, levels=LEVELS,
           tol: float | None = None, profile=None) -> BisectReport:
    """Run `model` (a path, packaged name or loaded model) on `ref` and `backend` at each of
    `levels` and find the first node where they diverge (see the module doc). `input`: token
    ids ("1,2,3") or text for the model's tokenizer; `tol` overrides the float tolerances."""
    bad = [x for x in levels if x not in LEVELS]
    if bad or not levels:
        raise ModelError(f"levels: {bad or 'none'} given; expected some of {list(LEVELS)}")
    model = _model(model, profile)
    cand, refb = select_backend(backend), select_backend(ref)
    built = _built(model)
    feed = graph_feed(built.graph, token_ids(model, input))
    pipe = CompilePipeline(model.profile, cand)
    pipe.graphs = []
    final = pipe.optimize(built.graph)
    graphs = {"hir": built.graph, "mir": _before(pipe.graphs, "fusion", built.graph), "fused": final,
              "lir": specialize(final, bound_dims(final, feed))}
    results = []
    for level in levels:
        g = graphs[level]
        where = stage_labels(g, built.stages) if level == "hir" else layer_labels(g)
        want = run_graph(g, refb, model.profile, built.params, feed, every_value=True)
        got = run_graph(g, cand, model.profile, built.params, feed, every_value=True)
        r = compare_level(level, g, want, got, where, tol)
        if level == "lir":
            outs = [run_executable(final, b, model.profile, built.params, feed) for b in (refb, cand)]
            r = attrs.evolve(r, executables=compare_outputs(final, outs[1], outs[0], tol))
        results.append(r)
    return BisectReport(_source(model), cand.name, refb.name, int(feed["ids"].shape[1]), tuple(results))


def _before(graphs: list, step: str, first: Graph) -> Graph:
    """The graph going into pipeline step `step` (`graphs`: (step, graph after it))."""
    i = [name for name, _ in graphs].index(step)
    return graphs[i - 1][1] if i else first


# ----------------------------------------------------------------------------- passes
@attrs.frozen
class PassRow:
    step: int                  # position in the pipeline, from 1
    name: str
    nodes: int
    total: Errors              # the model's outputs after this pass against the graph as emitted
    own: Errors                # ... against the graph before this pass
    changed: bool              # beyond tolerance: `total` (all passes), `own` (one pass asked for)


@attrs.frozen
class PassReport:
    model: str
    backend: str
    tokens: int
    asked: str                 # "all" or the pass name asked for
    rows: tuple

    @property
    def first(self) -> PassRow | None:
        """The first pass after which the outputs change."""
        return next((r for r in self.rows if r.changed), None)

    def text(self) -> str:
        lines = [f"rlx bisect {self.model} --pass {self.asked}: backend {self.backend!r}, {self.tokens} "
                 "tokens; the outputs after each pass against the graph as emitted",
                 f"  {'#':>2} {'pass':<16} {'nodes':>6} {'max abs':>10} {'max rel':>10} {'step rel':>10}"]
        for r in self.rows:
            mark = "  <- changes the outputs" if r is self.first else ""
            lines.append(f"  {r.step:>2} {r.name:<16} {r.nodes:>6} {r.total.max_abs:>10.3g} "
                         f"{r.total.max_rel:>10.3g} {r.own.max_rel:>10.3g}{mark}")
        f = self.first
        lines.append(f"first pass that changes the outputs: #{f.step} {f.name}" if f is not None
                     else "no pass changes the outputs beyond tolerance")
        return "\n".join(lines)

    __str__ = text


def bisect_passes(model, backend: str, input: str | None = None, pass_name: str = "all",
                  tol: float | None = None, profile=None) -> PassReport:
    """On one backend: the model's outputs after every pass of its pipeline against the graph
    as emitted; the first pass after which they change beyond tolerance. `pass_name` other
    than "all" checks only that pass (each time it runs) against the graph before it."""
    model = _model(model, profile)
    b = select_backend(backend)
    built = _built(model)
    feed = graph_feed(built.graph, token_ids(model, input))
    pipe = CompilePipeline(model.profile, b)
    pipe.graphs = []
    pipe.optimize(built.graph)
    names = [name for name, _ in pipe.graphs]
    if pass_name != "all" and pass_name not in names:
        raise ModelError(f"pass {pass_name!r}: the pipeline of {built.graph.name!r} on {b.name!r} "
                         f"runs no such pass; it runs {names}")
    base = prev = run_graph(built.graph, b, model.profile, built.params, feed)
    rows = []
    for step, (name, g) in enumerate(pipe.graphs, 1):
        out = run_graph(g, b, model.profile, built.params, feed)
        total = compare_outputs(built.graph, out, base, tol)
        own = compare_outputs(built.graph, out, prev, tol)
        if pass_name in ("all", name):
            rows.append(PassRow(step, name, len(g.nodes), total, own,
                                not (total if pass_name == "all" else own).ok))
        prev = out
    return PassReport(_source(model), b.name, int(feed["ids"].shape[1]), pass_name, tuple(rows))
