"""The LIR buffer planner: no two live values share arena bytes, dead bytes can be trashed
without changing results, in-place reuse and views, arena size against the liveness
bound, and the binding manifest."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import rlx_core
from graphs import SEQ, Cfg, bert, build, inputs_for, llama, llama_inputs, programs, random_params
from rlx_core.backends.numpy import NumpyRunner
from rlx_core.ir.graph import Builder
from rlx_core.ir.lir import ALIGN, plan
from rlx_core.ir.ops import get_op
from rlx_core.pipeline import CompilePipeline, specialize
from rlx_core.profile import CompileProfile


# ----------------------------------------------------------------------------- independent liveness
def lifetimes(lir, early: frozenset = frozenset()) -> dict:
    """value -> (birth, end) for every value owning memory, from the graph and the backend's
    layouts alone (which nodes it runs as views, which values it places in a concat's output,
    which it writes early, in its input's producer): a buffer lives from its first writer to
    the last use of anything living in it; graph outputs live to len(nodes)."""
    g = lir.graph
    owner: dict = {}
    for i, n in enumerate(g.nodes):
        for k in range(len(n.outs)):
            s = lir.slots[(i, k)]
            owner[(i, k)] = (s.base if s.home == "placed" else
                             owner[s.base] if s.home == "view" else (i, k))
    life: dict = {}
    for v, o in owner.items():
        b, e = life.get(o, (o[0], o[0]))
        life[o] = (min(b, g.nodes[v[0]].inputs[0][0] if v[0] in early else v[0]), e)
    for i, n in enumerate(g.nodes):
        for r in n.inputs:
            o = owner[tuple(r)]
            life[o] = (life[o][0], max(life[o][1], i))
    for _, r in g.outputs:
        o = owner[tuple(r)]
        life[o] = (life[o][0], len(g.nodes))
    return life


def arena_values(lir) -> dict:
    return {v: s for v, s in lir.slots.items() if s.home == "arena"}


def assert_no_overlap(lir, early: frozenset = frozenset()) -> None:
    """Values whose lifetimes overlap never share a byte, unless one is an in-place
    successor of the other that takes over its buffer at the node where it dies."""
    life = lifetimes(lir, early)
    vals = arena_values(lir)
    for v, s in vals.items():
        assert s.offset % ALIGN == 0, f"{v} at unaligned offset {s.offset}"
        assert s.offset + s.nbytes <= lir.arena_bytes, f"{v} runs past the arena"
        assert s.nbytes == lir.graph.shape_of(v).nbytes()
    items = sorted(vals.items())
    for a, (u, su) in enumerate(items):
        lu = life[u]
        for v, sv in items[a + 1:]:
            lv = life[v]
            if lu[1] < lv[0] or lv[1] < lu[0]:
                continue                                    # never alive together
            if su.offset + su.nbytes <= sv.offset or sv.offset + sv.nbytes <= su.offset:
                continue                                    # disjoint bytes
            if sv.base == u and lu[1] == lv[0] and su.offset == sv.offset:
                assert get_op(lir.graph.nodes[v[0]].op).elementwise
                continue                                    # in place: u dies where v is born
            raise AssertionError(f"%{u[0]}:{u[1]} {lu} and %{v[0]}:{v[1]} {lv} are live together but "
                                 f"share arena bytes [{su.offset}, +{su.nbytes}) / "
                                 f"[{sv.offset}, +{sv.nbytes})")


def liveness_bound(lir, early: frozenset = frozenset()) -> int:
    """max over nodes of the aligned bytes that must coexist (in-place chains are one buffer)."""
    life = lifetimes(lir, early)
    vals = arena_values(lir)
    root = {}
    for v in sorted(vals):
        b = vals[v].base
        root[v] = root.get(b, b) if b is not None else v
    span: dict = {}
    for v, r in root.items():
        s, e = span.get(r, life[v])
        span[r] = (min(s, life[v][0]), max(e, life[v][1]))
    n = len(lir.graph.nodes) + 2
    cur = [0] * n
    for r, (s, e) in span.items():
        size = (lir.graph.shape_of(r).nbytes() + ALIGN - 1) // ALIGN * ALIGN
        for t in range(s, e + 1):
            cur[t] += size
    return max(cur)


def _compiled(g, profile, params, env, backend="numpy"):
    exe = rlx_core.compile(g, profile=profile, params=params, backend=backend)
    return exe, exe.lir(**env)


MODELS = {
    "llama_fusable": (lambda: llama(), "fusable"),
    "llama_direct": (lambda: llama(), "default"),
    "llama_unfused": (lambda: llama(), CompileProfile.preset("fusable").evolve(
        fusion={"skip": True, "assert_clean": False})),
    "bert_fusable": (lambda: bert(), "fusable"),
    "bert_generic": (lambda: bert(), CompileProfile("g").evolve(fusion={"target": "generic"})),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_no_live_values_share_bytes(backend, rng, model):
    """On every backend here, with the views and placed concat parts its layouts ask for."""
    mk, prof = MODELS[model]
    g = mk()
    exe, lir = _compiled(g, prof, random_params(g, rng), {"seq": 7}, backend)
    early = exe.backend.planned_layouts(lir.graph)[2]
    assert_no_overlap(lir, early)
    assert lir.lower_bound == liveness_bound(lir, early)


# ----------------------------------------------------------------------------- trashing dead bytes
class TrashingRunner(NumpyRunner):
    """After every node, fills every arena byte that no live value owns with 0xFF (NaN):
    results must not change if the plan is right."""

    def __init__(self, lir, params, states):
        super().__init__(lir, params, states)
        life = lifetimes(lir)
        vals = arena_values(lir)
        self.trash = {}
        for step in self.steps:
            i = step[0]
            keep = np.zeros(lir.arena_bytes, bool)
            for v, s in vals.items():
                if life[v][0] <= i < life[v][1]:
                    keep[s.offset:s.offset + s.nbytes] = True
            self.trash[i] = ~keep
        self.trashed = 0

    def run(self, inputs: dict) -> dict:
        vals = self.vals
        for name, (slot, _) in self.inputs.items():
            vals[slot] = inputs[name]
        self.arena.fill(0xFF)
        for i, is_view, fn, a, ins, out in self.steps:
            if is_view:
                vals[out] = fn(a, *[vals[j] for j in ins])
            else:
                fn(a, out, *[vals[j] for j in ins])
            self.arena[self.trash[i]] = 0xFF
            self.trashed += int(self.trash[i].sum())
        return {name: np.array(vals[slot]) for name, slot in self.outputs}


def run_trashing(exe, inputs):
    env = exe._bind_dims(inputs)
    runner = exe.runner(env)
    lir = exe.lir_cache[tuple(sorted(env.items()))]
    exe._runners[tuple(sorted(env.items()))] = trash = TrashingRunner(lir, exe._params, exe.states)
    try:
        return exe.run(inputs), trash
    finally:
        exe._runners[tuple(sorted(env.items()))] = runner


@pytest.mark.parametrize("model", list(MODELS))
def test_trashing_dead_bytes_keeps_results(rng, model):
    mk, prof = MODELS[model]
    g = mk()
    exe = rlx_core.compile(g, profile=prof, params=random_params(g, rng), backend="numpy")
    inputs = llama_inputs(Cfg(), rng, 7, batch=1) if model.startswith("llama") else \
        {"x": rng.standard_normal((1, 7, 32)).astype(np.float32)}
    want = exe.run(inputs)
    got, runner = run_trashing(exe, inputs)
    assert runner.trashed > 0
    for k in want:
        assert np.isfinite(got[k]).all()
        np.testing.assert_array_equal(got[k], want[k])


_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(program=programs)
def test_random_graphs_plan_and_trash(program):
    g = build(program)
    rng = np.random.default_rng(abs(hash(repr(program))) % 2**32)
    for prof in ("fusable", CompileProfile("g").evolve(fusion={"target": "generic"})):
        exe = rlx_core.compile(g, profile=prof, params=random_params(g, rng), backend="numpy")
        inputs = inputs_for(g, rng)
        want = exe.run(inputs)
        assert_no_overlap(exe.lir(seq=SEQ))
        got, _ = run_trashing(exe, inputs)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


# ----------------------------------------------------------------------------- in place, views
def _chain_graph():
    m = Builder("chain", "mir")
    x = m.input("x", (4, 32))
    y = m.act(m.act(m.act(m.act(x, "exp"), "tanh"), "neg"), "sigmoid")
    m.output("y", y * 2.0)
    return m.build()


def test_in_place_reuse_for_an_elementwise_chain():
    g = _chain_graph()
    lir = plan(g)
    chain = [i for i, n in enumerate(g.nodes) if n.op in ("activation", "binary")]
    first = lir.slots[(chain[0], 0)]
    assert first.home == "arena" and first.base is None          # exp reads the input: no reuse
    for prev, i in zip(chain, chain[1:]):
        s = lir.slots[(i, 0)]
        assert s.base == (prev, 0), lir.text()
        assert s.offset == first.offset
    assert lir.arena_bytes == 4 * 32 * 4                         # one buffer for the whole chain
    assert "inplace(" in lir.text()
    assert_no_overlap(lir)
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    got = rlx_core.compile(g, profile="default", backend="numpy").run(x=x)["y"]
    np.testing.assert_allclose(got, 2.0 / (1.0 + np.exp(np.tanh(np.exp(x)))), rtol=1e-6)


def test_views_take_no_arena():
    m = Builder("views", "mir")
    x = m.input("x", (2, 6, 8))
    y = m.act(x, "tanh")                                           # 384 B in the arena
    r = m.reshape(y, (12, 8))
    n = m.narrow(r, 0, 2, 5)
    e = m.expand(m.reshape(m.narrow(n, 1, 0, 1), (5, 1)), (5, 3))
    m.output("n", n)
    m.output("e", e)
    g = m.build()
    lir = plan(g)
    for i, node in enumerate(g.nodes):
        if node.op in ("reshape", "narrow", "expand"):
            s = lir.slots[(i, 0)]
            assert s.home == "view" and s.base is not None, lir.text()
    assert lir.arena_bytes == 2 * 6 * 8 * 4
    x_ = np.random.default_rng(0).standard_normal((2, 6, 8)).astype(np.float32)
    out = rlx_core.compile(g, profile="default", backend="numpy").run(x=x_)
    np.testing.assert_allclose(out["n"], np.tanh(x_).reshape(12, 8)[2:7], rtol=1e-6)
    np.testing.assert_allclose(out["e"], np.broadcast_to(np.tanh(x_).reshape(12, 8)[2:7, :1], (5, 3)),
                               rtol=1e-6)


def test_a_backend_view_keeps_its_input_alive():
    """A node the backend names in plan's `views` takes no arena: its input's bytes live until
    the view's last reader, so nothing planned in between may reuse them."""
    m = Builder("backend_views", "mir")
    x = m.input("x", (2, 3, 4, 8))
    y = m.act(x, "tanh")
    t = m.transpose(y, (0, 2, 1, 3))
    z = m.act(m.act(x, "exp"), "neg")                      # made while the view is pending
    m.output("o", m.concat([t, m.transpose(z, (0, 2, 1, 3))], 2))
    g = m.build()
    ti = [i for i, n in enumerate(g.nodes) if n.op == "transpose"]
    yi = g.nodes[ti[0]].inputs[0][0]
    reader = len(g.nodes) - 1
    copied, viewed = plan(g), plan(g, frozenset(ti[:1]))
    assert copied.slots[(ti[0], 0)].home == "arena"
    s = viewed.slots[(ti[0], 0)]
    assert s.home == "view" and s.base == (yi, 0), viewed.text()
    ys = viewed.slots[(yi, 0)]
    assert ys.end == reader, viewed.text()
    for (i, k), o in viewed.slots.items():      # no value made while y is read overlaps its bytes
        if o.home == "arena" and i != yi and o.start <= ys.end and ys.start <= o.end:
            assert o.offset + o.nbytes <= ys.offset or ys.offset + ys.nbytes <= o.offset, viewed.text()


def test_placed_concat_inputs_live_in_the_concat():
    """A placed concat input owns no bytes ('placed' in the concat); the concat's output is
    born with its first placed producer, so nothing live meanwhile overlaps it. An input
    read by another node too stays in the arena."""
    m = Builder("placed", "mir")
    x = m.input("x", (1, 4, 8))
    a = m.act(x, "tanh")
    b = m.act(x, "exp")
    shared = m.act(x, "neg")
    cat = m.concat([a, b, shared], 1)
    m.output("o", m.act(cat, "sin"))
    m.output("shared", shared)
    g = m.build()
    ci = next(i for i, n in enumerate(g.nodes) if n.op == "concat")
    lir = plan(g, placed=frozenset({(ci, 0), (ci, 1), (ci, 2)}))
    ai, bi, si = (g.nodes[ci].inputs[k][0] for k in range(3))
    assert [lir.slots[(j, 0)].home for j in (ai, bi, si)] == ["placed", "placed", "arena"], lir.text()
    assert lir.slots[(ai, 0)].base == (ci, 0)
    cs = lir.slots[(ci, 0)]
    assert cs.start == ai, lir.text()
    for (j, k), o in lir.slots.items():
        if o.home == "arena" and j != ci and o.base != (ci, 0) and o.start <= cs.end and cs.start <= o.end:
            assert o.offset + o.nbytes <= cs.offset or cs.offset + cs.nbytes <= o.offset, lir.text()


def test_an_early_value_lives_from_its_inputs_producer():
    """A node the backend writes early (plan's `early`: an elementwise reader computed in a
    reduction's store) is born with its input's producer: no value live from there on shares
    its bytes, the input a reduce and a later cast both read included; without `early` the
    plan gives it that input's bytes, free only from the later cast on."""
    m = Builder("early", "mir")
    x = m.act(m.input("x", (4, 64)), "tanh")
    s = m.sum(x, (-1,))
    m.output("big", m.cast(x, "f16"))
    m.output("sum", m.cast(s, "f16"))
    g = m.build()
    u = g.outputs[1][1][0]
    si = g.nodes[u].inputs[0][0]
    xi = g.nodes[si].inputs[0][0]

    def apart(lir):
        xs, us = lir.slots[(xi, 0)], lir.slots[(u, 0)]
        return us.offset >= xs.offset + xs.nbytes or xs.offset >= us.offset + us.nbytes
    late, early = plan(g), plan(g, early=frozenset({u}))
    assert (late.slots[(u, 0)].start, early.slots[(u, 0)].start) == (u, si), early.text()
    assert early.slots[(xi, 0)].end > si and apart(early) and not apart(late), (early.text(), late.text())
    assert_no_overlap(early, frozenset({u}))


def test_a_transpose_of_unit_axes_becomes_a_view(rng):
    """Once dims are bound, a transpose that moves only size-1 axes (decode's head
    transposes at seq = 1) is a reshape: no copy, no arena; other transposes stay."""
    m = Builder("heads", "mir")
    x = m.input("x", (1, "seq", 4, 8))
    y = m.act(x, "tanh")
    m.output("heads", m.act(m.transpose(y, (0, 2, 1, 3)), "exp"))
    g = m.build()
    for seq, view in ((1, True), (3, False)):
        bound = specialize(g, {"seq": seq})
        moved = [i for i, n in enumerate(bound.nodes) if n.op in ("transpose", "reshape")]
        assert [bound.nodes[i].op for i in moved] == ["reshape" if view else "transpose"]
        lir = plan(bound)
        assert lir.slots[(moved[0], 0)].home == ("view" if view else "arena"), lir.text()
        x_ = rng.standard_normal((1, seq, 4, 8)).astype(np.float32)
        out = rlx_core.compile(g, profile="default", backend="numpy").run(x=x_)["heads"]
        np.testing.assert_allclose(out, np.exp(np.tanh(x_.astype(np.float64)).transpose(0, 2, 1, 3)),
                                   rtol=1e-6)


def test_a_view_keeps_its_base_alive():
    """A value used only through a later view must not be overwritten before that use."""
    m = Builder("late_view", "mir")
    x = m.input("x", (16,))
    a = m.act(x, "exp")
    v = m.reshape(a, (4, 4))
    b = m.act(x, "tanh")                       # may not take a's bytes: a lives on through v
    c = m.act(b, "sin")
    m.output("y", m.reshape(c, (4, 4)) + v)
    g = m.build()
    lir = plan(g)
    assert_no_overlap(lir)
    x_ = np.linspace(-1, 1, 16).astype(np.float32)
    y = rlx_core.compile(g, profile="default", backend="numpy").run(x=x_)["y"]
    np.testing.assert_allclose(y, (np.sin(np.tanh(x_)) + np.exp(x_)).reshape(4, 4), rtol=1e-6)


# ----------------------------------------------------------------------------- arena size
def test_arena_close_to_liveness_bound_on_a_transformer(rng, capsys):
    cfg = Cfg(hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=688, layers=4, vocab=1000, rot=32)
    g = llama(cfg)
    exe = rlx_core.compile(g, profile="fusable", params=random_params(g, rng))
    for seq in (64, 1):
        lir = exe.lir(seq=seq)
        bound = liveness_bound(lir)
        with capsys.disabled():
            print(f"\n[planner] llama {cfg.layers}x{cfg.hidden} seq={seq}: arena {lir.arena_bytes} B, "
                  f"liveness bound {bound} B, ratio {lir.arena_bytes / bound:.3f}")
        assert lir.lower_bound == bound
        assert lir.arena_bytes <= 1.1 * bound
        assert_no_overlap(lir)


# ----------------------------------------------------------------------------- manifest
def test_binding_manifest_lists_every_binding(rng):
    def fn(m):
        x = m.input("x", (1, "seq", 8))
        pos = m.input("pos", (1,), "i32")
        cache = m.state("cache.k", (1, 2, 16, 4))
        h = m.linear(x, m.param("model.layers.0.proj.weight", (8, 8)))
        h = m.rms_norm(h, m.param("model.layers.1.norm.weight", (8,)))
        new = m.transpose(m.reshape(h, (1, "seq", 2, 4)), (0, 2, 1, 3))
        c = m.kv_write(cache, new, pos)
        return {"y": h * m.param("model.scale", (8,), "f16"), "cache": c}

    g = rlx_core.Graph.define("manifest", fn)
    params = random_params(g, rng)
    exe = rlx_core.compile(g, profile="default", params=params)
    lir = exe.lir(seq=3)
    man = lir.manifest
    kinds = {(e.kind, e.name): e for e in man.entries}
    assert set(kinds) == {("input", "x"), ("input", "pos"), ("state", "cache.k"),
                          ("param", "model.layers.0.proj.weight"), ("param", "model.layers.1.norm.weight"),
                          ("param", "model.scale"), ("output", "y"), ("output", "cache")}
    x = kinds[("input", "x")]
    assert (x.dtype, x.shape, x.nbytes) == ("f32", (1, 3, 8), 96)
    assert kinds[("input", "pos")].dtype == "i32"
    st_ = kinds[("state", "cache.k")]
    assert (st_.dtype, st_.shape, st_.nbytes) == ("f32", (1, 2, 16, 4), 512)
    sc = kinds[("param", "model.scale")]
    assert (sc.dtype, sc.shape, sc.nbytes) == ("f16", (8,), 16)
    spans = sorted((e.offset, e.offset + e.nbytes) for e in man.of("param"))
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1                                   # packed params do not overlap
    assert all(e.offset % ALIGN == 0 for e in man.of("param"))
    y = kinds[("output", "y")]
    ref = [r for n, r in lir.graph.outputs if n == "y"][0]
    assert y.offset == lir.slots[tuple(ref)].offset and (y.dtype, y.shape) == ("f32", (1, 3, 8))
    assert kinds[("output", "cache")].shape == (1, 2, 16, 4)
    text = man.text()
    assert all(e.name in text for e in man.entries)


def test_param_groups():
    g = llama(Cfg(layers=3))
    man = plan(specialize(CompilePipeline(CompileProfile()).optimize(g), {"seq": 4})).manifest
    groups = man.param_groups()
    for i in range(3):
        names = groups[f"model.layers.{i}"]
        assert names and all(n.startswith(f"model.layers.{i}.") for n in names)
        assert len([n for n in names if not n.startswith("__")]) == 9
    every = [n for ns in groups.values() for n in ns]
    assert sorted(every) == sorted(e.name for e in man.of("param"))


@pytest.mark.parametrize("name,group", [
    ("model.layers.12.mlp.up_proj.weight", "model.layers.12"),
    ("blk.3.attn_q.weight", "blk.3"),
    ("model.language_model.layers.5.self_attn.q_proj.weight", "model.language_model.layers.5"),
    ("encoder.layer.2.output.dense.bias", "encoder.layer.2"),
    ("lm_head.weight", "lm_head"),
    ("token_embd.weight", "token_embd"),
])
def test_param_groups_by_layer_index(name, group):
    from rlx_core.ir.lir import BindingManifest, ManifestEntry

    man = BindingManifest((ManifestEntry(name, "param", "f32", (2,), 8, 0),))
    assert man.param_groups() == {group: [name]}


def test_the_overlap_check_catches_a_bad_plan(rng):
    """Self-test of the checker: move one value onto the bytes of another live one."""
    import attrs

    g = llama(Cfg(layers=1))
    _, lir = _compiled(g, "default", random_params(g, rng), {"seq": 5})
    life = lifetimes(lir)
    vals = sorted(arena_values(lir).items())
    u, v = next((u, v) for (u, su), (v, sv) in zip(vals, vals[1:])
                if not (life[u][1] < life[v][0] or life[v][1] < life[u][0]) and su.offset != sv.offset
                and sv.base != u)
    bad = dict(lir.slots)
    bad[v] = attrs.evolve(bad[v], offset=bad[u].offset)
    with pytest.raises(AssertionError, match="share arena bytes"):
        assert_no_overlap(attrs.evolve(lir, slots=bad))


# ----------------------------------------------------------------------------- dynamic dims, states
from rlx_core.testing.parity import (backend, ref_attention, ref_kv_write, ref_rms_norm,  # noqa: E402,F401
                                     ref_softmax, rlx_backend)


def _dyn_graph(h=2, hd=4, d=8):
    def fn(m):
        x = m.input("x", (2, "seq", d))
        hn = m.rms_norm(x, m.param("w", (d,)), eps=1e-6)
        q, k, v = (m.transpose(m.reshape(m.linear(hn, m.param(n, (h * hd, d))), (2, "seq", h, hd)),
                               (0, 2, 1, 3)) for n in ("wq", "wk", "wv"))
        a = m.reshape(m.transpose(m.attention(q, k, v, mask_kind="causal"), (0, 2, 1, 3)), (2, "seq", h * hd))
        return {"y": m.softmax(m.linear(a, m.param("wo", (d, h * hd))))}
    return rlx_core.Graph.define("dyn", fn)


def _dyn_ref(x, p, h=2, hd=4):
    b, s, d = x.shape
    hn = ref_rms_norm(x, p["w"], eps=1e-6)
    heads = lambda w: (hn @ w.T).reshape(b, s, h, hd).transpose(0, 2, 1, 3)  # noqa: E731
    a = ref_attention(heads(p["wq"]), heads(p["wk"]), heads(p["wv"]), scale=hd ** -0.5, mask_kind="causal")
    return ref_softmax(a.transpose(0, 2, 1, 3).reshape(b, s, h * hd) @ p["wo"].T)


@pytest.mark.parametrize("profile", ["default", "fusable"])
def test_dynamic_seq_two_specializations(backend, rng, profile):
    g = _dyn_graph()
    params = random_params(g, rng)
    exe = rlx_core.compile(g, profile=profile, backend=backend, params=params)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    runners = {}
    for seq in (3, 7, 3, 7):
        x = rng.standard_normal((2, seq, 8)).astype(np.float32)
        y = exe.backend.to_host(exe.run(x=x)["y"])
        assert y.shape == (2, seq, 8)
        np.testing.assert_allclose(y, _dyn_ref(x.astype(np.float64), p64), rtol=1e-5, atol=1e-6)
        r = exe.runner({"seq": seq})
        assert runners.setdefault(seq, r) is r                    # cached per bound dims
    assert len(exe.lir_cache) == 2
    assert {k for k in exe.lir_cache} == {(("seq", 3),), (("seq", 7),)}


def _cache_graph(h=2, hd=4, max_len=8):
    def fn(m):
        q = m.input("q", (1, h, "seq", hd))
        new_k = m.input("k", (1, h, "seq", hd))
        new_v = m.input("v", (1, h, "seq", hd))
        pos = m.input("pos", (1,), "i32")
        kc = m.kv_write(m.state("cache.k", (1, h, max_len, hd)), new_k, pos)
        vc = m.kv_write(m.state("cache.v", (1, h, max_len, hd)), new_v, pos)
        return {"out": m.attention(q, kc, vc, None, pos, mask_kind="causal")}
    return rlx_core.Graph.define("decode", fn)


def test_states_persist_across_runs_and_reset(backend, rng):
    h, hd, max_len = 2, 4, 8
    g = _cache_graph(h, hd, max_len)
    exe = rlx_core.compile(g, profile="default", backend=backend)
    host = lambda name: exe.backend.to_host(exe.states[name]).astype(np.float64)  # noqa: E731
    ks = np.zeros((1, h, max_len, hd))
    vs = np.zeros((1, h, max_len, hd))
    pos = 0
    for seq in (3, 1, 1, 2):                                     # prefill, then decode steps
        q, k, v = (rng.standard_normal((1, h, seq, hd)).astype(np.float32) for _ in range(3))
        out = exe.backend.to_host(exe.run(q=q, k=k, v=v, pos=np.array([pos], np.int32))["out"])
        ks = ref_kv_write(ks, k, [pos])
        vs = ref_kv_write(vs, v, [pos])
        np.testing.assert_array_equal(host("cache.k"), ks)
        np.testing.assert_array_equal(host("cache.v"), vs)
        want = ref_attention(q.astype(np.float64), ks, vs, None, np.array([pos]), scale=hd ** -0.5,
                             mask_kind="causal")
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        pos += seq
    assert len(exe.lir_cache) == 3                               # seq 3, 1, 2
    exe.reset_states()
    assert not host("cache.k").any() and not host("cache.v").any()
    q, k, v = (rng.standard_normal((1, h, 1, hd)).astype(np.float32) for _ in range(3))
    out = exe.backend.to_host(exe.run(q=q, k=k, v=v, pos=np.array([0], np.int32))["out"])
    np.testing.assert_allclose(out, np.broadcast_to(v, out.shape), rtol=1e-6)   # only key 0 exists
    assert not host("cache.k")[:, :, 1:].any()


def test_states_shared_between_executables(rng):
    """A prefill and a decode executable share one StateStore (one KV cache)."""
    from rlx_core.pipeline import StateStore

    g = _cache_graph()
    store = StateStore()
    prefill = rlx_core.compile(g, profile="default", states=store)
    decode = rlx_core.compile(g, profile="fusable", states=store)
    q, k, v = (rng.standard_normal((1, 2, 4, 4)).astype(np.float32) for _ in range(3))
    prefill.run(q=q, k=k, v=v, pos=np.array([0], np.int32))
    q1, k1, v1 = (rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(3))
    out = decode.run(q=q1, k=k1, v=v1, pos=np.array([4], np.int32))["out"]
    ks = ref_kv_write(ref_kv_write(np.zeros((1, 2, 8, 4)), k, [0]), k1, [4])
    vs = ref_kv_write(ref_kv_write(np.zeros((1, 2, 8, 4)), v, [0]), v1, [4])
    np.testing.assert_array_equal(store["cache.k"], ks)
    want = ref_attention(q1.astype(np.float64), ks, vs, None, np.array([4]), scale=0.5, mask_kind="causal")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # a reset through one executable is seen by the other, and the other still writes the store
    decode.reset_states()
    assert not store["cache.k"].any()
    prefill.run(q=q, k=k, v=v, pos=np.array([0], np.int32))
    np.testing.assert_array_equal(store["cache.k"], ref_kv_write(np.zeros((1, 2, 8, 4)), k, [0]))
    out = decode.run(q=q1, k=k1, v=v1, pos=np.array([4], np.int32))["out"]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_a_replaced_state_buffer_is_rebound(rng):
    """When one executable puts new buffers into the shared StateStore (a cache re-sized for
    another context length), another executable's runner built on the old ones rebinds."""
    from rlx_core.pipeline import StateStore, states_moved

    store = StateStore()
    a = rlx_core.compile(_cache_graph(max_len="ctx"), profile="default", states=store)
    b = rlx_core.compile(_cache_graph(max_len="ctx"), profile="fusable", states=store)
    a.fixed_dims = b.fixed_dims = {"ctx": 8}
    q, k, v = (rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(3))
    pos = np.array([0], np.int32)
    b.run(q=q, k=k, v=v, pos=pos)
    a.fixed_dims = {"ctx": 16}
    a.run(q=q, k=k, v=v, pos=pos)                 # new 16-long buffers in the store
    a.fixed_dims = {"ctx": 8}
    a.run(q=q, k=k, v=v, pos=pos)                 # and new 8-long ones again
    old = next(iter(b._bound.values()))
    assert states_moved(store, old[0], old[1])
    k2 = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    b.run(q=q, k=k2, v=v, pos=np.array([3], np.int32))
    np.testing.assert_array_equal(store["cache.k"][:, :, 3:4], k2)     # b wrote the live buffer
    np.testing.assert_array_equal(store["cache.k"][:, :, 0:1], k)
    assert not states_moved(store, *next(iter(b._bound.values())))


def test_bound_calls_let_a_step_bind_itself_once():
    """A step with `bind` makes its own call once its operands are known never to move (work
    a kernel wrapper would repeat every run: reshapes, layout checks); a step reading a graph
    input still gathers its operands each run, bind or not."""
    from rlx_core.backends.numpy import bound_calls

    log = []

    def fn(a, out, x):
        log.append(("run", a, x))
    fn.bind = lambda a, out, x: (log.append(("bind", a, x)), lambda: log.append(("bound", a, x)))[1]
    vals = ["param", "input"]
    calls = bound_calls([(0, False, fn, "p", [0], []), (1, False, fn, "i", [1], [])], vals, {1})
    assert log == [("bind", "p", "param")]
    vals[1] = "moved"
    for call in calls:
        call()
    assert log[1:] == [("bound", "p", "param"), ("run", "i", "moved")]
