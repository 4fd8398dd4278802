"""Tensor parallelism as a pass: one rank's MIR of a model sharded Megatron-style.

Every value is replicated (R) or split: this rank holds [start, start + length) of a
global extent `total` (zero-padded past `real`) along one axis. A matmul of a replicated
x by a weight param is column-parallel (the weight's output rows sliced), a matmul whose
x is split on the contraction is row-parallel (the weight's input columns sliced) and is
followed by `all_reduce`. Splits flow through elementwise ops, reshapes, transposes, norms,
RoPE, kv_write (the KV cache state holds the rank's heads) and attention (heads per rank;
GQA with fewer KV heads than ranks gives each rank the KV head its query heads read). A
gather from a weight table (embedding) is vocab-parallel: a masked local lookup and
`all_reduce`. Any other op on a split value gets it whole again through `all_gather`, so
what no rule covers still computes the unsharded result; the graph outputs are whole.

Params keep their names; their node's `shard` attr says which slice of which source weight
the rank binds (`bind_slices`), so a rank reads only its slice of a memory-mapped file.
The pass runs on the MIR before fusion: the fusion passes then fuse the rank's graph (the
concatenated QKV and gate/up weights are concatenations of the rank's slices: packed
weights split on block boundaries). Collectives are boundaries to every fusion group.
Packed weights (passes/packed.py ran first: u8 [rows, bytes per row] params) shard alike:
a dequant_matmul is column-parallel on whole packed rows, row-parallel on the bytes of whole
blocks of each row (only when the rank's slice of K starts and ends on the scheme's block
boundaries; else it runs replicated, noted in `log`), and a packed lookup is vocab-parallel
(its rows dequantized before the masked all_reduce).
A MIR lowered `direct` may hold matmul epilogues, and a matmul whose output is read only
through views of parts of its weight (an encoder's matmul on concat(W_q, W_k, W_v), or
on one fused Wqkv): `unfuse_matmuls` takes them apart first (a part of one weight is a param
whose `shard` attr names it; the walk slices such a part further on the same axis).
"""
from __future__ import annotations

import attrs
import numpy as np

from ..ir.errors import GraphError, ModelError
from ..ir.graph import Builder, Graph, Node
from ..ir.lower import DECOMPOSE_FUSED
from ..ir.ops import COLLECTIVES, get_op, infer
from ..ir.quant import PackedTensor, QuantScheme
from ..ir.rewrite import rewrite
from ..ir.shape import norm_axis
from .generic import dce, leaves_first

ATTENTION = ("attention", "fused_attention_block", "varlen_attention")


@attrs.frozen
class Split:
    """This rank's part of a value: [start, start + length) of `total` along `axis` (`real`
    of the total are data, the rest zero padding)."""
    axis: int
    start: int
    length: int
    total: int
    real: int

    def moved(self, axis: int, scale_num: int = 1, scale_den: int = 1) -> "Split":
        f = lambda v: v * scale_num // scale_den      # noqa: E731
        return Split(axis, f(self.start), f(self.length), f(self.total), f(self.real))

    def sel(self) -> tuple:
        return (self.start, self.length, self.total)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def reshape_groups(src: tuple, dst: tuple):
    """Axis groups (src axes, dst axes) of a reshape whose sizes match, left to right, or
    None when symbols do not pair up one to one (an axis of 1 against a symbol is a group
    of its own: [1, tokens, h] -> [tokens, heads, d])."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        a, b = src[i], dst[j]
        if (a == 1 and isinstance(b, str)) or (b == 1 and isinstance(a, str)):
            groups.append(([i], []) if a == 1 else ([], [j]))
            i, j = i + (a == 1), j + (b == 1)
            continue
        if isinstance(a, str) or isinstance(b, str):
            if a != b:
                return None
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        si, dj, ps, pd = [i], [j], a, b
        while ps != pd:
            if ps < pd:
                i += 1
                if i >= len(src) or isinstance(src[i], str):
                    return None
                si.append(i)
                ps *= src[i]
            else:
                j += 1
                if j >= len(dst) or isinstance(dst[j], str):
                    return None
                dj.append(j)
                pd *= dst[j]
        groups.append((si, dj))
        i, j = i + 1, j + 1
    groups += [([k], []) for k in range(i, len(src))] + [([], [k]) for k in range(j, len(dst))]
    return groups


def _reshape_fwd(src: tuple, dst: tuple, axis: int, sel: tuple):
    """(dst axis, factor num, factor den) carrying a split on src `axis` through a reshape."""
    for si, dj in reshape_groups(src, dst) or ():
        if axis not in si:
            continue
        if len(si) == 1 and dj:
            inner = _prod(dst[k] for k in dj[1:])
            return (dj[0], 1, inner) if all(v % inner == 0 for v in sel) else None
        if si[0] == axis and len(dj) == 1:
            return dj[0], _prod(src[k] for k in si[1:]), 1
    return None


def _reshape_back(src: tuple, dst: tuple, axis: int, sel: tuple):
    """The inverse: a split on dst `axis` as (src axis, num, den) (the grouping is symmetric)."""
    return _reshape_fwd(dst, src, axis, sel)


def _head_sels(g: Graph, i: int, world: int, rank: int) -> tuple:
    """(q heads, kv heads) of attention node i as (start, length, total) for this rank."""
    n = g.nodes[i]
    q, k = g.shape_of(n.inputs[0]), g.shape_of(n.inputs[1])
    h, kvh = q.dims[1], k.dims[1]
    where = f"node %{i} ({n.op})"
    if not isinstance(h, int) or not isinstance(kvh, int):
        raise GraphError(f"tensor parallel: {where} has symbolic head counts {h}, {kvh}")
    if h % world:
        raise GraphError(f"tensor parallel: {where}: {h} query heads do not split over "
                         f"tensor = {world} ranks")
    qh = h // world
    if kvh % world == 0:
        return (rank * qh, qh, h), (rank * (kvh // world), kvh // world, kvh)
    group = h // kvh
    if world % kvh == 0 and group % qh == 0:     # fewer KV heads than ranks: each rank one
        return (rank * qh, qh, h), (rank * qh // group, 1, kvh)
    raise GraphError(f"tensor parallel: {where}: {kvh} kv heads do not split over, nor "
                     f"divide, tensor = {world} ranks ({h} query heads)")


def _weight(g: Graph, ref):
    """The param node id of a matmul weight operand (a 2-D param), else None."""
    n = g.nodes[ref[0]]
    return ref[0] if n.op == "param" and n.outs[0].rank == 2 and not n.a.get("scheme") else None


def _packed(g: Graph, ref):
    """(param node id, QuantScheme) of a packed weight operand (u8 [rows, bytes per row]
    with a scheme), else None."""
    n = g.nodes[ref[0]]
    if n.op != "param" or not n.a.get("scheme") or n.outs[0].dtype.is_float or n.outs[0].rank != 2:
        return None
    return ref[0], QuantScheme.parse(n.a["scheme"])


def _projection(g: Graph, node: Node) -> bool:
    """Whether `node` multiplies x by a weight param's rows: x @ W^T or x @ W (matmul, not
    transposing x) or dequant_matmul on a packed weight."""
    if node.op == "dequant_matmul":
        return _packed(g, node.inputs[1]) is not None
    return node.op == "matmul" and _weight(g, node.inputs[1]) is not None and not node.a["trans_a"]


def head_demands(g: Graph, world: int, rank: int) -> tuple:
    """Trace each attention's q, k and v back to the column-parallel matmul producing them:
    {matmul node: (start, length, total) of its output features} and {state node: Split}."""
    mm: dict = {}
    states: dict = {}
    for i, n in enumerate(g.nodes):
        if n.op not in ATTENTION:
            continue
        qs, kvs = _head_sels(g, i, world, rank)
        for slot, sel in ((0, qs), (1, kvs), (2, kvs)):
            ref, axis = tuple(n.inputs[slot]), 1
            while True:
                node = g.nodes[ref[0]]
                op = node.op
                if op == "transpose":
                    axis = node.a["perm"][axis]
                elif op == "reshape":
                    src = g.shape_of(node.inputs[0]).dims
                    back = _reshape_back(src, node.outs[0].dims, axis, sel)
                    if back is None:
                        break
                    axis, num, den = back
                    sel = tuple(v * num // den for v in sel)
                elif op == "kv_write":
                    c = node.inputs[0]
                    if g.nodes[c[0]].op == "state":
                        states[c[0]] = Split(axis, sel[0], sel[1], sel[2], sel[2])
                    ref = tuple(node.inputs[1])
                    continue
                elif op in ("rope", "rms_norm", "layer_norm", "cast", "activation", "binary"):
                    pass
                elif _projection(g, node) and axis == node.outs[0].rank - 1:
                    if mm.setdefault(ref[0], sel) != sel:
                        raise GraphError(f"tensor parallel: node %{ref[0]} (matmul) feeds attentions "
                                         f"that need different head splits")
                    break
                else:
                    break
                ref = tuple(node.inputs[0])
    return mm, states


def _pieces(g: Graph, ref, axis: int, rank: int):
    """[(param ref, offset along `axis`, size)] making up value `ref`: one param of `rank`
    dims, or a concat of them along `axis`; None for anything else."""
    node = g.nodes[ref[0]]
    refs = [tuple(r) for r in node.inputs] \
        if node.op == "concat" and norm_axis(node.a["axis"], rank, "concat") == axis else [tuple(ref)]
    out, at = [], 0
    for r in refs:
        p = g.nodes[r[0]]
        if p.op != "param" or p.outs[0].rank != rank or p.a.get("scheme") or p.a.get("shard") \
                or not isinstance(p.outs[0].dims[axis], int):
            return None
        out.append((r, at, p.outs[0].dims[axis]))
        at += p.outs[0].dims[axis]
    return out


def _piece(pieces, lo: int, length: int):
    """(param ref, start, length) of [lo, lo + length) when one piece holds it, else None."""
    for r, at, size in pieces:
        if at <= lo and lo + length <= at + size:
            return r, lo - at, length
    return None


def _mm_parts(g: Graph, i: int, consumers: dict):
    """For matmul node i (or its epilogue) whose weight is a 2-D param, or a concat of them,
    along the output features (its bias, if any, likewise) and whose every reader is a
    narrow of the output features within one of them: {narrow node: (weight part, bias part
    | None)}, a part being (param ref, start, length) along that axis; else None."""
    n = g.nodes[i]
    if n.op not in ("matmul", "fused_matmul_bias_act") or n.a.get("trans_a"):
        return None
    ws = _pieces(g, n.inputs[1], 0 if n.a["trans_b"] else 1, 2)
    bs = _pieces(g, n.inputs[2], 0, 1) if len(n.inputs) > 2 else None
    if ws is None or (len(n.inputs) > 2 and bs is None):
        return None
    rank, out = n.outs[0].rank, {}
    for c in consumers.get((i, 0), ()):
        m = g.nodes[c] if c >= 0 else None
        if m is None or m.op != "narrow" or norm_axis(m.a["axis"], rank, "narrow") != rank - 1 \
                or m.a["start"] < 0:
            return None
        w = _piece(ws, m.a["start"], m.a["length"])
        b = _piece(bs, m.a["start"], m.a["length"]) if bs is not None else None
        if w is None or (bs is not None and b is None):
            return None
        out[c] = (w, b)
    return out or None


def unfuse_matmuls(g: Graph) -> Graph:
    """`g` with every matmul epilogue (fused_matmul_bias_act) as matmul + bias + activation,
    and a matmul whose output is read only through views of parts of its weight
    (`_mm_parts`: a matmul on concat(W_q, W_k, W_v), or on one fused Wqkv) as one
    matmul per part, on that part of the weight (a param with a `shard` attr where it is a
    slice of one): the walk shards each part column-parallel on its own."""
    if not any(n.op in ("fused_matmul_bias_act", "narrow") for n in g.nodes):
        return g
    consumers = g.consumers()
    parts: dict = {}                   # narrow node -> (matmul node, weight part, bias part)
    for i in range(len(g.nodes)):
        for c, (w, b) in (_mm_parts(g, i, consumers) or {}).items():
            parts[c] = (i, w, b)
    mba = DECOMPOSE_FUSED["fused_matmul_bias_act"]
    views: dict = {}

    def part(m, spec, axis, lookup):
        r, start, length = spec
        p = g.nodes[r[0]]
        if start == 0 and length == p.outs[0].dims[axis]:
            return lookup(r)
        if (r, start, length) not in views:
            dims = list(p.outs[0].dims)
            dims[axis] = length
            views[(r, start, length)] = m.add(
                "param", (), _leaf_name=f"{p.name}[{start}:{start + length}]",
                **dict(p.a, shape=tuple(dims), shard=(p.name, axis, start, length, length)))
        return views[(r, start, length)]

    def replace(m, node, ins, i, lookup):
        if i in parts:
            j, w, b = parts[i]
            mm = g.nodes[j]
            tb = mm.a["trans_b"]
            ws = (lookup(mm.inputs[0]), part(m, w, 0 if tb else 1, lookup))
            if b is not None:
                ws += (part(m, b, 0, lookup),)
            return mba(m, ws, {"trans_b": tb, "act": mm.a.get("act", "identity")})
        if node.op == "fused_matmul_bias_act":
            return mba(m, ins, node.a)
        return None

    return dce(rewrite(g, replace))


class _Lazy:
    """A leaf input not emitted yet; `shape` is all rules look at before choosing a slice."""
    def __init__(self, s: "_Sharder", ref):
        self.shape = s.g.shape_of(ref)


class _Sharder:
    def __init__(self, g: Graph, world: int, rank: int, log: list | None = None):
        self.g, self.world, self.rank = g, world, rank
        self.log = log if log is not None else []     # why a node that could shard runs replicated
        self.consumers = g.consumers()
        self.lookups: dict = {}      # dequantize node -> its packed lookup's vocab-parallel rows
        self.m = Builder(g.name, g.level)
        self.m.constants = dict(g.constants)
        self.vals: dict = {}         # old ref -> (new Value, Split | None)
        self.leaf_cache: dict = {}   # (old id, slice key) -> new Value
        self.full_cache: dict = {}
        self.demands, self.state_splits = head_demands(g, world, rank)

    # -- leaves
    def leaf(self, i: int, sl: Split | None = None):
        """Leaf node i whole, or (params, states) this rank's slice `sl` of it."""
        key = (i, sl)
        if key in self.leaf_cache:
            return self.leaf_cache[key]
        n = self.g.nodes[i]
        a = n.a
        if sl is None:
            v = self.m.emit_node(n)
        else:
            dims = list(n.outs[0].dims)
            dims[sl.axis] = sl.length
            if n.op == "param":
                real = max(0, min(sl.length, sl.real - sl.start))
                name = n.name if not any(k[0] == i for k in self.leaf_cache) else \
                    f"{n.name}@tp{sl.axis}.{sl.start}"
                src, off = n.name, 0
                if a.get("shard"):             # a part of a weight (unfuse_matmuls): of that weight
                    src, axis, off = a["shard"][:3]
                    if axis != sl.axis:
                        raise GraphError(f"tensor parallel: param {n.name!r} is a slice of {src!r} on axis "
                                         f"{axis}; the pass cannot split it on axis {sl.axis} too")
                a = dict(a, shape=tuple(dims), shard=(src, sl.axis, off + sl.start, real, sl.length))
                v = self.m.add("param", (), _leaf_name=name, **a)
            else:
                v = self.m.add(n.op, (), _leaf_name=n.name, **dict(a, shape=tuple(dims)))
        self.leaf_cache[key] = v
        return v

    def emit(self, op_name, ins, /, **a):
        return self.m.add(op_name, tuple(ins), **a)

    def group(self) -> dict:
        return {"world": self.world, "rank": self.rank}

    def even(self, sp: Split) -> bool:
        return sp.start == self.rank * sp.length and sp.total == self.world * sp.length

    # -- values
    def get(self, ref):
        ref = tuple(ref)
        if ref not in self.vals:                       # a leaf, emitted at its first use
            self.vals[ref] = (self.leaf(ref[0]), None)
        return self.vals[ref]

    def full(self, ref, at: int):
        """The whole value of `ref` (gathered when split), for node `at`."""
        ref = tuple(ref)
        v, sp = self.get(ref)
        if sp is None:
            return v
        if ref not in self.full_cache:
            if not self.even(sp):
                n = self.g.nodes[at] if at >= 0 else None
                what = f"node %{at} ({n.op})" if n else "a graph output"
                raise GraphError(f"tensor parallel: {what} needs the whole of %{ref[0]} "
                                 f"({self.g.nodes[ref[0]].op}), which ranks hold overlapping parts of "
                                 f"(kv heads shared by ranks); the pass cannot shard this graph")
            out = self.emit("all_gather", [v], axis=sp.axis, **self.group())
            if sp.real != sp.total:
                out = self.emit("narrow", [out], axis=sp.axis, start=0, length=sp.real)
            self.full_cache[ref] = out
        return self.full_cache[ref]

    def replicated(self, i: int, n: Node):
        ins = [self.full(r, i) for r in n.inputs]
        outs = infer(n.op, [v.shape for v in ins], n.a)
        return self.m.emit_node(Node(n.op, tuple(v.ref for v in ins), n.attrs, tuple(outs), n.name))

    # -- the walk
    def run(self) -> Graph:
        g = self.g
        for i, n in enumerate(g.nodes):
            if n.op == "input":
                self.vals[(i, 0)] = (self.leaf(i), None)
        for i, n in enumerate(g.nodes):
            if get_op(n.op).level.value == "leaf":
                continue
            if n.op in COLLECTIVES:
                raise GraphError(f"tensor parallel: node %{i} ({n.op}): the graph is sharded already")
            res = self.rule(i, n)
            if res is None:
                res = (self.replicated(i, n), None)
            v, sp = res
            vs = v if isinstance(v, tuple) else (v,)
            for k, x in enumerate(vs):
                self.vals[(i, k)] = (x, sp if k == 0 or n.op != "topk" else sp)
        self.m.outputs = [(name, self.full(r, -1).ref) for name, r in g.outputs]
        used = {k[0] for k in self.leaf_cache}
        parted = {n.a["shard"][0] for n in g.nodes if n.op == "param" and n.a.get("shard")}
        for i, n in enumerate(g.nodes):             # leaves nothing reads keep the binding contract
            if n.op in ("param", "state") and i not in used and n.name not in parted \
                    and not any(r[0] == i for x in g.nodes for r in x.inputs):
                self.leaf(i)
        return leaves_first(self.m.build())

    def split_ins(self, n: Node):
        """(ref, value, Split) of each input; a leaf not yet emitted is a _Lazy value (a
        weight is emitted whole only where whole is what is read)."""
        return [(tuple(r), *self.vals[tuple(r)]) if tuple(r) in self.vals else (tuple(r), _Lazy(self, r), None)
                for r in n.inputs]

    def rule(self, i: int, n: Node):
        """(value(s), Split | None) of node i on this rank, or None: run it replicated."""
        ins = self.split_ins(n)
        splits = [sp for _, _, sp in ins if sp is not None]
        op = n.op
        if op == "matmul":
            return self.matmul(i, n, ins)
        if op == "dequant_matmul":
            return self.dequant_matmul(i, n, ins)
        if i in self.lookups:
            return self.lookups.pop(i), None
        if op == "gather":
            return self.gather(i, n, ins)
        if op == "kv_write":
            return self.kv_write(i, n, ins)
        if not splits:
            ins_v = [self.get(r)[0] for r, _, _ in ins]
            outs = infer(op, [v.shape for v in ins_v], n.a)
            return self.m.emit_node(Node(op, tuple(v.ref for v in ins_v), n.attrs, tuple(outs), n.name)), None
        if op in ATTENTION:
            return self.attention(i, n, ins)
        d = get_op(op)
        if d.elementwise:
            return self.elementwise(i, n, ins)
        sp = ins[0][2]
        if sp is None or any(s is not None for _, _, s in ins[1:]):
            return None
        x = ins[0][1]
        rest = [self.full(r, i) for r in n.inputs[1:]]   # (norm weights, RoPE tables: whole)
        rank = n.inputs and self.g.shape_of(n.inputs[0]).rank
        a = n.a
        if op == "transpose":
            return self.emit(op, [x], **a), attrs.evolve(sp, axis=a["perm"].index(sp.axis))
        if op == "reshape":
            if sp.real != sp.total:
                return None
            src, dst = self.g.shape_of(n.inputs[0]).dims, n.outs[0].dims
            fwd = _reshape_fwd(src, dst, sp.axis, sp.sel())
            if fwd is None:
                return None
            ax, num, den = fwd
            nsp = sp.moved(ax, num, den)
            shape = list(dst)
            shape[ax] = nsp.length
            return self.emit(op, [x], shape=tuple(shape)), nsp
        if op in ("rms_norm", "layer_norm"):
            return (self.emit(op, [x, *rest], **a), sp) if sp.axis != rank - 1 else None
        if op in ("softmax", "cumsum"):
            return (self.emit(op, [x], **a), sp) if norm_axis(a["axis"], rank, op) != sp.axis else None
        if op == "rope":
            return (self.emit(op, [x, *rest], **a), sp) if sp.axis < 2 else None
        if op == "narrow":
            return (self.emit(op, [x], **a), sp) if norm_axis(a["axis"], rank, op) != sp.axis else None
        if op in ("reduce", "argmax"):
            axes = a["axes"] if op == "reduce" else a["axis"]
            axes = {norm_axis(x_, rank, op) for x_ in ((axes,) if isinstance(axes, int) else axes)}
            if sp.axis in axes:
                return None
            ax = sp.axis if a["keepdims"] else sp.axis - sum(1 for x_ in axes if x_ < sp.axis)
            return self.emit(op, [x], **a), attrs.evolve(sp, axis=ax)
        return None

    def elementwise(self, i: int, n: Node, ins):
        out = n.outs[0]
        key = None
        for r, v, sp in ins:
            if sp is not None:
                k = (sp.axis + out.rank - v.shape.rank, sp)
                if key is not None and (key[0], key[1].sel()) != (k[0], k[1].sel()):
                    return None
                key = key or k
        ax, sp = key
        local = []
        for r, v, s in ins:
            if s is None:
                off = ax - (out.rank - v.shape.rank)
                d = v.shape.dims[off] if off >= 0 else 1
                if d != 1 and isinstance(v, _Lazy) and self.g.nodes[r[0]].op == "param" and d == sp.real:
                    v = self.leaf(r[0], attrs.evolve(sp, axis=off))      # a bias: its slice
                elif d != 1:
                    if d != sp.total or sp.total != sp.real:
                        return None
                    v = self.emit("narrow", [self.get(r)[0]], axis=off, start=sp.start, length=sp.length)
                else:
                    v = self.get(r)[0]
            local.append(v)
        return self.emit(n.op, local, **n.a), attrs.evolve(sp, axis=ax)

    def matmul(self, i: int, n: Node, ins):
        (ra, a, sa), (rb, b, sb) = ins
        g = self.g
        w = _weight(g, rb)
        tb, rank = n.a["trans_b"], n.outs[0].rank
        if w is None or sb is not None or n.a["trans_a"]:
            return None
        wn = g.nodes[w].outs[0].dims
        if sa is None:                                  # column-parallel
            a = self.get(ra)[0]
            nax = 0 if tb else 1
            big = wn[nax]
            sel = self.demands.get(i) or self.even_sel(big)
            if sel is None:
                return None
            sp = Split(nax, sel[0], sel[1], sel[2], big)
            y = self.emit("matmul", [a, self.leaf(w, sp)], **n.a)
            return y, Split(rank - 1, sel[0], sel[1], sel[2], big)
        if sa.axis == a.shape.rank - 1 and sa.real == sa.total:     # row-parallel
            kax = 1 if tb else 0
            y = self.emit("matmul", [a, self.leaf(w, attrs.evolve(sa, axis=kax))], **n.a)
            return self.emit("all_reduce", [y], **self.group()), None
        return None

    def even_sel(self, rows: int):
        """(start, length, total) of this rank's rows of `rows` split evenly (the last ranks'
        zero-padded), or None when there are fewer rows than ranks."""
        if not isinstance(rows, int) or rows < self.world:
            return None
        length = -(-rows // self.world)
        return self.rank * length, length, length * self.world

    def dequant_matmul(self, i: int, n: Node, ins):
        """x @ W^T on packed W: column-parallel (whole packed rows, a bias its slice) for a
        replicated x; row-parallel (the bytes of whole blocks of every row, then all_reduce,
        bias and activation) for x split on K at the scheme's block boundaries."""
        (rx, x, sx), (rw, _, sw) = ins[:2]
        pw = _packed(self.g, rw)
        if pw is None or sw is not None or any(s is not None for _, _, s in ins[2:]):
            return None
        w, q = pw
        rows = self.g.nodes[w].outs[0].dims[0]
        if sx is None:                                  # column-parallel
            sel = self.demands.get(i) or self.even_sel(rows)
            if sel is None:
                return None
            sp = Split(0, *sel, rows)
            bias = [self.vec_part(n.inputs[2], sp)] if len(ins) > 2 else []
            if None in bias:
                return None
            y = self.emit("dequant_matmul", [self.get(rx)[0], self.leaf(w, sp), *bias], **n.a)
            return y, Split(n.outs[0].rank - 1, *sel, rows)
        if sx.axis != x.shape.rank - 1:
            return None
        if sx.start % q.block or sx.length % q.block or sx.real != sx.total:
            self.log.append(f"node %{i} (dequant_matmul): packed {q.name} weight "
                            f"{self.g.nodes[w].name!r} runs replicated: this rank's K slice "
                            f"[{sx.start}, {sx.start + sx.length}) of {sx.real} is not whole blocks "
                            f"of {q.block}")
            return None
        per = q.bytes_per_block
        sp = Split(1, *(v // q.block * per for v in (sx.start, sx.length, sx.total, sx.total)))
        y = self.emit("dequant_matmul", [x, self.leaf(w, sp)], scheme=n.a["scheme"])
        y = self.emit("all_reduce", [y], **self.group())
        if len(ins) > 2:
            y = self.emit("binary", [y, self.full(n.inputs[2], i)], op="add")
        act = n.a.get("act", "identity")
        return (y if act == "identity" else self.emit("activation", [y], fn=act)), None

    def vec_part(self, ref, sp: Split):
        """This rank's part `sp` (on axis 0) of a replicated 1-D value: a param's slice, else
        a narrow of it (None where it would need zero padding)."""
        if self.g.nodes[ref[0]].op == "param":
            return self.leaf(ref[0], sp)
        if sp.real != sp.total:
            return None
        return self.emit("narrow", [self.get(ref)[0]], axis=0, start=sp.start, length=sp.length)

    def gather(self, i: int, n: Node, ins):
        (rt, t, st), (ri, ids, si) = ins
        g = self.g
        ax = n.a["axis"] % max(1, t.shape.rank)
        if st is not None and si is None and st.axis != ax:     # rows of a split tensor (a ring cache)
            idx = self.get(ri)[0]
            out_axis = st.axis if st.axis < ax else st.axis + idx.shape.rank - 1
            return self.emit("gather", [t, idx], **n.a), attrs.evolve(st, axis=out_axis)
        ids = self.get(ri)[0]
        reader = self.lookup_reader(i, rt)
        if g.nodes[rt[0]].op != "param" or n.a["axis"] != 0 or si is not None or st is not None \
                or g.nodes[rt[0]].a.get("scheme") and reader is None:
            return None
        rows = g.nodes[rt[0]].outs[0].dims[0]
        sel = self.even_sel(rows)
        if sel is None:
            return None
        sp = Split(0, *sel, rows)
        table = self.leaf(rt[0], sp)
        real = max(0, min(sp.length, rows - sp.start))
        m, idt = self.m, ids.dtype
        lo = m.constant(np.asarray(sp.start, idt.np))
        hi = m.constant(np.asarray(sp.start + real, idt.np))
        inside = self.emit("where", [self.emit("compare", [ids, lo], op="ge"),
                                     self.emit("compare", [ids, hi], op="lt"),
                                     m.constant(np.asarray(False))])
        local = self.emit("where", [inside, self.emit("binary", [ids, lo], op="sub"),
                                    m.constant(np.asarray(0, idt.np))])
        got = packed_rows = self.emit("gather", [table, local], axis=0)
        if reader is not None:         # (the sum is of floats: the reader's dequantize comes first)
            got = self.emit("dequantize", [packed_rows], **g.nodes[reader].a)
        keep = self.emit("reshape", [inside], shape=tuple(ids.shape.dims) + (1,) * (table.shape.rank - 1))
        zero = m.constant(np.asarray(0, got.dtype.np))
        out = self.emit("all_reduce", [self.emit("where", [keep, got, zero])], **self.group())
        if reader is None:
            return out, None
        self.lookups[reader] = out      # the reader's value; the local rows are read by nothing else
        return packed_rows, None

    def lookup_reader(self, i: int, table_ref):
        """The dequantize node that alone reads packed lookup node i (passes/packed.py's
        gather of packed rows), else None."""
        readers = self.consumers.get((i, 0), [])
        if _packed(self.g, table_ref) is None or len(readers) != 1 or readers[0] < 0 \
                or self.g.nodes[readers[0]].op != "dequantize":
            return None
        return readers[0]

    def kv_write(self, i: int, n: Node, ins):
        (rc, c, sc), (rn, new, sn), (rp, pos, sp_) = ins
        cache = self.g.nodes[rc[0]]
        if sn is None:
            return None
        want = self.state_splits.setdefault(rc[0], sn)   # (a prefill's attention reads k, not the cache)
        if cache.op != "state" or sc is not None or sp_ is not None \
                or (want.axis, want.sel()) != (sn.axis, sn.sel()):
            raise GraphError(f"tensor parallel: node %{i} (kv_write): its new rows are split on "
                             f"axis {sn.axis} but the cache %{rc[0]} cannot hold that split")
        state = self.leaf(rc[0], want)
        pos = self.get(rp)[0]
        self.vals[tuple(rc)] = (state, want)
        return self.emit("kv_write", [state, new, pos], **n.a), sn

    def attention(self, i: int, n: Node, ins):
        (_, q, sq), (_, k, sk), (_, v, sv) = ins[:3]
        where = f"node %{i} ({n.op})"
        if sq is None or sk is None or sv is None or sq.axis != 1 or sk.axis != 1 \
                or (sk.axis, sk.sel()) != (sv.axis, sv.sel()):
            raise GraphError(f"tensor parallel: {where}: q, k and v must all be split on heads; "
                             f"got {sq}, {sk}, {sv}")
        group = sq.real // sk.real
        per = sq.length // sk.length
        if any((sq.start + j) // group - sk.start != j // per for j in range(sq.length)):
            raise GraphError(f"tensor parallel: {where}: query heads {sq.start}..{sq.start + sq.length - 1} "
                             f"do not read kv heads {sk.start}..{sk.start + sk.length - 1}")
        rest = []
        for r, x, s in ins[3:]:
            x = self.full(r, i)
            if x.shape.rank == 4 and x.shape.dims[1] == sq.total:      # a per-head mask or bias
                x = self.emit("narrow", [x], axis=1, start=sq.start, length=sq.length)
            rest.append(x)
        return self.emit(n.op, [q, k, v, *rest], **n.a), sq


def shard(g: Graph, world: int, rank: int, log: list | None = None) -> Graph:
    """Rank `rank`'s part of MIR `g` over `world` ranks (see the module doc). `log` gets a
    line for each packed matmul left replicated (its K slice not on whole blocks)."""
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise GraphError(f"tensor parallel: rank {rank!r} of a group of {world!r}")
    if world == 1:
        return g
    return _Sharder(unfuse_matmuls(g), world, rank, log).run()


_SLICES: dict = {}         # id(source weight) -> (weakref to it, {slice key: the rank's part})


def _part(w, axis: int, start: int, length: int, padded: int, contiguous: bool = False):
    """w's [start, start + length) along `axis`, zero-padded to `padded` (a copy where
    `contiguous` and the slice is strided): the same object for the same source and slice
    while the source lives, so the executables of one model (prefill, decode, ...) find it
    uploaded already (their shared params key on identity)."""
    import weakref

    ref, parts = _SLICES.get(id(w), (None, None))
    if ref is None or ref() is not w:
        try:
            ref = weakref.ref(w, lambda _, k=id(w): _SLICES.pop(k, None))
        except TypeError:                  # (not weakly referable: sliced on each call)
            ref = None
        parts = {}
        if ref is not None:
            _SLICES[id(w)] = (ref, parts)
    key = (axis, start, length, padded)
    if key not in parts:
        part = w[(slice(None),) * axis + (slice(start, start + length),)]
        part = np.ascontiguousarray(part) if contiguous else np.asarray(part)
        if padded != length:
            pad = [(0, 0)] * part.ndim
            pad[axis] = (0, padded - length)
            part = np.pad(part, pad)
        parts[key] = part
    return parts[key]


def _packed_part(src: str, w: PackedTensor, axis: int, start: int, length: int, padded: int) -> PackedTensor:
    """A packed weight's slice of its bytes (rows, or bytes of whole blocks of each row) as
    the PackedTensor of the logical rows and columns it holds."""
    s = w.scheme
    if axis not in (0, 1) or axis == 1 and (start % s.bytes_per_block or length % s.bytes_per_block
                                             or padded != length):
        raise ModelError(f"param {src!r}: a tensor-parallel slice of a packed {s.name} weight is "
                         f"whole rows or the bytes of whole blocks ({s.bytes_per_block} bytes) of each "
                         f"row; got [{start}, {start + length}) padded to {padded} on axis {axis}")
    raw = _part(w.raw, axis, start, length, padded, contiguous=True)    # (kernels read whole rows)
    return PackedTensor(raw, s, (raw.shape[0], raw.shape[1] // s.bytes_per_block * s.block), w.name)


def bind_slices(nodes, params: dict) -> dict:
    """The params a sharded graph binds, from the whole weights: each param node with a
    `shard` attr takes its slice (a view of a memory-mapped weight where the axis allows;
    an array-like weight is asked for that part only), zero-padded to the rank's length (a
    packed weight: of its bytes, rows or whole blocks of each row; zero bytes decode to
    zeros); one without binds its weight whole. Weights no node reads pass through."""
    out, used = {}, set()
    for n in nodes:
        if n.op != "param":
            continue
        if not n.a.get("shard"):
            if n.name in params:
                out[n.name] = params[n.name]
            continue
        src, axis, start, length, padded = n.a["shard"]
        if src not in params:
            continue
        used.add(src)
        w = params[src]
        if isinstance(w, PackedTensor) and n.a.get("scheme"):
            out[n.name] = _packed_part(src, w, axis, start, length, padded)
            continue
        if not hasattr(w, "shape") or getattr(w, "ndim", 0) <= axis:
            raise ModelError(f"param {src!r}: cannot take a tensor-parallel slice on axis {axis} of "
                             f"{type(w).__name__}")
        out[n.name] = _part(w, axis, start, length, padded)
    for k, v in params.items():
        if k not in used and k not in out:
            out[k] = v
    return out


__all__ = ["Split", "shard", "bind_slices", "head_demands", "reshape_groups", "unfuse_matmuls"]
