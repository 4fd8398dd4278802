"""What a decode step builds to on a stand-in H200 (cuda_dry: no GPU, nothing run): a layer of
a Qwen3.5-like full-attention block between GEMVs. With the opt-in switches off, the RoPE and
the output gate are launches of their own; with attn_rope and attn_epilogue on, the decode
attention's one launch (its source with ROPE and EPI) replaces the three. A greedy fetch skips
the launches only the logits need. The final norm, read through the last-token narrow, and the
first, of the token embeddings, are computed by the GEMVs around them: a tiny Llama's and
Qwen3.5's bf16 decode steps have no norm launch. The sums of squares those GEMVs share are
replayed over two steps (cuda_dry.sums_hazards): none is read before it is written or zeroed
before its last reader, even where the embeddings' norm is read after another norm's GEMV."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_dry import HOPPER, dry, leaves, planned, replay, sums_hazards  # noqa: F401  (the fixture)
import rlx_backend_cuda
from rlx_backend_cuda import set_config
from rlx_backend_cuda.values import CONFIG
from rlx_core.ir.dtype import BF16, I32
from rlx_core.ir.graph import Graph

B, H, KV, D, HALF, CTX, HID = 1, 8, 2, 128, 32, 1024, 512
SWITCHES = ("attn_rope", "attn_epilogue")


def layer():
    """x [B, 1, HID] -> norm, q / k / v / gate projection (one GEMV), q and k normed per head and
    roped, k and v into the caches, attention, times sigmoid(gate), o projection + x, norm, up."""
    def f(m):
        x = m.input("x", (B, 1, HID), BF16)
        pos = m.input("pos", (B,), I32)
        cos, sin = m.input("cos", (B, 1, HALF)), m.input("sin", (B, 1, HALF))
        h = m.rms_norm(x, m.param("ln", (HID,), BF16), eps=1e-6)
        qkvg = m.linear(h, m.param("wqkvg", ((2 * H + 2 * KV) * D, HID), BF16))
        q, k, v, gate = (m.reshape(m.narrow(qkvg, 2, a * D, n * D), (B, 1, n, D))
                         for a, n in ((0, H), (H, KV), (H + KV, KV), (H + 2 * KV, H)))
        q = m.rms_norm(q, m.param("qn", (D,), BF16), eps=1e-6)
        k = m.rms_norm(k, m.param("kn", (D,), BF16), eps=1e-6)
        q, k, v = (m.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
        kc = m.kv_write(m.state("kc", (B, KV, CTX, D), BF16), m.rope(k, cos, sin), pos)
        vc = m.kv_write(m.state("vc", (B, KV, CTX, D), BF16), v, pos)
        o = m.transpose(m.attention(m.rope(q, cos, sin), kc, vc, pos=pos), (0, 2, 1, 3))
        o = m.reshape(m.mul(o, m.sigmoid(gate)), (B, 1, H * D))
        x2 = m.add_(x, m.linear(o, m.param("wo", (HID, H * D), BF16)))
        h2 = m.rms_norm(x2, m.param("ln2", (HID,), BF16), eps=1e-6)
        up = m.linear(h2, m.param("wup", (4 * HID, HID), BF16))
        return {"up": up}
    return Graph.define("dry_layer", f)


@pytest.fixture
def switches():
    was = {k: CONFIG[k] for k in SWITCHES}
    yield lambda **kw: set_config(**{k: kw.get(k, False) for k in SWITCHES})
    set_config(**was)


def launched(runner) -> list:
    """Every step run once on the stand-ins: the kernels launched, in order."""
    return [k for _, _, k in replay(runner) if k is not None]


def run_steps(runner) -> list:
    """The names of `launched`."""
    return [k.name for k in launched(runner)]


# (the gate alone: not where the plan gave its output the bytes of the roped q the kernel reads)
@pytest.mark.parametrize("rope,gate", [(True, True), (True, False)])
def test_the_rope_and_the_gate_go_into_the_decode_attention(dry, switches, rope, gate):
    rng = np.random.default_rng(0)
    lir = planned(layer())
    params, states = leaves(lir, rng)
    switches()
    plain = dry(lir, params, states)
    ops = plain.describe()["steps_by_op"]
    assert ops.get("rope") == 1, ops
    before = run_steps(plain)
    at = before.index("rlx_attn_decode")
    assert before[at - 1] == "rlx_rope" and before[at + 1] == "rlx_ew", before      # (the gate)

    switches(attn_rope=rope, attn_epilogue=gate)
    fused = dry(lir, params, states)
    ops = fused.describe()["steps_by_op"]
    assert ("rope" in ops) is not rope, ops
    names = run_steps(fused)
    want = before[:at - 1 + (not rope)] + before[at:at + 1 + (not gate)] + before[at + 2:]
    assert names == want, (before, names)
    attn = next(k for k in launched(fused) if k.name == "rlx_attn_decode")
    assert ("#define ROPE 1" in attn.source) is rope and ("#define EPI 1" in attn.source) is gate
    if not (rope and gate):
        return
    # another attention kernel picked at run time: the RoPE before it, the gate after it again
    set_config(decode_attention=False)
    try:
        names = run_steps(fused)
    finally:
        set_config(decode_attention=True)
    at = names.index("rlx_attn_split")
    assert names[at - 1] == "rlx_rope" and names[at + 1] == "rlx_ew", names
    # before sm_90 (no clusters): no fold
    switches(attn_rope=True, attn_epilogue=True)
    ada = dry(lir, params, states, {**HOPPER, "cc": (8, 9), "name": "stand-in sm_89"})
    assert ada.describe()["steps_by_op"].get("rope") == 1


def greedy_head():
    """x [B, 1, HID] -> a GEMV, a norm, the head GEMV; outputs the f32 logits, the arg-max ids and
    the f32 sum (flow.blocks.GreedyNext's outputs as a bf16 decode graph has them)."""
    def f(m):
        x = m.input("x", (B, 1, HID), BF16)
        h = m.rms_norm(m.linear(x, m.param("w", (HID, HID), BF16)), m.param("ln", (HID,), BF16), eps=1e-6)
        z = m.linear(h, m.param("head", (4 * HID, HID), BF16))
        return {"logits": m.cast(z, "f32"), "next_ids": m.argmax(z),
                "logits_sum": m.cast(m.sum(z, (-1,)), "f32")}
    return Graph.define("dry_greedy", f)


def test_a_greedy_fetch_skips_the_launches_only_the_logits_need(dry, switches):
    rng = np.random.default_rng(2)
    lir = planned(greedy_head())
    switches()
    runner = dry(lir, *leaves(lir, rng))
    g = lir.graph
    logits = dict(g.outputs)["logits"][0]
    skipped = runner._skipped({"next_ids", "logits_sum"})
    assert [(runner.steps[k].node, runner.steps[k].op) for k in skipped] == [(logits, "cast")], \
        runner.describe()
    assert not runner._skipped(None) and not runner._skipped({"logits", "next_ids", "logits_sum"})
    # (the sum's cast: in the reduce's store, ops._reduce_epilogue)
    assert [st.op for st in runner.steps] == ["matmul", "rms_norm", "matmul", "cast", "argmax", "reduce"], \
        runner.describe()
    assert {runner.steps[k].op for k in runner._skipped({"logits", "next_ids"})} == {"reduce"}
    assert {runner.steps[k].op for k in runner._skipped({"logits"})} == {"argmax", "reduce"}


@pytest.mark.parametrize("last", ["narrow", "reshape", "none"])
def test_the_final_norm_is_computed_by_the_gemvs_through_a_whole_view(dry, last):
    """down GEMV -> residual norm -> (the last-token narrow of a one-token step, a reshape, or
    nothing) -> head GEMV: the norm is no launch of its own (the down GEMV writes h and its
    sums, the head GEMV norms its rows); a GEMV reading a narrow to one row keeps the launch."""
    def tail(part: bool):
        def f(m):
            x = m.input("x", (2, 1, HID), BF16)
            y = m.rms_norm(x + m.linear(x, m.param("wd", (HID, HID), BF16)), m.param("fn", (HID,), BF16),
                           eps=1e-6)
            y = {"narrow": lambda: m.narrow(y, 1, -1, 1), "reshape": lambda: m.reshape(y, (2, HID)),
                 "none": lambda: y}[last]()
            out = {"logits": m.linear(y, m.param("head", (512, HID), BF16))}
            if part:
                one = m.narrow(m.reshape(y, (2, HID)), 0, 0, 1)
                out["first"] = m.linear(one, m.param("w1", (8, HID), BF16))
            return out
        lir = planned(Graph.define("tail", f))
        return dry(lir, *leaves(lir, np.random.default_rng(0)))
    r = tail(part=False)
    assert "fused_residual_rms_norm" not in r.describe()["steps_by_op"]
    assert run_steps(r) == ["rlx_gemv", "rlx_gemv"]
    assert "fused_residual_rms_norm" in tail(part=True).describe()["steps_by_op"]


@pytest.mark.parametrize("other_reader", [False, True])
def test_the_first_norm_is_computed_by_the_embedding_gather_and_the_gemv(dry, other_reader):
    """token ids -> embedding rows x (gather) -> norm -> GEMV, x + its product (the residual):
    the gather writes the rows, their weighted copy and sums of squares (rlx_gather_norm) and the
    GEMV norms its rows, so the norm is no launch of its own; a reader of the norm that is no
    GEMV keeps the plain launches."""
    def f(m):
        ids = m.input("ids", (2, 1), I32)
        x = m.gather(m.param("embed", (64, HID), BF16), ids)
        y = m.rms_norm(x, m.param("ln", (HID,), BF16), eps=1e-6)
        out = {"h": x + m.linear(y, m.param("w", (HID, HID), BF16))}
        if other_reader:
            out["y2"] = m.mul(y, y)
        return out
    lir = planned(Graph.define("embed", f))
    r = dry(lir, *leaves(lir, np.random.default_rng(0)))
    names = run_steps(r)
    if other_reader:
        assert names[:3] == ["rlx_gather", "rlx_rms_norm", "rlx_gemv"], names
        return
    assert "rms_norm" not in r.describe()["steps_by_op"]
    assert names == ["rlx_gather_norm", "rlx_gemv", "rlx_ew"], names
    gemv = next(k for k in launched(r) if k.name == "rlx_gemv")
    assert "#define NORM 1" in gemv.source


def test_sums_the_embedding_gather_writes_for_a_late_reader_are_not_zeroed_before_it(dry):
    """The embedding rows' norm read by a GEMV after another norm's (the gather writes its sums
    before the step's first NORM GEMV, which zeroes the last sums of the ring): a memset after
    the step zeroes them instead, so the late GEMV reads what the gather wrote, every step."""
    def f(m):
        x = m.gather(m.param("embed", (64, HID), BF16), m.input("ids", (2, 1), I32))
        h = x + m.linear(m.input("a", (2, 1, HID), BF16), m.param("wo", (HID, HID), BF16))
        q = m.linear(m.rms_norm(h, m.param("ln2", (HID,), BF16), eps=1e-6), m.param("wq", (HID, HID), BF16))
        late = m.linear(m.rms_norm(x, m.param("ln", (HID,), BF16), eps=1e-6), m.param("wl", (HID, HID), BF16))
        return {"q": q, "late": late}
    lir = planned(Graph.define("late", f))
    r = dry(lir, *leaves(lir, np.random.default_rng(0)))
    assert run_steps(r) == ["rlx_gather_norm", "rlx_gemv", "rlx_gemv", "rlx_gemv"]
    assert sums_hazards(r) == []


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_a_bf16_decode_step_of_a_model_has_no_norm_launch(dry, kind):
    """A tiny Llama and Qwen3.5's decode graph as the runtime makes it, compiled in bf16 at batch
    1: every RMSNorm is computed by the GEMVs around it (the embedding gather's rlx_gather_norm
    first, the final norm through the last-token narrow)."""
    import attrs

    from rlx_core.ir.lir import plan
    from rlx_core.pipeline import CompilePipeline, specialize
    from rlx_core.runtime.model import CausalLM, find_recipe

    pytest.importorskip({"llama": "rlx_blocks_llama", "qwen3_5": "rlx_blocks_qwen35"}[kind])
    recipe = find_recipe(kind)
    cfg = dict(recipe.tiny_config(), max_position_embeddings=256)
    model = CausalLM.from_tensors(cfg, recipe.tiny_tensors(cfg, np.random.default_rng(3)), backend="numpy",
                                  recipe=recipe)
    exe = model.executable("decode")
    profile = attrs.evolve(exe.compile_profile, precision=attrs.evolve(exe.compile_profile.precision,
                                                                       compute="bf16"))
    backend = rlx_backend_cuda.CudaBackend()
    step = specialize(CompilePipeline(profile, backend).optimize_cached(exe.source), {"batch": 1, "ctx": 64})
    lir = plan(step, *backend.planned_layouts(step))
    r = dry(lir, *leaves(lir, np.random.default_rng(0)))
    ops = r.describe()["steps_by_op"]
    assert "rms_norm" not in ops and "fused_residual_rms_norm" not in ops, ops
    assert run_steps(r)[0] == "rlx_gather_norm"
    assert sums_hazards(r) == []
