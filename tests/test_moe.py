"""Routed experts in the core: moe_route + moe_experts over symbolic tokens (the parity suite's
cases run in test_ops.py), the MoeFfn flow block against a float64 NumPy model (each router
variant, the shared expert, packed stacks staying packed, bad checkpoints), and 3-D expert
stacks through GGUF both ways (`rlx quantize`'s writer in llama.cpp's layout, read back packed)."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.flow import ModelFlow
from rlx_core.flow.moe import MoeFfn, SharedExpert
from rlx_core.ir.dtype import F32, I64
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.ir.graph import MIR, Builder
from rlx_core.ir.quant import PackedTensor, QuantScheme
from rlx_core.pipeline import select_backend
from rlx_core.plugins import hookimpl, temporary_plugin
from rlx_core.testing.ops_suite_moe import ref_moe_experts, ref_moe_route
from rlx_core.testing.parity import REF_ACT, backend, compile_on, rlx_backend  # noqa: F401  (fixtures)
from rlx_core.weights import load_checkpoint
from rlx_core.weights.checkpoint import Checkpoint
from rlx_core.weights.gguf_arch import STANDARD_TOP_NAMES, GGUFArchitecture

RLX_BACKENDS = ("numpy", "numba", "cuda", "opencl", "numpy-primitives")
ROUTERS = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]
E, K, H, I = 6, 2, 16, 12


# ----------------------------------------------------------------------------- the ops
def test_moe_ops_over_symbolic_tokens(backend, rng):
    """One executable for any number of tokens (decode's 1, a prefill's many), the route's
    output feeding the experts, as the block emits them."""
    m = Builder("moe_sym", MIR)
    logits, x = m.input("logits", ("t", E), F32), m.input("x", ("t", H), F32)
    stacks = [m.input(n, s, F32) for n, s in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))]
    w, ids = m.add("moe_route", (logits,), k=K, normalize=True)
    m.output("y", m.add("moe_experts", (x, w, ids, *stacks)))
    exe = compile_on(m.build(), backend)
    weights = {n: rng.uniform(-1, 1, s) / np.sqrt(s[-1]) for n, s in
               (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))}
    for t in (1, 5, 9):
        lg, xs = rng.standard_normal((t, E)), rng.standard_normal((t, H))
        feed = {"logits": lg, "x": xs, **weights}
        got = exe.run({k: v.astype(np.float32) for k, v in feed.items()})["y"]
        rw, rids = ref_moe_route(lg.astype(np.float32), K, "softmax_topk", True)
        want = ref_moe_experts(xs.astype(np.float32).astype(np.float64), rw, rids,
                               *(weights[n].astype(np.float32).astype(np.float64)
                                 for n in ("gate", "up", "down")))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_ops_print_and_round_trip_through_json():
    from rlx_core.ir.serialize import graph_from_json

    m = Builder("moe_json", MIR)
    x, logits = m.input("x", ("b", "s", 32), F32), m.input("logits", ("b", "s", 4), F32)
    w, ids = m.add("moe_route", (logits,), k=2, order="topk_softmax")
    stacks = (m.param("g", (4, 6, 34), "u8", scheme="q8_0"), m.param("u", (4, 6, 34), "u8", scheme="q8_0"),
              m.param("d", (4, 32, 6), F32))
    m.output("y", m.add("moe_experts", (x, w, ids, *stacks), schemes=("q8_0", "q8_0", ""), act="gelu"))
    g = m.build()
    assert graph_from_json(g.to_json()).to_json() == g.to_json()
    text = str(g)
    assert "moe_route(%1) {k=2 normalize=false order=topk_softmax} : f32[b,s,2], i64[b,s,2]" in text
    assert "{act=gelu int8_h=false schemes=(q8_0,q8_0,)} : f32[b,s,32]" in text


@pytest.mark.parametrize("case,match", [
    ("k_over_e", r"moe_route k=5: expected 1 <= k <= the 4 experts"),
    ("rank1", r"moe_experts x must be \[..., tokens, hidden\], got f32\[32\]"),
    ("tokens", r"moe_experts weights vs x dim 0 \(tokens\): 2 != 3"),
    ("hidden", r"moe_experts hidden of x/gate/up/down: 32 != 16"),
    ("float_ids", r"moe_experts ids must be an int type, got f32"),
])
def test_moe_metas_refuse_bad_shapes(case, match):
    from rlx_core.ir.errors import RlxError

    m = Builder("bad", MIR)
    x = m.input("x", (32,) if case == "rank1" else (3, 32), F32)
    t = 2 if case == "tokens" else 3
    stacks = (m.input("g", (4, 6, 32), F32), m.input("u", (4, 6, 16 if case == "hidden" else 32), F32),
              m.input("d", (4, 32, 6), F32))
    with pytest.raises(RlxError, match=match):
        if case == "k_over_e":
            m.add("moe_route", (m.input("lg", (3, 4), F32),), k=5)
        ids = m.input("ids", (t, 2), F32 if case == "float_ids" else I64)
        m.add("moe_experts", (x, m.input("w", (t, 2), F32), ids, *stacks))


def test_moe_experts_refuses_an_expert_id_out_of_range():
    from rlx_core.testing.parity import Arg, one_op

    args = [Arg("x", np.ones((3, 8)), F32), Arg("weights", np.ones((3, 2)), F32),
            Arg("ids", np.array([[0, 1], [2, 7], [1, 0]]), I64), Arg("gate", np.ones((4, 6, 8)), F32),
            Arg("up", np.ones((4, 6, 8)), F32), Arg("down", np.ones((4, 8, 6)), F32)]
    exe = compile_on(one_op("moe_experts", args), "numpy")
    with pytest.raises(ModelError, match=r"moe_experts: expert id out of range \[0, 4\) \(min 0, max 7\)"):
        exe.run({a.name: a.data.astype(a.dtype.np) for a in args})


# ----------------------------------------------------------------------------- the block
def _layer_weights(rng, shared=False, bias=False, prefix="model.layers.0.mlp", hid=H, inter=I):
    """A layer's float32 MoE tensors; the router's bias, when given, keeps expert 5 from ever
    being chosen."""
    w = {f"{prefix}.gate.weight": rng.standard_normal((E, hid)),
         f"{prefix}.experts.gate_proj": rng.uniform(-1, 1, (E, inter, hid)) / np.sqrt(hid),
         f"{prefix}.experts.up_proj": rng.uniform(-1, 1, (E, inter, hid)) / np.sqrt(hid),
         f"{prefix}.experts.down_proj": rng.uniform(-1, 1, (E, hid, inter)) / np.sqrt(inter)}
    if bias:
        w[f"{prefix}.gate.bias"] = np.array([1.0, 0, 0, 0, 0, -50.0])
    if shared:
        w.update({f"{prefix}.shared_expert.gate_proj.weight": rng.uniform(-1, 1, (10, H)) / 4,
                  f"{prefix}.shared_expert.up_proj.weight": rng.uniform(-1, 1, (10, H)) / 4,
                  f"{prefix}.shared_expert.down_proj.weight": rng.uniform(-1, 1, (H, 10)) / 3,
                  f"{prefix}.shared_expert_gate.weight": rng.standard_normal((1, H))})
    return {k: v.astype(np.float32) for k, v in w.items()}


def _leaning_to_expert_0(rng, w, shape, prefix="model.layers.0.mlp"):
    """Tokens with a part along the router's row 0 that adds 12 to expert 0's logit: nearly
    all of them choose expert 0."""
    r0 = w[f"{prefix}.gate.weight"][0].astype(np.float64)
    return (rng.standard_normal(shape) + 12 * r0 / (r0 @ r0)).astype(np.float32)


def ref_moe_block(x, w, order, normalize, act="silu", prefix="model.layers.0.mlp"):
    """The block in float64, token by token: router, chosen experts, shared expert."""
    w = {k: v.astype(np.float64) for k, v in w.items() if k.startswith(prefix)}
    p = prefix + "."
    t = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = t @ w[p + "gate.weight"].T + w.get(p + "gate.bias", 0.0)
    rw, rids = ref_moe_route(logits, K, order, normalize)
    y = ref_moe_experts(t, rw, rids, w[p + "experts.gate_proj"], w[p + "experts.up_proj"],
                        w[p + "experts.down_proj"], act=act)
    if p + "shared_expert.gate_proj.weight" in w:
        s = p + "shared_expert."
        h = REF_ACT[act](t @ w[s + "gate_proj.weight"].T) * (t @ w[s + "up_proj.weight"].T)
        gated = p + "shared_expert_gate.weight" in w
        gate = REF_ACT["sigmoid"](t @ w[p + "shared_expert_gate.weight"].T) if gated else 1.0
        y = y + gate * (h @ w[s + "down_proj.weight"].T)
    return y.reshape(x.shape), logits.reshape(x.shape[:-1] + (E,)), rids


def _build(block, weights, hid=H):
    return ModelFlow("moe").input("x", ("batch", "seq", hid), F32).layer(
        0, lambda f: f.raw_stage(block)).build(weights)


@pytest.mark.parametrize("order,normalize", ROUTERS, ids=["softmax_topk", "normalized", "topk_softmax"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_moe_block_matches_float64(backend, rng, order, normalize, shared):
    w = _layer_weights(rng, shared=shared, bias=shared)
    block = MoeFfn(E, K, I, order=order, normalize=normalize, tap="router_logits",
                   router_bias="gate.bias" if shared else None,
                   shared=SharedExpert(10, gate="shared_expert_gate.weight") if shared else None)
    exe = _build(block, w).compile(backend)
    x = _leaning_to_expert_0(rng, w, (2, 5, H))
    out = exe.run({"x": x})
    want, logits, ids = ref_moe_block(x, w, order, normalize)
    assert (ids == 0).any(axis=-1).mean() > 0.6      # uneven: expert 0 has twice its share (k / E)
    if shared:
        assert not (ids == 5).any()                                # the bias keeps expert 5 idle
    np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(out["router_logits.0"], logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())


def test_moe_block_ungated_shared_expert_and_gelu(rng):
    w = _layer_weights(rng, shared=True)
    del w["model.layers.0.mlp.shared_expert_gate.weight"]
    exe = _build(MoeFfn(E, K, I, act="gelu", shared=SharedExpert(10)), w).compile("numpy")
    x = rng.standard_normal((1, 4, H)).astype(np.float32)
    want = ref_moe_block(x, w, "softmax_topk", False, act="gelu")[0]
    np.testing.assert_allclose(exe.run({"x": x})["logits"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _packed_weights(w, scheme):
    q = QuantScheme.parse(scheme)
    return {k: PackedTensor(q.quantize(v), q, v.shape, k) if ".experts." in k else v for k, v in w.items()}


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
def test_moe_block_packed_stacks_stay_packed(backend, rng, scheme):
    """Packed expert stacks bind as u8 [E, rows, bytes] params that moe_experts reads with its
    schemes set (no dequantize of a whole stack), and compute what their decode computes."""
    hid, inter = (256, 256) if scheme == "q4_k" else (32, 64)     # whole blocks along both K's
    packed = _packed_weights(_layer_weights(rng, hid=hid, inter=inter), scheme)
    exe = _build(MoeFfn(E, K, inter), packed, hid).compile(backend)
    if "moe_experts" in select_backend(backend).supported_ops():       # (else legalized: dequantized)
        moe = [n for n in exe.mir.nodes if n.op == "moe_experts"]
        assert [n.a["schemes"] for n in moe] == [(scheme,) * 3]
        assert not [n for n in exe.mir.nodes if n.op == "dequantize"]
    x = rng.standard_normal((2, 3, hid)).astype(np.float32)
    got = exe.run({"x": x})["logits"]
    dense = {k: v.dequantize() if isinstance(v, PackedTensor) else v for k, v in packed.items()}
    want = ref_moe_block(x, dense, "softmax_topk", False)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_packed_stacks_bound_once_for_executables_sharing_them(rng):
    """A model's executables (prefill, decode) bind one [E, rows, bytes] array per packed
    stack, not one each (a GPU would hold every expert twice)."""
    packed = _packed_weights(_layer_weights(rng, hid=32, inter=64), "q8_0")
    shared: dict = {}
    exes = [_build(MoeFfn(E, K, 64), packed, 32).compile("numpy", shared=shared) for _ in range(2)]
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{name}"
        assert exes[0]._params[key] is exes[1]._params[key]
        assert exes[0]._params[key].shape[:2] == packed[key].shape[:2]


def test_moe_block_bad_checkpoints(rng):
    w = _layer_weights(rng)
    missing = {k: v for k, v in w.items() if not k.endswith("up_proj")}
    with pytest.raises(WeightError, match=r"missing 1: \['model.layers.0.mlp.experts.up_proj'\]"):
        _build(MoeFfn(E, K, I), missing)
    down = "model.layers.0.mlp.experts.down_proj"
    bad = dict(w, **{down: w[down][:, :, :5]})
    with pytest.raises(WeightError, match=r"model.layers.0.mlp.experts.down_proj: expected \[6, 16, 12\], "
                                          r"got \[6, 16, 5\]"):
        _build(MoeFfn(E, K, I), bad)
    with pytest.raises(ModelError, match=r"moe_ffn model.layers.0.mlp: k=7 experts per token, expected "
                                         r"1 <= k <= the 6 experts"):
        _build(MoeFfn(E, 7, I), w)
    with pytest.raises(ModelError, match="router order 'sigmoid'"):
        _build(MoeFfn(E, K, I, order="sigmoid"), w)


# ----------------------------------------------------------------------------- GGUF
gguf = pytest.importorskip("gguf")
EXPERT_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                "attn_norm": "input_layernorm"}


class ToyMoeGGUF(GGUFArchitecture):
    """A test family with routed experts, written and read as llama.cpp's MoE files are."""

    def config(self, meta, cfg, held):
        cfg["num_experts"] = meta.num("expert_count", to="num_experts")
        cfg["num_experts_per_tok"] = meta.num("expert_used_count", to="num_experts_per_tok")

    def write_metadata(self, writer, cfg, head_dim):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])


TOY = ToyMoeGGUF("toy_moe", "ToyMoeForCausalLM", EXPERT_NAMES, STANDARD_TOP_NAMES)


class ToyMoePlugin:
    @hookimpl
    def rlx_register_gguf_architectures(self, register):
        register("toymoe", TOY)


def _toy_checkpoint(folder, hid, inter, experts=3, vocab=8, seed=0):
    rng = np.random.default_rng(seed)
    cfg = {"model_type": "toy_moe", "hidden_size": hid, "num_attention_heads": 2, "num_hidden_layers": 1,
           "intermediate_size": inter, "vocab_size": vocab, "num_experts": experts, "num_experts_per_tok": 2}
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, hid)),
         "model.norm.weight": rng.standard_normal(hid),
         p + "input_layernorm.weight": rng.standard_normal(hid),
         p + "mlp.gate.weight": rng.standard_normal((experts, hid)),
         p + "mlp.experts.gate_proj.weight": rng.standard_normal((experts, inter, hid)),
         p + "mlp.experts.up_proj.weight": rng.standard_normal((experts, inter, hid)),
         p + "mlp.experts.down_proj.weight": rng.standard_normal((experts, hid, inter))}
    folder.mkdir()
    return Checkpoint(str(folder), "safetensors", cfg, {k: v.astype(np.float32) for k, v in t.items()}, None)


GGUF_STACKS = {"blk.0.ffn_gate_exps.weight": "model.layers.0.mlp.experts.gate_proj.weight",
               "blk.0.ffn_up_exps.weight": "model.layers.0.mlp.experts.up_proj.weight",
               "blk.0.ffn_down_exps.weight": "model.layers.0.mlp.experts.down_proj.weight"}


@pytest.mark.parametrize("scheme", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
                                    "int8_b32", "int4_b64"])
def test_gguf_expert_stacks_both_ways(tmp_path, scheme):
    """`rlx quantize`'s writer stores each [E, rows, cols] stack quantized as llama.cpp does
    (ggml ne [cols, rows, E], the scheme's bytes row after row, expert after expert), which
    gguf's own reader decodes to the same values; RLX reads it back packed, unchanged."""
    from rlx_core.weights.gguf_write import write_gguf

    q = QuantScheme.parse(scheme)
    hid = inter = max(q.block_size, 32)
    ck = _toy_checkpoint(tmp_path / "src", hid, inter)
    dst = tmp_path / "out.gguf"
    with temporary_plugin(ToyMoePlugin(), "test-toy-moe-gguf"):
        done = write_gguf(ck, dst, scheme, echo=lambda *a: None)
        back = load_checkpoint(dst, packed=True)
        floats = load_checkpoint(dst)
    assert done["kept"] == []
    reader = gguf.GGUFReader(str(dst))
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["toymoe.expert_count"].parts[-1][0] == 3
    for name, hf in GGUF_STACKS.items():
        x = ck.tensors[hf]
        raw = q.quantize(x).reshape(x.shape[:-1] + (-1,))
        t = tensors[name]
        if q.gguf_type is not None:
            assert t.tensor_type == q.gguf_type and list(t.shape) == list(reversed(x.shape))   # ne
            np.testing.assert_array_equal(np.asarray(t.data).reshape(raw.shape), raw)
            theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(x.shape)
            np.testing.assert_array_equal(theirs, q.dequantize(raw.reshape(-1, raw.shape[-1]), x.shape))
        else:                                            # RLX's int blocks: i8 bytes, shape in metadata
            assert t.tensor_type == gguf.GGMLQuantizationType.I8
            np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8).reshape(raw.shape), raw)
        p = back.tensors[hf]
        assert isinstance(p, PackedTensor) and p.scheme == q and tuple(p.shape) == x.shape
        np.testing.assert_array_equal(p.raw.reshape(raw.shape), raw)
        np.testing.assert_array_equal(floats.tensors[hf], p.dequantize())
        assert np.abs(p.dequantize() - x).max() <= 0.5 * np.abs(x).max()       # (a sanity bound)
    assert back.config["num_experts"] == 3 and back.config["num_experts_per_tok"] == 2


def test_gguf_packed_experts_run_as_their_decode(tmp_path, rng):
    """A q4_k GGUF's expert stacks bound packed to the block give the logits of the same
    stacks dequantized at load (the `[precision] weights = "f32"` path)."""
    from rlx_core.weights.gguf_write import write_gguf

    ck = _toy_checkpoint(tmp_path / "src", 256, 256)
    with temporary_plugin(ToyMoePlugin(), "test-toy-moe-gguf"):
        write_gguf(ck, tmp_path / "out.gguf", "q4_k", echo=lambda *a: None)
        back = load_checkpoint(tmp_path / "out.gguf", packed=True)
    moe = {k: v for k, v in back.tensors.items() if ".mlp." in k}
    block = MoeFfn(3, 2, 256, stacks=("experts.gate_proj.weight", "experts.up_proj.weight",
                                      "experts.down_proj.weight"))
    x = rng.standard_normal((1, 3, 256)).astype(np.float32)
    flow = lambda w: ModelFlow("moe").input("x", ("batch", "seq", 256), F32).layer(  # noqa: E731
        0, lambda f: f.raw_stage(block)).build(w).compile("numpy").run({"x": x})["logits"]
    packed = flow(moe)
    dense = flow({k: v.dequantize() if isinstance(v, PackedTensor) else v for k, v in moe.items()})
    np.testing.assert_allclose(packed, dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())


def _write_raw_gguf(path, count, stacks: dict, key=True):
    w = gguf.GGUFWriter(str(path), "toymoe")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_vocab_size(4)
    if key:
        w.add_expert_count(count)
    w.add_expert_used_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    for name, shape in stacks.items():
        w.add_tensor(name, np.ones(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_expert_count_disagreeing_with_tensors(tmp_path):
    ok = {"blk.0.ffn_gate_inp.weight": (3, 32), "blk.0.ffn_up_exps.weight": (3, 32, 32)}
    with temporary_plugin(ToyMoePlugin(), "test-toy-moe-gguf"):
        load_checkpoint(_write_raw_gguf(tmp_path / "ok.gguf", 3, ok))
        bad = _write_raw_gguf(tmp_path / "bad.gguf", 3, dict(ok, **{"blk.0.ffn_up_exps.weight": (4, 32, 32)}))
        with pytest.raises(WeightError, match=r"bad.gguf: tensor 'blk.0.ffn_up_exps.weight' of shape "
                                              r"\[4, 32, 32\] holds 4 experts, but GGUF metadata "
                                              r"toymoe.expert_count = 3"):
            load_checkpoint(bad)
        router = _write_raw_gguf(tmp_path / "router.gguf", 3,
                                 dict(ok, **{"blk.0.ffn_gate_inp.weight": (2, 32)}))
        with pytest.raises(WeightError, match=r"tensor 'blk.0.ffn_gate_inp.weight' of shape \[2, 32\]"):
            load_checkpoint(router)
    nokey = _write_raw_gguf(tmp_path / "nokey.gguf", 3, ok, key=False)
    from rlx_core.weights.gguf_io import check_expert_tensors, read_gguf

    with pytest.raises(WeightError, match=r"tensor 'blk.0.ffn_gate_inp.weight' holds experts but the GGUF "
                                          r"metadata lacks toymoe.expert_count"):
        check_expert_tensors(read_gguf(nokey), "toymoe")


def test_pack_keeps_a_stacks_leading_dims():
    """A packed param of three dims becomes u8 [E, rows, bytes]; a use other than the experts
    (here a plain add) dequantizes it to its logical shape."""
    from rlx_core.passes.packed import pack_params

    m = Builder("p", MIR)
    w = m.param("w", (2, 4, 32), F32, scheme="q8_0")
    m.output("y", w + m.input("x", (2, 4, 32), F32))
    g = pack_params(m.build())
    params = [n for n in g.nodes if n.op == "param"]
    assert params[0].outs[0].dims == (2, 4, 34) and params[0].outs[0].dtype.value == "u8"
    deq = [n for n in g.nodes if n.op == "dequantize"]
    assert deq and deq[0].outs[0].dims == (2, 4, 32)
