"""Fusion must not change results: random graphs of standard blocks give the same outputs
under `direct`, `fusable` and with fusion skipped; the generic passes keep results;
assert_clean; legalization for a backend without fused ops; no silent fallback."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import rlx_core
from graphs import (Cfg, attention_programs, bert, build, inputs_for, llama, llama_inputs, programs,
                    random_params)
from rlx_core.testing.parity import REF_ACT, backend, rlx_backend, rng  # noqa: F401
from rlx_core import Graph
from rlx_core.backends import Backend
from rlx_core.backends.numpy import NumpyBackend, NumpyRunner
from rlx_core.ir.errors import BackendError, GraphError
from rlx_core.ir.ops import ACTIVATIONS, FUSED, OPS, Level, OpDef
from rlx_core.profile import CompileProfile

_VERIFY = {"verify_each": True}
PROFILES = {
    "direct": CompileProfile("direct").evolve(passes=_VERIFY),
    "fusable": CompileProfile.preset("fusable").evolve(passes=_VERIFY),
    "unfused": CompileProfile.preset("unfused").evolve(passes=_VERIFY),
    "fusable_skip": CompileProfile.preset("fusable").evolve(
        fusion={"skip": True, "assert_clean": False}, passes=_VERIFY),
    "fusable_generic": CompileProfile.preset("fusable").evolve(fusion={"target": "generic"},
                                                               passes=_VERIFY),
    "direct_generic": CompileProfile("dg").evolve(fusion={"target": "generic"}, passes=_VERIFY),
}
NO_PASSES = {"dce": False, "constant_folding": False, "cse": False, "verify_each": True}
PASS_PROFILES = {
    "unfused_no_passes": CompileProfile.preset("unfused").evolve(passes=NO_PASSES),
    "fusable_no_passes": CompileProfile.preset("fusable").evolve(
        fusion={"assert_clean": False}, passes=NO_PASSES),
    "direct_only_dce": CompileProfile("d").evolve(passes={"constant_folding": False, "cse": False}),
    "direct_only_cse": CompileProfile("c").evolve(passes={"constant_folding": False, "dce": False}),
    "direct_only_fold": CompileProfile("f").evolve(passes={"cse": False, "dce": False}),
}


def run_all(g, profiles: dict, params, inputs, backend=None) -> dict:
    results = {}
    for name, prof in profiles.items():
        exe = rlx_core.compile(g, profile=prof, params=params, backend=backend)
        results[name] = exe.run(inputs)
    return results


def assert_same(results: dict, base: str, tol=1e-5) -> None:
    ref = results[base]
    for name, res in results.items():
        assert res.keys() == ref.keys()
        for k in ref:
            r = ref[k].astype(np.float64)
            scale = max(1.0, float(np.max(np.abs(r))))
            np.testing.assert_allclose(res[k], r, rtol=tol, atol=tol * scale,
                                       err_msg=f"output {k}: {name} vs {base}")


_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(program=programs)
def test_fusion_keeps_results(program):
    g = build(program)
    rng = np.random.default_rng(abs(hash(repr(program))) % 2**32)
    params, inputs = random_params(g, rng), inputs_for(g, rng)
    assert_same(run_all(g, PROFILES, params, inputs), "unfused")


@_SETTINGS
@given(program=attention_programs)
def test_fusion_keeps_results_attention_blocks(program):
    test_fusion_keeps_results.hypothesis.inner_test(program)


@_SETTINGS
@given(program=programs)
def test_generic_passes_keep_results(program):
    steps, aux_at, with_aux = program
    g = build((steps + [("dead",), ("dup",), ("const",)], aux_at, with_aux))
    rng = np.random.default_rng(abs(hash(repr(program))) % 2**32)
    params, inputs = random_params(g, rng), inputs_for(g, rng)
    res = run_all(g, {**PASS_PROFILES, "unfused": PROFILES["unfused"], "fusable": PROFILES["fusable"]},
                  params, inputs)
    assert_same(res, "unfused_no_passes")


def test_passes_do_their_job(rng):
    """The dead / duplicated / constant parts of a graph are gone after the generic passes."""
    g = build(([("dead",), ("dup",), ("const",)], 0, False))
    on = rlx_core.CompilePipeline(PROFILES["unfused"]).optimize(g)
    off = rlx_core.CompilePipeline(PASS_PROFILES["unfused_no_passes"]).optimize(g)
    count = lambda mir, op: sum(n.op == op for n in mir.nodes)  # noqa: E731
    assert count(on, "matmul") == 1 and count(off, "matmul") == 3      # dead one dropped, dup pair merged
    assert count(off, "constant") > count(on, "constant")
    assert count(on, "activation") < count(off, "activation")          # tanh pair merged, exp folded
    assert len(on.nodes) < len(off.nodes)


# ----------------------------------------------------------------------------- standard blocks
def _ops(mir) -> set:
    return {n.op for n in mir.nodes}


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_fusable_llama_is_clean_and_fused(rng, style):
    cfg = Cfg(style=style)
    g = llama(cfg)
    params = random_params(g, rng)
    exe = rlx_core.compile(g, profile="fusable", params=params)      # the preset asserts clean
    ops = _ops(exe.mir)
    assert {"fused_attention_block", "fused_residual_rms_norm", "fused_swiglu"} <= ops, exe.mir.text()
    assert not ops & {"reduce", "activation", "softmax", "mask_fill", "concat", "rope", "attention"}, \
        exe.mir.text()
    inputs = llama_inputs(cfg, rng, 6, batch=1)
    ref = rlx_core.compile(g, profile="unfused", params=params).run(inputs)
    np.testing.assert_allclose(exe.run(inputs)["logits"], ref["logits"], rtol=1e-5, atol=1e-5)


def test_fusable_bert_is_clean_and_fused(rng):
    g = bert()
    params = random_params(g, rng)
    exe = rlx_core.compile(g, profile="fusable", params=params)
    ops = _ops(exe.mir)
    assert {"fused_residual_ln", "fused_matmul_bias_act", "attention"} <= ops, exe.mir.text()
    assert not ops & {"reduce", "activation", "rms_norm", "softmax", "binary"}, exe.mir.text()
    assert any(n.op == "fused_matmul_bias_act" and n.a["act"] == "gelu" for n in exe.mir.nodes)
    x = rng.standard_normal((1, 7, 32)).astype(np.float32)
    ref = rlx_core.compile(g, profile="unfused", params=params).run(x=x)
    np.testing.assert_allclose(exe.run(x=x)["hidden"], ref["hidden"], rtol=1e-5, atol=1e-5)


def test_fusable_layer_norm_is_not_mistaken_for_rms_norm():
    """LayerNorm's tail d * rsqrt(mean(d*d) + eps) is an RMSNorm of d: the bigger pattern wins."""
    g = Graph.define("ln", lambda m: m.layer_norm(m.input("x", (2, 8)), m.param("g", (8,)),
                                                  m.param("b", (8,))))
    mir = rlx_core.compile(g, profile="fusable").mir
    assert [n.op for n in mir.nodes if n.op not in ("input", "param")] == ["layer_norm"], mir.text()


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_fusable_low_precision_norms_fuse(dt):
    """In f16/bf16, fusable lowering wraps norms and softmax in f32 casts; they still fuse."""
    def fn(m):
        x = m.input("x", (2, "seq", 16), dt)
        h = m.rms_norm(x, m.param("w", (16,), dt))
        h = m.layer_norm(h, m.param("g", (16,), dt), m.param("b", (16,), dt))
        return m.softmax(h)
    mir = rlx_core.compile(Graph.define("lowp", fn), profile="fusable").mir
    assert [n.op for n in mir.nodes if n.op not in ("input", "param")] == \
        ["rms_norm", "layer_norm", "softmax"], mir.text()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fn", [f for f in ACTIVATIONS if f != "identity"])
def test_every_table_activation_fuses_into_the_matmul_epilogue(rng, fn, bias):
    """act(x @ w (+ b)) becomes one fused_matmul_bias_act for every activation of the expression
    table (quick_gelu, exp, ... too), and matches act's float64 reference (positive data: log,
    sqrt and rsqrt are defined on it)."""
    def define(m):
        h = m.matmul(m.input("x", (3, 8)), m.param("w", (8, 5)))
        return m.act(h + m.param("b", (5,)) if bias else h, fn)
    params = {"w": rng.uniform(0.1, 1.0, (8, 5)).astype(np.float32),
              **({"b": rng.uniform(0.1, 1.0, 5).astype(np.float32)} if bias else {})}
    exe = rlx_core.compile(Graph.define("mba", define), profile="fusable", params=params)
    steps = [(n.op, n.a.get("act")) for n in exe.mir.nodes if n.op not in ("input", "param", "constant")]
    assert steps == [("fused_matmul_bias_act", fn)], exe.mir.text()
    x = rng.uniform(0.1, 1.0, (3, 8)).astype(np.float32)
    h = x.astype(np.float64) @ params["w"].astype(np.float64) + (params["b"].astype(np.float64) if bias else 0.0)
    (out,) = exe.run(x=x).values()
    np.testing.assert_allclose(out, REF_ACT[fn](h), rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zeros_under_every_profile(rng):
    """A query row that may attend to no key (a padding row) is all -inf before the softmax:
    every profile gives zeros there, composed or fused, and the float64 softmax elsewhere."""
    def fn(m):
        s = m.input("s", (2, 3, 5))
        keep = m.input("keep", (2, 3, 5), "bool")
        return {"p": m.softmax(m.where(keep, s, s * 0 - np.inf))}
    g = Graph.define("masked_softmax", fn)
    s = rng.standard_normal((2, 3, 5)).astype(np.float32)
    keep = rng.random((2, 3, 5)) < 0.6
    keep[0, 1] = False                                     # one row fully masked
    keep[1, 2] = True
    x = np.where(keep, s.astype(np.float64), -np.inf)
    e = np.exp(x - np.max(np.where(keep, x, -1e300), -1, keepdims=True))
    want = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    for name, prof in PROFILES.items():
        got = rlx_core.compile(g, profile=prof).run(s=s, keep=keep)["p"]
        assert np.isfinite(got).all(), f"{name}: {got}"
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
    assert not got[0, 1].any()


def test_assert_clean_fails_when_a_group_is_skipped():
    """The target fuses RMSNorm; skipping the group leaves its primitive chain, which
    assert_clean reports (naming the skip)."""
    g = llama(Cfg(layers=1))
    prof = CompileProfile.preset("fusable").evolve(fusion={"skip": ("rms_norm",)})
    with pytest.raises(GraphError, match=r"assert_clean.*rms_norm.*fusion\.skip"):
        rlx_core.compile(g, profile=prof)
    # without assert_clean the same profile compiles, and leaves the chain unfused
    mir = rlx_core.compile(g, profile=prof.evolve(fusion={"assert_clean": False})).mir
    assert not _ops(mir) & {"rms_norm", "fused_residual_rms_norm"} and "reduce" in _ops(mir)


def test_assert_clean_reports_a_plugin_rule_left_unfused():
    """A pattern group registered by a plugin runs on every target; skip it and assert_clean
    names the plugin's rule."""
    from rlx_core.ir.rewrite import P, Rule, X
    from rlx_core.plugins import hookimpl, register_plugin, unregister_plugin

    class Plugin:
        @hookimpl
        def rlx_register_passes(self, register):
            register("double_neg", Rule("double_neg", P("activation")(
                P("activation")(X("x"), fn="neg"), fn="neg"), lambda mt: mt.get("x")))

    g = Graph.define("nn", lambda m: -(-m.input("x", (3,))) * 2.0)
    register_plugin(Plugin(), name="test-double-neg")
    try:
        fused = rlx_core.compile(g, profile="fusable").mir
        assert "activation" not in _ops(fused)
        with pytest.raises(GraphError, match="double_neg"):
            rlx_core.compile(g, profile=CompileProfile.preset("fusable").evolve(
                fusion={"skip": ("double_neg",)}))
    finally:
        unregister_plugin("test-double-neg")


# ----------------------------------------------------------------------------- legalize
class NoFusedBackend(Backend):
    """The NumPy backend minus every fused op: the pipeline must legalize them."""
    name = "test-nofused"
    priority = -100
    target = "numpy"

    def __init__(self, drop=()):
        self.drop = set(drop)

    def supported_ops(self) -> set:
        return NumpyBackend().supported_ops() - FUSED - self.drop

    def compile(self, lir, params, states):
        return NumpyRunner(lir, params, states)


@pytest.mark.parametrize("policy", ["direct", "fusable"])
@pytest.mark.parametrize("model", ["llama", "bert"])
def test_legalize_for_a_backend_without_fused_ops(rng, policy, model):
    g = llama() if model == "llama" else bert()
    params = random_params(g, rng)
    inputs = llama_inputs(Cfg(), rng, 5, batch=1) if model == "llama" else \
        {"x": rng.standard_normal((1, 5, 32)).astype(np.float32)}
    prof = CompileProfile("p").evolve(fusion={"policy": policy}, passes=_VERIFY)
    pipe = rlx_core.CompilePipeline(prof, NoFusedBackend())
    exe = pipe.compile(g, params)
    assert not _ops(exe.mir) & FUSED, exe.mir.text()
    assert pipe.legalized, "the numpy target fuses these graphs: something must be legalized"
    ref = rlx_core.compile(g, profile=prof, params=params, backend="numpy").run(inputs)
    got = exe.run(inputs)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5)


def test_backend_lacking_a_primitive_is_an_error_naming_it():
    g = Graph.define("cs", lambda m: m.cumsum(m.input("x", (2, 3))))
    with pytest.raises(BackendError, match=r"'test-nofused'.*'cumsum'.*numpy"):
        rlx_core.CompilePipeline(CompileProfile(), NoFusedBackend(drop={"cumsum"})).compile(g)


@pytest.fixture
def op_without_kernels(monkeypatch):
    """An op added to the table with no kernel anywhere."""
    monkeypatch.setitem(OPS, "test_only_op", OpDef("test_only_op", ("x",), {}, lambda s, a: (s[0],),
                                                   Level.PRIM, "an op no backend has a kernel for"))
    m = rlx_core.Builder("noimpl", "mir")
    m.output("y", m.add("test_only_op", (m.input("x", (2,)),)))
    return m.build()


def test_op_no_backend_implements_is_an_error_naming_it(op_without_kernels):
    with pytest.raises(BackendError, match=r"backend 'numpy' does not implement op 'test_only_op'"):
        rlx_core.compile(op_without_kernels, profile="default", backend="numpy")


def test_backend_claims_only_ops_it_has_kernels_for(backend, op_without_kernels):
    """supported_ops() must not be derived from the op table: a new table entry without a
    kernel has to be a compile error, not a crash when the runner is built."""
    from rlx_core.pipeline import select_backend

    assert "test_only_op" not in select_backend(backend).supported_ops()
    with pytest.raises(BackendError, match="'test_only_op'"):
        rlx_core.compile(op_without_kernels, profile="default", backend=backend)


def test_bf16_compute_keeps_exact_scalars_in_bf16():
    """Under bf16 compute `x * (s + 1.0)` stays bf16 (1.0 is exact in bf16: no f32 chain and
    no cast before the matmul, as FLUX's `norm * (1 + scale) + shift` had); a scalar bf16
    cannot hold (0.044715) keeps f32, and its chain is cast to bf16 for the matmul."""
    from rlx_core.ir.dtype import BF16, F32
    from rlx_core.ir.lower import lower
    from rlx_core.passes.transform import to_precision

    def f(m):
        x, s, w = m.input("x", (4, 8), F32), m.param("s", (8,), F32), m.param("w", (8, 8), F32)
        return {"y": m.matmul(x * (s + 1.0), w), "z": m.matmul(x * (s + 0.044715), w)}
    g = to_precision(lower(Graph.define("p", f)), BF16)

    def chain(out):             # the ops from the output back to the input cast, with dtypes
        n, seen = g.nodes[dict(g.outputs)[out][0]], []
        while n.op != "input":
            seen.append((n.op, n.outs[0].dtype))
            n = g.nodes[n.inputs[0][0]]
        return seen
    assert chain("y") == [("cast", F32), ("matmul", BF16), ("binary", BF16), ("cast", BF16)]
    assert chain("z") == [("cast", F32), ("matmul", BF16), ("cast", BF16), ("binary", F32), ("cast", BF16)]


def test_bf16_compute_retypes_fused_elementwise_regions(rng):
    """A region fused while the graph was f32 computes in bf16 once to_precision makes its
    inputs bf16 (its dtype attr re-inferred from the program): the modulation
    tanh(x) * (u + 1.0) + t feeds the matmul with no f32 intermediate and no cast; it runs,
    and agrees with float64 to bf16's tolerance."""
    from rlx_core.ir.dtype import BF16, F32

    def f(m):
        x, u, t, w = (m.input("x", (4, 8), F32), m.input("u", (8,), F32), m.param("t", (8,), F32),
                      m.param("w", (8, 8), F32))
        return m.matmul(m.tanh(x) * (u + 1.0) + t, w)
    prof = CompileProfile().evolve(precision={"compute": "bf16"}, fusion={"target": "generic"})
    exe = rlx_core.compile(Graph.define("mod", f), profile=prof, backend="numpy")
    ops = [(n.op, n.outs[0].dtype) for n in exe.mir.nodes if n.op not in ("input", "param", "constant")]
    assert ("fused_elementwise", BF16) in ops and ("fused_elementwise", F32) not in ops, ops
    assert [o for o in ops if o[0] == "cast"] == [("cast", BF16)] * 2 + [("cast", F32)], ops  # in, in, out
    p = {"t": rng.standard_normal(8).astype(np.float32), "w": rng.standard_normal((8, 8)).astype(np.float32)}
    x, u = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    exe.set_params(p)
    want = (np.tanh(x) * (u + 1.0) + p["t"]) @ p["w"].astype(np.float64)
    np.testing.assert_allclose(exe.run({"x": x, "u": u})["out"], want, rtol=0.05, atol=0.05 * np.abs(want).max())


def test_an_elementwise_op_feeding_only_elementwise_ops_is_recomputed_in_each(rng):
    """cos and sin of one angle (cast positions times frequencies): each region recomputes
    the angle, so the angle is no launch of its own (two regions, not three); an angle that
    also feeds a matmul stays one value (a region of the cast and the product) that cos and
    sin read."""
    from rlx_core.ir.dtype import F32, I32

    def f(m, to_matmul):
        pos = m.input("pos", (2, 3), I32)
        ang = m.cast(m.reshape(pos, (2, 3, 1)), F32) * m.constant(np.float32([0.5, 0.25, 0.125, 1.0]))
        out = {"cos": m.act(ang, "cos"), "sin": m.act(ang, "sin")}
        if to_matmul:
            out["mm"] = m.matmul(ang, m.param("w", (4, 4), F32))
        return out
    prof = CompileProfile().evolve(fusion={"target": "generic"})
    pos = rng.integers(0, 1000, (2, 3)).astype(np.int32)
    ang = pos[..., None].astype(np.float64) * np.float32([0.5, 0.25, 0.125, 1.0])
    for to_matmul in (False, True):
        params = {"w": np.eye(4, dtype=np.float32)} if to_matmul else {}
        g = Graph.define("angles", lambda m: f(m, to_matmul))
        exe = rlx_core.compile(g, profile=prof, backend="numpy", params=params)
        ops = [n.op for n in exe.mir.nodes if n.op not in ("input", "param", "constant", "reshape")]
        want_ops = ["fused_elementwise", "activation", "activation", "matmul"] if to_matmul else [
            "fused_elementwise"] * 2
        assert ops == want_ops, ops
        out = exe.run({"pos": pos})
        np.testing.assert_allclose(out["cos"], np.cos(ang), atol=1e-4)
        np.testing.assert_allclose(out["sin"], np.sin(ang), atol=1e-4)
