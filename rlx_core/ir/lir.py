"""LIR: an MIR graph with static shapes plus a buffer plan — what a backend compiles.

The plan gives every value a home: a graph input, a resident param/state/constant, a view
of another value (reshape, narrow, expand, kv_write, and the nodes a backend reads through
strides: `plan(g, views=...)`), a part of a concat's output its producer writes in place
(`placed`), or a slice of one arena. Arena slices
come from lifetimes (definition to last use) placed greedily by size, TFLite-style; an
elementwise op may write over an input that dies at it (in-place reuse).
"""
from __future__ import annotations

import json

import attrs

from .errors import GraphError
from .graph import Graph
from .ops import get_op
from .quant import QuantScheme

ALIGN = 64
LEAF_HOMES = {"input": "input", "param": "param", "state": "state", "constant": "const"}


def packed_logical(scheme: str, dims: tuple) -> tuple:
    """The logical [N, K] of packed bytes [N, bytes per row]."""
    q = QuantScheme.parse(scheme)
    return (dims[0], dims[1] // q.bytes_per_block * q.block_size)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@attrs.frozen
class Slot:
    home: str              # input | param | state | const | arena | view | placed
    offset: int = 0        # arena byte offset (arena)
    nbytes: int = 0
    base: tuple | None = None   # the value this one views (view), lives in (placed) or reuses (arena in place)
    start: int = 0         # lifetime in node indices (arena values)
    end: int = 0


@attrs.frozen
class ManifestEntry:
    name: str
    kind: str              # input | param | state | output
    dtype: str
    shape: tuple
    nbytes: int
    offset: int            # arena offset for outputs, packed offset for params, 0 otherwise
    scheme: str = ""       # a packed param: its quant scheme (dtype u8, shape [rows, bytes])
    logical: tuple = ()    # a packed param: the weight's shape, [N, K]


def param_group(name: str) -> str:
    """A param's group: 'model.layers.3.mlp.up_proj.weight' -> 'model.layers.3' (up to the
    first numeric part: 'blk.3.*' -> 'blk.3'); others by their first part."""
    parts = name.split(".")
    num = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
    return ".".join(parts[:num + 1]) if num else parts[0]


@attrs.frozen
class BindingManifest:
    entries: tuple

    def of(self, kind: str) -> list:
        return [e for e in self.entries if e.kind == kind]

    def param_groups(self) -> dict:
        """Param names by `param_group`."""
        groups: dict = {}
        for e in self.of("param"):
            groups.setdefault(param_group(e.name), []).append(e.name)
        return groups

    def text(self) -> str:
        lines = [f"  {e.kind:<6} {e.name:<48} {e.dtype}{list(e.shape)} {e.nbytes}B @{e.offset}"
                 + (f" packed {e.scheme} of {list(e.logical)}" if e.scheme else "")
                 for e in self.entries]
        return "\n".join(lines)


@attrs.frozen(eq=False)
class LirModule:
    graph: Graph
    slots: dict                 # (node, out) -> Slot
    arena_bytes: int
    lower_bound: int            # max over time of live arena bytes (liveness lower bound)
    manifest: BindingManifest
    level: str = "lir"

    def slot_text(self, i: int) -> str:
        """Where node i's outputs live: 'arena[off:+n]' (' inplace(%j)'), 'view(%j)', or the
        home of a leaf."""
        parts = []
        for k in range(len(self.graph.nodes[i].outs)):
            s = self.slots[(i, k)]
            if s.home == "arena":
                tag = f"arena[{s.offset}:+{s.nbytes}]"
                if s.base is not None:
                    tag += f" inplace(%{s.base[0]})"
                parts.append(tag)
            elif s.home in ("view", "placed"):
                parts.append(f"{s.home}(%{s.base[0]})")
            else:
                parts.append(s.home)
        return " ".join(parts)

    def text(self) -> str:
        from .printer import graph_text

        head = f"lir {self.graph.name}: arena {self.arena_bytes} B (liveness bound {self.lower_bound} B)"
        body = graph_text(self.graph.with_level("lir"), lambda i: "    # " + self.slot_text(i))
        return f"{head}\n{body}\nmanifest:\n{self.manifest.text()}"

    __str__ = text

    def to_json(self) -> str:
        d = self.graph.to_dict()
        d["level"] = "lir"
        d["plan"] = [[list(k), attrs.asdict(s, recurse=False) | {"base": list(s.base) if s.base else None}]
                     for k, s in sorted(self.slots.items())]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _sole_chain(uses: dict, slots: dict, r: tuple, own: tuple, reader: int) -> bool:
    """Whether `reader` alone reads r, and each value from r back through views to its owner
    `own` is read only by the next."""
    while uses.get(r) == [reader]:
        if r == own:
            return True
        reader, r = r[0], slots[r].base
    return False


def plan(g: Graph, views: frozenset = frozenset(), placed: frozenset = frozenset(),
         early: frozenset = frozenset()) -> LirModule:
    """Plan buffers for a static MIR graph. The backend's layouts (Backend.planned_layouts):
    `views` are nodes (a transpose) it runs as views of their first input, whose bytes then
    live as long as the view is read; `placed` are (concat node, input index) pairs whose
    input it has the producer write straight into the concat's output: where that input's
    own value is read by nothing else (through views), it gets home 'placed' and no bytes;
    `early` are nodes whose output the kernel of their first input's producer may write (an
    elementwise reader computed in a reduction's store): those bytes live from that node on."""
    _check_static(g)
    slots, root = _homes(g, views)
    begin = _place_concat_inputs(g, placed, slots, root)
    for u in early:
        if slots.get((u, 0), 1) is None:
            begin[(u, 0)] = min(begin.get((u, 0), u), g.nodes[u].inputs[0][0])
    end = _lifetimes(g, slots, root)
    inplace = _in_place(g, slots, root, end)
    owner, buffers = _buffers(end, inplace, begin)
    sizes = {o: _align(g.shape_of(o).nbytes()) for o in buffers}
    offsets, arena = _lay_out(buffers, sizes)
    for v in end:
        slots[v] = Slot("arena", offsets[owner[v]], g.shape_of(v).nbytes(),
                        base=inplace.get(v), start=begin.get(v, v[0]), end=end[v])
    return LirModule(g.with_level("mir"), slots, arena, _liveness_bound(buffers, sizes, len(g.nodes)),
                     _manifest(g, slots))


def _check_static(g: Graph) -> None:
    for i, n in enumerate(g.nodes):
        for s in n.outs:
            if not s.is_static:
                raise GraphError(f"plan: node %{i} ({n.op}) has unbound dims {sorted(s.symbols)}; "
                                 "bind all dims before planning")


def _homes(g: Graph, views: frozenset) -> tuple:
    """(slots, root): the Slot of every leaf (its LEAF_HOMES home) and view (of its base);
    None for the values the arena will hold. root: value -> the value owning its memory
    (a view's is its base's)."""
    slots: dict = {}
    root: dict = {}
    for i, n in enumerate(g.nodes):
        d = get_op(n.op)
        if n.op in LEAF_HOMES:
            slots[(i, 0)] = Slot(LEAF_HOMES[n.op], nbytes=n.outs[0].nbytes())
            root[(i, 0)] = (i, 0)
            continue
        if d.view_of is not None or i in views:
            base = tuple(n.inputs[d.view_of or 0])
            slots[(i, 0)] = Slot("view", nbytes=n.outs[0].nbytes(), base=base)
            root[(i, 0)] = root[base]
            continue
        for k, s in enumerate(n.outs):
            slots[(i, k)] = None
            root[(i, k)] = (i, k)
    return slots, root


def _place_concat_inputs(g: Graph, placed: frozenset, slots: dict, root: dict) -> dict:
    """Give each `placed` concat input whose owner is an arena value read (through views)
    only by the concat the home 'placed' in the concat's output, re-rooting its views there.
    Returns begin: the concat outputs' births, moved back to their first placed producer."""
    begin: dict = {}
    uses = g.consumers()
    for c, k in sorted(placed):
        r = tuple(g.nodes[c].inputs[k])
        own = root[r]
        if (g.nodes[c].op != "concat" or slots.get(own, 1) is not None or slots[(c, 0)] is not None
                or not _sole_chain(uses, slots, r, own, c)):
            continue
        slots[own] = Slot("placed", nbytes=g.shape_of(own).nbytes(), base=(c, 0))
        for v, o in root.items():
            if o == own:
                root[v] = (c, 0)
        begin[(c, 0)] = min(begin.get((c, 0), c), own[0])
    return begin


def _last_uses(g: Graph) -> dict:
    """value -> index of the last node reading it (graph outputs: len(nodes), the end)."""
    last_use: dict = {}
    for i, n in enumerate(g.nodes):
        for r in n.inputs:
            last_use[tuple(r)] = i
    for _, r in g.outputs:
        last_use[tuple(r)] = len(g.nodes)
    return last_use


def _lifetimes(g: Graph, slots: dict, root: dict) -> dict:
    """The last node of each arena value's life: its own last use, extended by the last use of
    any view of it."""
    last_use = _last_uses(g)
    end: dict = {}
    for v, r in root.items():
        if slots[r] is None:
            end[r] = max(end.get(r, r[0]), last_use.get(v, r[0]))
    return end


def _in_place(g: Graph, slots: dict, root: dict, end: dict) -> dict:
    """value -> the arena input it overwrites: an elementwise op may take over an input of its
    shape that dies at it (read once by it, not through a view, not taken already)."""
    inplace: dict = {}
    taken: set = set()
    for i, n in enumerate(g.nodes):
        d = get_op(n.op)
        if not d.elementwise or len(n.outs) != 1 or slots[(i, 0)] is not None:
            continue
        roots = [root[tuple(r)] for r in n.inputs]
        for r in n.inputs:
            src = root[tuple(r)]
            if (slots.get(src, 1) is None and src not in taken and end[src] == i
                    and tuple(r) == src and g.shape_of(src) == n.outs[0] and roots.count(src) == 1):
                inplace[(i, 0)] = src
                taken.add(src)
                break
    return inplace


def _buffers(end: dict, inplace: dict, begin: dict) -> tuple:
    """(owner, buffers): in-place chains merged into one buffer each, named by the chain's first
    value (owner: value -> it), living over the union of their lifetimes (buffers: owner ->
    (start, end))."""
    def first(v):
        while v in inplace:
            v = inplace[v]
        return v

    owner: dict = {}
    buffers: dict = {}
    for v in end:
        o = first(v)
        owner[v] = o
        s, e = buffers.get(o, (v[0], end[v]))
        buffers[o] = (min(s, begin.get(v, v[0])), max(e, end[v]))
    return owner, buffers


def _lay_out(buffers: dict, sizes: dict) -> tuple:
    """(offsets, arena bytes): buffers placed largest first (then earliest) at the lowest
    offset clear of every placed buffer whose lifetime overlaps theirs (greedy by size)."""
    laid: list = []                          # (offset, size, start, end) of the buffers placed so far
    offsets: dict = {}
    for o in sorted(buffers, key=lambda o: (-sizes[o], buffers[o][0])):
        s, e = buffers[o]
        size = sizes[o]
        conflicts = sorted((off, sz) for off, sz, ps, pe in laid if not (pe < s or e < ps))
        off = 0
        for coff, csz in conflicts:
            if off + size <= coff:
                break
            off = max(off, coff + csz)
        offsets[o] = off
        laid.append((off, size, s, e))
    return offsets, max((off + sz for off, sz, _, _ in laid), default=0)


def _liveness_bound(buffers: dict, sizes: dict, n_nodes: int) -> int:
    """The most buffer bytes live at once: no plan's arena can be smaller."""
    events = [0] * (n_nodes + 2)
    for o, (s, e) in buffers.items():
        events[s] += sizes[o]
        events[e + 1] -= sizes[o]
    bound, cur = 0, 0
    for x in events:
        cur += x
        bound = max(bound, cur)
    return bound


def _manifest(g: Graph, slots: dict) -> BindingManifest:
    """What a runner binds: inputs, params (packed one after another, aligned), states, and
    outputs (at their arena offsets)."""
    entries = []
    off = 0
    for kind in ("input", "param", "state"):
        for name, i in getattr(g, kind + "s").items():
            s = g.nodes[i].outs[0]
            scheme = g.nodes[i].a.get("scheme", "") if kind == "param" else ""
            logical = packed_logical(scheme, s.dims) if scheme else ()
            entries.append(ManifestEntry(name, kind, s.dtype.value, s.dims, s.nbytes(),
                                         off if kind == "param" else 0, scheme, logical))
            if kind == "param":
                off += _align(s.nbytes())
    for name, r in g.outputs:
        s = g.shape_of(r)
        sl = slots[tuple(r)]
        entries.append(ManifestEntry(name, "output", s.dtype.value, s.dims, s.nbytes(),
                                     sl.offset if sl.home == "arena" else 0))
    return BindingManifest(tuple(entries))
