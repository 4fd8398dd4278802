"""Fusion patterns as rewrite rules, grouped by name and picked per backend target.

Each rule rebuilds one fused (or kernel-level) op from the primitive chain that `fusable`
lowering emits, so `direct`, `fusable` and unfused graphs compute the same thing. Two
groups are passes rather than rooted patterns: shared-input matmuls and elementwise regions.
"""
from __future__ import annotations

from typing import NamedTuple

import attrs

from ..ir.errors import GraphError
from ..ir.graph import Graph
from ..ir.registry import registry
from ..ir.rewrite import P, Rule, X, apply_rules, rewrite
from .generic import dce

B, A, R, MM = P("binary"), P("activation"), P("reduce"), P("matmul")
RULES: dict = {}          # group name -> [Rule]


class FusionHit(NamedTuple):
    """One fusion: the rule, the node it rooted at, and the graph that node id indexes (each
    sweep renumbers nodes, so an id alone says nothing once the pass is done)."""
    rule: str
    node: int
    graph: Graph


def rule(group: str, pattern: P, when=None, name: str | None = None):
    def wrap(emit):
        RULES.setdefault(group, []).append(Rule(name or emit.__name__.strip("_"), pattern, emit, when))
        return emit
    return wrap


def _scalar(g, ref) -> bool:
    n = g.nodes[ref[0]]
    return n.op == "constant" and g.constants[n.name].size == 1


S = lambda name: X(name, pred=_scalar)  # noqa: E731


def _last_axis(mt, x, red) -> bool:
    rank = mt.shape(x).rank
    axes = mt.attrs(red)["axes"]
    return len(axes) == 1 and axes[0] % rank == rank - 1


def _vec(mt, vec, x) -> bool:
    v, s = mt.shape(vec), mt.shape(x)
    return v.rank == 1 and v.dims[0] == s.dims[-1]


# --------------------------------------------------------------------------- RMSNorm
@rule("rms_norm", B(X("x"), A(B(R(B(X("x"), X("x"), op="mul"), op="mean", keepdims=True, name="r"),
                                S("eps"), op="add"), fn="rsqrt"), op="mul"),
      when=lambda mt: _last_axis(mt, "x", "r"))
def _rms_norm(mt):
    return mt.m.rms_norm(mt.get("x"), eps=mt.scalar("eps"))


_RMS0 = P("rms_norm")(X("x"), name="n")


@rule("rms_norm", B(_RMS0, B(X("w"), S("off"), op="add"), op="mul"), when=lambda mt: _vec(mt, "w", "x"))
def _rms_norm_weight_offset(mt):
    return mt.m.rms_norm(mt.get("x"), mt.get("w"), eps=mt.attrs("n")["eps"], offset=mt.scalar("off"))


@rule("rms_norm", B(_RMS0, X("w"), op="mul"), when=lambda mt: _vec(mt, "w", "x"))
def _rms_norm_weight(mt):
    return mt.m.rms_norm(mt.get("x"), mt.get("w"), eps=mt.attrs("n")["eps"])


# --------------------------------------------------------------------------- LayerNorm
_D = B(X("x"), R(X("x"), op="mean", keepdims=True, name="r1"), op="sub", name="d")


@rule("layer_norm", B(_D, A(B(R(B(_D, _D, op="mul"), op="mean", keepdims=True), S("eps"), op="add"),
                           fn="rsqrt"), op="mul"),
      when=lambda mt: _last_axis(mt, "x", "r1"))
def _layer_norm(mt):
    return mt.m.layer_norm(mt.get("x"), eps=mt.scalar("eps"))


_LN0 = P("layer_norm")(X("x"), name="n")
_LN1 = P("layer_norm")(X("x"), X("g"), name="n")


@rule("layer_norm", B(_LN0, X("g"), op="mul"), when=lambda mt: _vec(mt, "g", "x"))
def _layer_norm_gamma(mt):
    return mt.m.layer_norm(mt.get("x"), mt.get("g"), eps=mt.attrs("n")["eps"])


@rule("layer_norm", B(_LN1, X("b"), op="add"), when=lambda mt: _vec(mt, "b", "x"))
def _layer_norm_beta(mt):
    return mt.m.layer_norm(mt.get("x"), mt.get("g"), mt.get("b"), eps=mt.attrs("n")["eps"])


# --------------------------------------------------------------------------- softmax
_E = A(B(X("x"), R(X("x"), op="max", keepdims=True, name="r"), op="sub"), fn="exp", name="e")


@rule("softmax", B(_E, R(_E, op="sum", keepdims=True, name="r2"), op="div"),
      when=lambda mt: mt.attrs("r")["axes"] == mt.attrs("r2")["axes"] and len(mt.attrs("r")["axes"]) == 1)
def _softmax(mt):
    return mt.m.softmax(mt.get("x"), axis=mt.attrs("r")["axes"][0])


# what lower.softmax_prims emits: the max clamped to a finite floor, the sum to 1 (an all -inf
# row gives zeros, as the kernels do); any clamp but those two is not a softmax
_EC = A(B(X("x"), B(R(X("x"), op="max", keepdims=True, name="r"), S("lo"), op="max"), op="sub"),
        fn="exp", name="e")


@rule("softmax", B(_EC, B(R(_EC, op="sum", keepdims=True, name="r2"), S("one"), op="max"), op="div"),
      when=lambda mt: (mt.attrs("r")["axes"] == mt.attrs("r2")["axes"] and len(mt.attrs("r")["axes"]) == 1
                       and mt.scalar("one") == 1.0 and mt.scalar("lo") <= -1e38),
      name="softmax_clamped")
def _softmax_clamped(mt):
    return _softmax(mt)


# --------------------------------------------------------------------------- f16/bf16
# `fusable` lowering of a low-precision norm or softmax computes it in f32 between two
# casts; the kernels do exactly that internally, so the casts fold into the op (and the
# weight rules above can then fire).
def _lowp(mt) -> bool:
    dt = mt.shape("x").dtype
    return dt is mt.shape("c").dtype and dt.value in ("f16", "bf16")


def _cast_wrapped(op):
    return P("cast")(P(op)(P("cast")(X("x"), dtype="f32"), name="n"), name="c")


@rule("rms_norm", _cast_wrapped("rms_norm"), when=_lowp)
def _rms_norm_lowp(mt):
    return mt.m.rms_norm(mt.get("x"), eps=mt.attrs("n")["eps"], offset=mt.attrs("n")["offset"])


@rule("layer_norm", _cast_wrapped("layer_norm"), when=_lowp)
def _layer_norm_lowp(mt):
    return mt.m.layer_norm(mt.get("x"), eps=mt.attrs("n")["eps"])


@rule("softmax", _cast_wrapped("softmax"), when=_lowp)
def _softmax_lowp(mt):
    return mt.m.softmax(mt.get("x"), axis=mt.attrs("n")["axis"])


# --------------------------------------------------------------------------- SwiGLU, epilogues
@rule("swiglu", B(A(X("g"), fn="silu"), X("u"), op="mul"),
      when=lambda mt: mt.shape("g") == mt.shape("u"))
def _swiglu(mt):
    return mt.m.add("fused_swiglu", (mt.get("g"), mt.get("u")))


@rule("matmul_bias_act", B(MM(X("x"), X("w"), trans_a=False, name="mm"), X("b"), op="add"),
      when=lambda mt: _vec(mt, "b", "mm"))
def _matmul_bias(mt):
    return mt.m.add("fused_matmul_bias_act", (mt.get("x"), mt.get("w"), mt.get("b")),
                    trans_b=mt.attrs("mm")["trans_b"])


# Which activations fuse into a matmul epilogue (fused_matmul_bias_act, dequant_matmul `act`):
# every one of the expression table but identity (nothing to fuse), since each backend's epilogue
# renders the table's formula for any of them (CUDA's elementwise emit_op, OpenCL's act_expr,
# numba's elementwise step, NumPy's activation kernel).
_ACTS = lambda fn: fn != "identity"  # noqa: E731


@rule("matmul_bias_act", A(P("fused_matmul_bias_act")(X("x"), X("w"), X("b"), act="identity", name="f"),
                           fn=_ACTS, name="a"))
def _matmul_bias_then_act(mt):
    return mt.m.add("fused_matmul_bias_act", (mt.get("x"), mt.get("w"), mt.get("b")),
                    trans_b=mt.attrs("f")["trans_b"], act=mt.attrs("a")["fn"])


@rule("matmul_bias_act", A(MM(X("x"), X("w"), trans_a=False, name="mm"), fn=_ACTS, name="a"))
def _matmul_act(mt):
    return mt.m.add("fused_matmul_bias_act", (mt.get("x"), mt.get("w")),
                    trans_b=mt.attrs("mm")["trans_b"], act=mt.attrs("a")["fn"])


@rule("matmul_bias_act", B(P("dequant_matmul")(X("x"), X("w"), act="identity", name="dq"), X("b"), op="add"),
      when=lambda mt: _vec(mt, "b", "dq"))
def _dequant_matmul_bias(mt):
    return mt.m.add("dequant_matmul", (mt.get("x"), mt.get("w"), mt.get("b")), scheme=mt.attrs("dq")["scheme"])


@rule("matmul_bias_act", A(P("dequant_matmul")(X("x"), X("w"), ..., act="identity", name="dq"),
                           fn=_ACTS, name="a"))
def _dequant_matmul_act(mt):
    ins = [mt.lookup(r) for r in mt.g.nodes[mt.caps["dq"][0]].inputs]
    return mt.m.add("dequant_matmul", tuple(ins), scheme=mt.attrs("dq")["scheme"], act=mt.attrs("a")["fn"])


# --------------------------------------------------------------------------- residual + norm
def _same(mt, a, b):
    return mt.shape(a) == mt.shape(b)


@rule("residual_rms_norm", P("rms_norm")(B(X("x"), X("r"), op="add", name="h", shared=True), ..., name="n"),
      when=lambda mt: _same(mt, "x", "r"))
def _residual_rms_norm(mt):
    extra = [mt.lookup(r) for r in mt.g.nodes[mt.caps["n"][0]].inputs[1:]]
    h, y = mt.m.add("fused_residual_rms_norm", (mt.get("x"), mt.get("r"), *extra),
                    eps=mt.attrs("n")["eps"], offset=mt.attrs("n")["offset"])
    return {"root": y, "h": h}


@rule("residual_layer_norm", P("layer_norm")(B(X("x"), X("r"), op="add", name="h", shared=True), ...,
                                              name="n"),
      when=lambda mt: _same(mt, "x", "r"))
def _residual_layer_norm(mt):
    extra = [mt.lookup(r) for r in mt.g.nodes[mt.caps["n"][0]].inputs[1:]]
    h, y = mt.m.add("fused_residual_ln", (mt.get("x"), mt.get("r"), *extra), eps=mt.attrs("n")["eps"])
    return {"root": y, "h": h}


# --------------------------------------------------------------------------- RoPE
_N1 = P("narrow")(X("x"), axis=3, start=0, name="n1")
_N2 = P("narrow")(X("x"), axis=3, name="n2")


def _table_of(mt, name):
    """The [S,R/2] or [B,S,R/2] table behind the broadcast reshape rope_prims makes."""
    n = mt.g.nodes[mt.caps[name][0]]
    if n.op != "reshape":
        return None
    return n.inputs[0]


@rule("rope", P("concat")(B(B(_N1, X("c"), op="mul"), B(_N2, X("s"), op="mul"), op="sub"),
                          B(B(_N2, X("c"), op="mul"), B(_N1, X("s"), op="mul"), op="add"), axis=3),
      when=lambda mt: (mt.attrs("n1")["length"] == mt.attrs("n2")["start"] == mt.attrs("n2")["length"]
                       and 2 * mt.attrs("n1")["length"] == mt.shape("x").dims[3]
                       and _table_of(mt, "c") is not None and _table_of(mt, "s") is not None))
def _rope(mt):
    return mt.m.rope(mt.get("x"), mt.lookup(_table_of(mt, "c")), mt.lookup(_table_of(mt, "s")))


_P5 = P("reshape")(X("x"), name="pairs")
_I1 = P("narrow")(_P5, axis=4, start=0, length=1)
_I2 = P("narrow")(_P5, axis=4, start=1, length=1)


def _table5(mt, name):
    """The table behind reshape(reshape(table)) that interleaved rope_prims makes."""
    n = mt.g.nodes[mt.caps[name][0]]
    inner = mt.g.nodes[n.inputs[0][0]] if n.op == "reshape" else None
    return inner.inputs[0] if inner is not None and inner.op == "reshape" else None


def _interleaved_ok(mt) -> bool:
    x, pairs = mt.shape("x"), mt.shape("pairs")
    return (x.rank == 4 and mt.shape("out") == x and pairs.dims == x.dims[:3] + (pairs.dims[3], 2)
            and _table5(mt, "c") is not None and _table5(mt, "s") is not None
            and mt.g.shape_of(_table5(mt, "c")).dims[-1] == pairs.dims[3])


@rule("rope", P("reshape")(P("concat")(B(B(_I1, X("c"), op="mul"), B(_I2, X("s"), op="mul"), op="sub"),
                                       B(B(_I2, X("c"), op="mul"), B(_I1, X("s"), op="mul"), op="add"),
                                       axis=4), name="out"),
      when=_interleaved_ok)
def _rope_interleaved(mt):
    return mt.m.rope(mt.get("x"), mt.lookup(_table5(mt, "c")), mt.lookup(_table5(mt, "s")),
                     style="interleaved")


# --------------------------------------------------------------------------- attention
def _unrepeat(g, ref):
    """reshape(expand(reshape(k))) made by repeat_kv -> k."""
    n = g.nodes[ref[0]]
    if n.op != "reshape":
        return ref
    e = g.nodes[n.inputs[0][0]]
    if e.op != "expand":
        return ref
    r = g.nodes[e.inputs[0][0]]
    if r.op != "reshape":
        return ref
    k = r.inputs[0]
    kd = g.shape_of(k).dims
    if len(kd) == 4 and r.outs[0].dims == (kd[0], kd[1], 1, kd[2], kd[3]):
        return k
    return ref


def _attention_patterns():
    qk = MM(X("q"), X("kk"), trans_a=False, trans_b=True)
    scaled = B(qk, S("scale"), op="mul")
    capped = B(A(B(scaled, S("cap"), op="div"), fn="tanh"), S("cap"), op="mul")
    for core in (scaled, capped):
        for masked in (True, False):
            inner = P("mask_fill")(core, ..., name="mf") if masked else core
            yield MM(P("softmax")(inner), X("vv"), trans_a=False, trans_b=False)


def _attention_ok(mt):
    return all(mt.shape(n).rank == 4 for n in ("q", "kk", "vv"))


def _attention(mt):
    g = mt.g
    a = dict(mask_kind="none", window=0, has_mask=False, has_pos=False)
    extra = []
    if "mf" in mt.caps:
        a = {k: mt.attrs("mf")[k] for k in a}
        extra = [mt.lookup(r) for r in g.nodes[mt.caps["mf"][0]].inputs[1:]]
    k, v = mt.lookup(_unrepeat(g, mt.caps["kk"])), mt.lookup(_unrepeat(g, mt.caps["vv"]))
    return mt.m.add("attention", (mt.get("q"), k, v, *extra), scale=mt.scalar("scale"),
                    softcap=mt.scalar("cap") if "cap" in mt.caps else 0.0, **a)


for _p in _attention_patterns():
    RULES.setdefault("attention", []).append(Rule("attention", _p, _attention, _attention_ok))

_ROPE = lambda q: P("rope")(X(q), X("c"), X("s"), name="r" + q)  # noqa: E731


@rule("attention_block", P("attention")(_ROPE("q"), _ROPE("k"), X("v"), ..., name="at"),
      when=lambda mt: mt.attrs("rq") == mt.attrs("rk"))
def _attention_block(mt):
    extra = [mt.lookup(r) for r in mt.g.nodes[mt.caps["at"][0]].inputs[3:]]
    return mt.m.add("fused_attention_block", (mt.get("q"), mt.get("k"), mt.get("v"), mt.get("c"),
                                              mt.get("s"), *extra),
                    style=mt.attrs("rq")["style"], **mt.attrs("at"))


# --------------------------------------------------------------------------- shared-input matmuls
def _leaves_first(g: Graph) -> Graph:
    """The same graph with every leaf (no inputs) moved before the computed nodes."""
    leaf = ("param", "constant", "input", "state")
    order = sorted(range(len(g.nodes)), key=lambda i: (g.nodes[i].op not in leaf, i))
    if order == list(range(len(order))):
        return g
    new = {old: k for k, old in enumerate(order)}
    nodes = tuple(attrs.evolve(g.nodes[i], inputs=tuple((new[r[0]], r[1]) for r in g.nodes[i].inputs))
                  for i in order)
    return Graph(g.name, g.level, nodes, tuple((n, (new[r[0]], r[1])) for n, r in g.outputs),
                 g.constants)


def fuse_shared_matmuls(g: Graph) -> tuple:
    """matmul(x, W1), matmul(x, W2), ... with params W_i -> one matmul on concat(W_i) and
    views of its output. The concat of params is hoisted to load time by the pipeline. A
    packed member's activation epilogue (GeGLU's gate) becomes an activation of its view,
    which the elementwise pass joins to the ops after it."""
    groups: dict = {}
    for i, n in enumerate(g.nodes):
        if n.op == "matmul" and not n.a["trans_a"]:
            kind = n.a["trans_b"]
        elif n.op == "dequant_matmul" and len(n.inputs) == 2:
            kind = n.a["scheme"]           # packed rows of one scheme concatenate as bytes
        else:
            continue
        w = g.nodes[n.inputs[1][0]]
        if w.op != "param" or w.outs[0].rank != 2:
            continue
        groups.setdefault((tuple(n.inputs[0]), kind, w.outs[0].dtype), []).append(i)
    if any(len(ms) > 1 and any(g.nodes[i].inputs[1][0] > ms[0] for i in ms) for ms in groups.values()):
        lf = _leaves_first(g)          # a builder emits W_k after matmul(x, W_q): move params up
        if lf is not g:
            return fuse_shared_matmuls(lf)
    plan: dict = {}
    hits = []
    for (x, kind, _), members in groups.items():
        if len(members) < 2:
            continue
        first = members[0]
        if any(g.nodes[i].inputs[1][0] > first for i in members):
            continue
        plan[first] = (members, kind)
        hits.append(("shared_matmul", first))
    if not plan:
        return g, []
    extra: dict = {}

    def replace(m, node, ins, i, lookup):
        if i not in plan:
            return None
        members, kind = plan[i]
        ws = [lookup(g.nodes[j].inputs[1]) for j in members]
        if isinstance(kind, str):
            axis = 0
            y = m.add("dequant_matmul", (ins[0], m.concat(ws, 0)), scheme=kind)
        else:
            axis = 0 if kind else 1
            y = m.matmul(ins[0], m.concat(ws, axis), trans_b=kind)
        off = 0
        outs = []
        for j, w in zip(members, ws):
            n_out = w.dims[axis]
            v = m.narrow(y, -1, off, n_out)
            act = g.nodes[j].a.get("act", "identity") if isinstance(kind, str) else "identity"
            outs.append(v if act == "identity" else m.act(v, act))
            off += n_out
        for j, v in zip(members[1:], outs[1:]):
            extra[(j, 0)] = v
        return outs[0]

    return rewrite(g, replace, extra_map=extra), hits


# --------------------------------------------------------------------------- elementwise regions
EW = {"binary", "compare", "where", "activation", "cast", "fused_swiglu"}


def fuse_elementwise(g: Graph) -> tuple:
    """Merge trees of elementwise ops into one fused_elementwise node each. An op whose every
    consumer is elementwise joins each consumer's region: one consumer's as it is, several
    consumers' each recomputing it (cos and sin of one angle: two launches, not three)."""
    consumers = g.consumers()

    def absorbable(ref):
        n, cons = g.nodes[ref[0]], consumers.get(tuple(ref), ())
        return (n.op in EW and len(n.outs) == 1 and bool(cons)
                and all(c >= 0 and g.nodes[c].op in EW for c in cons))

    roots: dict = {}
    for i, n in enumerate(g.nodes):
        if n.op not in EW or absorbable((i, 0)):
            continue                                   # (absorbed by its consumers' regions)
        members, leaves, stack = {i}, [], list(n.inputs)
        order = []
        while stack:
            r = tuple(stack.pop())
            if absorbable(r) and r[0] not in members:
                members.add(r[0])
                stack.extend(g.nodes[r[0]].inputs)
        if len(members) < 2:
            continue
        for j in sorted(members):
            for r in g.nodes[j].inputs:
                if r[0] not in members and tuple(r) not in leaves:
                    leaves.append(tuple(r))
        slot = {r: k for k, r in enumerate(leaves)}
        for j in sorted(members):
            nd = g.nodes[j]
            order.append((nd.op, nd.attrs, tuple(slot[tuple(r)] for r in nd.inputs)))
            slot[(j, 0)] = len(slot)
        roots[i] = (leaves, tuple(order))
    if not roots:
        return g, []

    def replace(m, node, ins, i, lookup):
        if i not in roots:
            return None
        leaves, program = roots[i]
        return m.add("fused_elementwise", tuple(lookup(r) for r in leaves), program=program,
                     dtype=node.outs[0].dtype.value)

    return rewrite(g, replace), [("elementwise", i) for i in roots]


# Groups that combine ops other groups build (a norm must be whole before its residual
# add joins it), so they run after the others reach their fixpoint.
LATE = {"residual_rms_norm", "residual_layer_norm", "attention_block"}
PASSES = {"shared_matmul": fuse_shared_matmuls, "elementwise": fuse_elementwise}
ALL_GROUPS = tuple(RULES) + tuple(PASSES)
# Each backend target lists the groups it fuses; unknown targets get every group.
TARGETS = {
    "generic": ALL_GROUPS,
    "numpy": tuple(g for g in ALL_GROUPS if g != "elementwise"),
    "cuda": ALL_GROUPS,
    "opencl": ALL_GROUPS,
    "numba": ALL_GROUPS,
}


def groups_for(target: str, skip) -> tuple:
    if skip is True:
        return ()
    known = tuple(all_rules()) + tuple(PASSES)
    groups = TARGETS.get(target, known) + tuple(g for g in known if g not in ALL_GROUPS)
    skip = set(skip or ())
    unknown = skip - set(known)
    if unknown:
        raise GraphError(f"fusion.skip names unknown pattern groups {sorted(unknown)}; "
                         f"known: {list(known)}")
    return tuple(gr for gr in groups if gr not in skip)


def all_rules() -> dict:
    """Built-in rule groups plus those plugins registered through rlx_register_passes."""
    merged = {k: list(v) for k, v in RULES.items()}
    for group, rules in registry().rules.items():
        merged.setdefault(group, []).extend(rules)
    return merged


def fuse(g: Graph, groups: tuple, max_sweeps: int = 8, log=None) -> Graph:
    """Apply the rule groups to a fixpoint, then the pass groups; `log` (a list) gets a
    FusionHit for every fusion."""
    if not groups:
        return g                 # fusion skipped: leave the graph alone (no hidden DCE)
    table = all_rules()
    for phase in (lambda gr: gr not in LATE, lambda gr: gr in LATE):
        rules = [r for gr in groups if gr in table and phase(gr) for r in table[gr]]
        for _ in range(max_sweeps):
            before = g
            g, hits = apply_rules(g, rules)
            g = dce(g)
            if log is not None:
                log.extend(FusionHit(r, i, before) for r, i in hits)
            if not hits:
                break
    for gr in ("shared_matmul", "elementwise"):
        if gr in groups:
            before = g
            g, hits = PASSES[gr](g)
            g = dce(g)
            if log is not None:
                log.extend(FusionHit(r, i, before) for r, i in hits)
    return g


def unfused(g: Graph, groups: tuple) -> list:
    """(rule, node) for every fusable pattern still present (for assert_clean)."""
    table = all_rules()
    rules = [r for gr in groups if gr in table for r in table[gr]]
    found: list = []
    apply_rules(g, rules, on_match=lambda r, i: found.append((r.name, i)))
    return found


__all__ = ["RULES", "TARGETS", "FusionHit", "fuse", "unfused", "groups_for"]
