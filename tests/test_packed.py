"""Packed weights end to end: the pack pass, fusion and legalization around dequant_matmul,
the manifest and JSON, `rlx quantize`, and real GGUF models run packed vs dequantized."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import rlx_core
from rlx_core import CompileProfile, Graph
from rlx_core.backends.numpy import NumpyBackend, NumpyRunner
from rlx_core.ir.errors import BackendError, ProfileError, WeightError
from rlx_core.pipeline import available_backends
from rlx_core.ir.quant import PackedTensor, QuantScheme, matmul_reference, quantize
from rlx_core.ir.serialize import graph_from_json
from rlx_core.testing.parity import assert_greedy_agrees

N, K = 24, 256


def _weights(rng, scheme, n=N, k=K, name="w"):
    q = QuantScheme.parse(scheme)
    return PackedTensor(quantize(rng.standard_normal((n, k)).astype(np.float32), q, name), q, (n, k), name)


def _require(backend: str):
    ok, why = {b.name: (ok, why) for b, ok, why in available_backends()}.get(backend, (False, "not installed"))
    if not ok:
        pytest.skip(f"backend {backend!r} is not available: {why}")


def _mlp(scheme):
    """q/k/v-like projections of one input, an embedding lookup and one odd use (a transpose)."""
    def f(m):
        x = m.input("x", ("s", K))
        ids = m.input("ids", ("s",), rlx_core.I64)
        ws = [m.param(f"w{i}", (N, K), scheme=scheme) for i in range(3)]
        table = m.param("table", (N, K), scheme=scheme)
        outs = {f"y{i}": m.linear(x, w) for i, w in enumerate(ws)}
        outs["emb"] = m.gather(table, ids)
        outs["t"] = m.transpose(ws[0], (1, 0))
        return outs
    return Graph.define("packed", f)


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
def test_pack_pass_routes_each_use(rng, scheme):
    g = _mlp(scheme)
    assert f'param "w0" packed {scheme}' in g.text()
    params = {n: _weights(rng, scheme, name=n) for n in ("w0", "w1", "w2", "table")}
    exe = rlx_core.compile(g, backend="numpy", params=params)
    ops = [n.op for n in exe.mir.nodes]
    assert ops.count("dequant_matmul") == 1                  # q, k, v share one packed matmul
    assert "matmul" not in ops and ops.count("dequantize") == 1     # the lookup reads packed rows
    assert [n.op for n in exe.prologue.nodes].count("dequantize") == 1   # the transpose: at bind time
    packed = {e.name: e for e in exe.lir(s=3).manifest.of("param")}
    assert packed["table"].scheme == scheme and packed["table"].logical == (N, K)
    assert packed["table"].dtype == "u8"
    x = rng.standard_normal((3, K)).astype(np.float32)
    ids = np.array([5, 0, N - 1])
    out = exe.run(x=x, ids=ids)
    for i in range(3):
        w = params[f"w{i}"]
        ref = matmul_reference(x, w.raw, scheme, (N, K))
        np.testing.assert_allclose(out[f"y{i}"], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    table = QuantScheme.parse(scheme).dequantize_reference(params["table"].raw, (N, K))
    np.testing.assert_allclose(out["emb"], table[ids], rtol=1e-6, atol=1e-7)
    w0 = QuantScheme.parse(scheme).dequantize_reference(params["w0"].raw, (N, K))
    np.testing.assert_allclose(out["t"], w0.T, rtol=1e-6, atol=1e-7)


def test_packed_graphs_round_trip_through_json(rng):
    g = _mlp("q4_1")
    back = graph_from_json(g.to_json())
    assert back.to_json() == g.to_json() and 'packed q4_1' in back.text()
    mir = rlx_core.CompilePipeline(CompileProfile(), "numpy").optimize(g)
    assert graph_from_json(mir.to_json()).text() == mir.text()
    doc = json.loads(mir.to_json())
    dq = [n for n in doc["nodes"] if n["op"] == "dequant_matmul"]
    assert dq and dq[0]["attrs"]["scheme"] == "q4_1"
    doc["nodes"][next(i for i, n in enumerate(doc["nodes"]) if n["op"] == "dequant_matmul")]["attrs"]["scheme"] = "q3_x"
    with pytest.raises(rlx_core.RlxError, match=r"dequant_matmul.*scheme.*q3_x"):
        graph_from_json(json.dumps(doc))


class _NoDequantMatmul(NumpyBackend):
    name = "test-no-dequant-matmul"

    def __init__(self, drop=("dequant_matmul",)):
        self.drop = set(drop)

    def supported_ops(self) -> set:
        return NumpyBackend().supported_ops() - self.drop

    def compile(self, lir, params, states):
        return NumpyRunner(lir, params, states)


@pytest.mark.parametrize("backend", ["numpy", "numba", "opencl", "cuda"])
def test_packed_matmuls_with_an_activation_share_one_matmul(rng, backend):
    """GeGLU's gate (its GELU folded into the packed matmul) and up read one x: they become one
    matmul on the concatenated rows, the GELU an activation of the gate's view."""
    _require(backend)
    scheme = "q5_0"

    def f(m):
        x = m.input("x", ("s", K))
        gate, up = (m.linear(x, m.param(n, (N, K), scheme=scheme)) for n in ("g", "u"))
        return {"y": m.gelu_tanh(gate) * up}

    params = {n: _weights(rng, scheme, name=n) for n in ("g", "u")}
    exe = rlx_core.compile(Graph.define("geglu", f), backend=backend, params=params)
    assert [n.op for n in exe.mir.nodes].count("dequant_matmul") == 1
    x = rng.standard_normal((40, K)).astype(np.float64)
    g, u = (matmul_reference(x, params[n].raw, scheme, (N, K)) for n in ("g", "u"))
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    got = exe.run(x=x.astype(np.float32))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_backend_without_the_kernel_gets_dequantize_plus_matmul(rng):
    g = Graph.define("l", lambda m: m.act(m.linear(m.input("x", (4, K)), m.param("w", (N, K), scheme="q5_1"),
                                                    m.param("b", (N,))), "silu"))
    params = {"w": _weights(rng, "q5_1"), "b": rng.standard_normal(N).astype(np.float32)}
    pipe = rlx_core.CompilePipeline(CompileProfile(), _NoDequantMatmul())
    exe = pipe.compile(g, params)
    assert "dequant_matmul" in pipe.legalized and "matmul" in {n.op for n in exe.mir.nodes}
    assert "dequantize" in {n.op for n in exe.prologue.nodes}        # once, when params are bound
    x = rng.standard_normal((4, K)).astype(np.float32)
    want = rlx_core.compile(g, backend="numpy", params=params).run(x=x)
    np.testing.assert_allclose(next(iter(exe.run(x=x).values())), next(iter(want.values())), rtol=1e-5, atol=1e-6)
    with pytest.raises(BackendError, match=r"does not implement op 'dequantize'.*numpy"):
        rlx_core.CompilePipeline(CompileProfile(), _NoDequantMatmul({"dequant_matmul", "dequantize"})).compile(g)


def test_packed_binding_errors_name_the_tensor(rng):
    g = Graph.define("l", lambda m: m.linear(m.input("x", (2, K)), m.param("w", (N, K), scheme="q8_0")))
    exe = rlx_core.compile(g, backend="numpy")
    with pytest.raises(rlx_core.RlxError, match=r"w: expected packed q8_0, got q4_0"):
        exe.set_params({"w": _weights(rng, "q4_0")})
    with pytest.raises(rlx_core.RlxError, match=r"w: expected a packed q8_0 weight"):
        exe.set_params({"w": rng.standard_normal((N, K)).astype(np.float32)})
    with pytest.raises(WeightError, match=r"'blk.0.w'.*not a multiple of the q4_k block size 256"):
        _weights(rng, "q4_k", k=64, name="blk.0.w")
    raw = _weights(rng, "q8_0").raw
    with pytest.raises(WeightError, match=r"'w'.*expected uint8 \[24, 272\]"):
        PackedTensor(raw[:, :-1], QuantScheme.parse("q8_0"), (N, K), "w")


# ------------------------------------------------------------------ models: rlx quantize, GGUF
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=151, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return path


def _same_model(a, b, ids, n=24, atol=1e-4):
    np.testing.assert_allclose(a.logits(ids), b.logits(ids), atol=atol, rtol=0)
    assert_greedy_agrees(a.generate(ids, max_new_tokens=n, min_new_tokens=n),
                         b.generate(ids, max_new_tokens=n, min_new_tokens=n), b.logits, 2 * atol,
                         "greedy tokens")


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k", "int4_b32"])
def test_rlx_quantize_writes_a_gguf_that_runs_packed(hf_folder, tmp_path, rng, scheme):
    from click.testing import CliRunner

    from rlx_core.cli import main

    dst = tmp_path / f"m.{scheme}.gguf"
    res = CliRunner().invoke(main, ["quantize", str(hf_folder), str(dst), "--scheme", scheme])
    assert res.exit_code == 0, res.output
    assert re.search(rf"wrote .*: 16 weights in {scheme}", res.output), res.output
    packed = rlx_core.load(str(dst), backend="numpy", progress=False)
    assert all(isinstance(packed.tensors[k], PackedTensor) for k in packed.tensors if k.endswith("proj.weight"))
    f32 = rlx_core.load(str(dst), backend="numpy", progress=False,
                        profile=CompileProfile.llama32_prefill().evolve(precision={"weights": "f32"}))
    assert not any(isinstance(t, PackedTensor) for t in f32.tensors.values())
    ids = rng.integers(0, 151, (2, 9))
    _same_model(packed, f32, ids)
    hf = rlx_core.load(str(hf_folder), backend="numpy", progress=False)     # the unquantized source
    err = np.abs(packed.logits(ids) - hf.logits(ids)).max()
    # the source's weights are a fresh random init each run: over 6 runs q8_0 gave 0.014-0.019
    # (0.021 once in CI), q4_k 0.21-0.28, on logits of max |x| ~1.1; the bounds leave 2x
    assert err < {"q8_0": 0.04, "q4_k": 0.6, "int4_b32": 0.6}[scheme], err     # 4 bits: coarser


def test_a_model_derives_its_fused_weights_once(hf_folder, monkeypatch):
    """A model's prefill and decode executables derive the fused q/k/v and gate/up weights
    in one prologue run between them: binding an executable to private params first, then
    to the model's shared ones, derived (and for a moment held) every fused weight twice."""
    runs = []
    compile_ = NumpyBackend.compile

    def counting(self, lir, params, states):
        runs.append(lir.graph.name) if lir.graph.name.endswith(".prologue") else None
        return compile_(self, lir, params, states)

    monkeypatch.setattr(NumpyBackend, "compile", counting)
    m = rlx_core.load(str(hf_folder), backend="numpy", progress=False)
    m.executable("prefill"), m.executable("decode")
    assert len(runs) == 1, runs
    assert m.generate(np.array([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3).shape == (1, 6)


def test_only_weights_every_run_reads_are_adopted(hf_folder, monkeypatch):
    """Backend.adopt (where a CPU backend may copy a weight into its own memory) gets the
    weights the graphs read; the q/k/v and gate/up only the prologue reads go through
    to_device and are dropped once fused."""
    adopted = []
    monkeypatch.setattr(NumpyBackend, "adopt", lambda self, a: adopted.append(a) or a)
    m = rlx_core.load(str(hf_folder), backend="numpy", progress=False)
    m.executable("prefill"), m.executable("decode")
    fused = [t for k, t in m.tensors.items() if k.endswith(("q_proj.weight", "up_proj.weight"))]
    mlp_out = [t for k, t in m.tensors.items() if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert fused and not any(np.shares_memory(a, t) for a in adopted for t in fused)
    assert all(any(np.shares_memory(a, t) for a in adopted) for t in mlp_out)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_gguf_packed_matches_dequantized(name):
    from rlx_core.weights import resolve_model_path

    try:
        resolve_model_path(name)
    except WeightError as e:
        pytest.skip(f"the {name} weights package is not installed: {e}")
    packed = rlx_core.load(name, backend="numpy", progress=False)
    assert any(isinstance(t, PackedTensor) for t in packed.tensors.values())
    prof = CompileProfile.preset(packed.profile.name).evolve(precision={"weights": "f32"})
    f32 = rlx_core.load(name, backend="numpy", progress=False, profile=prof)
    ids = np.array([packed.tokenizer.encode("The three primary colors are red,")])
    _same_model(packed, f32, ids, n=6)


def test_packed_weights_follow_the_compute_precision(rng):
    """An embedding lookup's dequantize computes in the profile's precision like every float."""
    def f(m):
        ids = m.input("ids", ("s",), rlx_core.I64)
        h = m.gather(m.param("table", (N, K), scheme="q8_0"), ids)
        return m.linear(h, m.param("w", (N, K), scheme="q8_0"))
    params = {"table": _weights(rng, "q8_0", name="table"), "w": _weights(rng, "q8_0", name="w")}
    prof = CompileProfile().evolve(precision={"compute": "bf16"})
    exe = rlx_core.compile(Graph.define("p", f), profile=prof, backend="numpy", params=params)
    dq = [n for n in exe.mir.nodes if n.op == "dequantize"]
    assert dq and all(n.outs[0].dtype.value == "bf16" for n in dq)
    ids = np.array([1, 5])
    want = rlx_core.compile(Graph.define("p", f), backend="numpy", params=params).run(ids=ids)
    got = exe.run(ids=ids)
    for k in want:
        np.testing.assert_allclose(got[k].astype(np.float32), want[k], rtol=2e-2, atol=2e-2 * np.abs(want[k]).max())


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("scheme", ["q4_1", "q6_k"])
def test_int8_activations_round_x_before_the_packed_matmul(rng, backend, scheme):
    """`[precision] activations = "int8"`: x reaches every packed matmul rounded through
    int8_b32 blocks (the q, k, v projections share one rounding), as the float64 reference
    of the rounded x times the dequantized weight; "f32" leaves x alone."""
    _require(backend)
    params = {n: _weights(rng, scheme, name=n) for n in ("w0", "w1", "w2", "table")}
    prof = CompileProfile().evolve(precision={"activations": "int8"})
    exe = rlx_core.compile(_mlp(scheme), profile=prof, backend=backend, params=params)
    assert [n.op for n in exe.mir.nodes].count("fake_quantize") == 1
    i8 = QuantScheme.parse("int8_b32")
    for s in (1, 5):
        x = rng.standard_normal((s, K)).astype(np.float32)
        xr = i8.dequantize(i8.quantize(x), x.shape).astype(np.float64)
        out = exe.run(x=x, ids=np.zeros(s, np.int64))
        for i in range(3):
            w = QuantScheme.parse(scheme).dequantize_reference(params[f"w{i}"].raw, (N, K))
            ref = xr @ w.T
            np.testing.assert_allclose(out[f"y{i}"], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ProfileError, match=r"\[precision\] activations = 'q8'"):
        CompileProfile.from_toml_str('[precision]\nactivations = "q8"')


def test_executables_sharing_weights_derive_fused_weights_once(rng):
    """Two executables over one params dict (a model's prefill and decode) hold one copy of
    each fused (hoisted) weight, and neither keeps a weight only its prologue reads."""
    params = {n: _weights(rng, "q8_0", name=n) for n in ("w0", "w1", "w2", "table")}
    shared: dict = {}
    exes = []
    def qkv(m):
        x = m.input("x", ("s", K))
        return {"y": m.concat([m.linear(x, m.param(w, (N, K), scheme="q8_0")) for w in ("w0", "w1", "w2")], axis=-1)}

    for name in ("prefill", "decode"):
        exe = rlx_core.compile(Graph.define(name, qkv), backend="numpy")
        exe.shared = shared
        exe.set_params({k: v for k, v in params.items() if k != "table"})
        exes.append(exe)
    hoisted = [{k: v for k, v in e._params.items() if k.startswith("__hoisted.")} for e in exes]
    assert hoisted[0] and all(hoisted[0][k] is v for k, v in hoisted[1].items())
    assert not {n.name for n in exes[0].mir.nodes if n.op == "param"} & {"w0", "w1", "w2"}
    x = rng.standard_normal((2, K)).astype(np.float32)
    want = np.concatenate([matmul_reference(x, params[w].raw, "q8_0", (N, K)) for w in ("w0", "w1", "w2")], -1)
    for e in exes:
        np.testing.assert_allclose(e.run(x=x)["y"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_file_pages_of_weights_only_a_prologue_reads_are_released(rng, tmp_path):
    """Weights read from a file mapping that only the prologue reads (the q, k, v a fused
    weight was concatenated from) leave the process's resident memory; the result stands."""
    n, k = 512, 1024                                   # 2 MiB per weight
    path = tmp_path / "weights.bin"
    ws = rng.standard_normal((3, n, k)).astype(np.float32)
    ws.tofile(path)
    blob = np.memmap(path, dtype=np.float32, mode="r", shape=(3, n, k))

    def resident_kb() -> int:
        kb, mine = 0, False
        for line in open("/proc/self/smaps"):
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                mine = line.rstrip().endswith(str(path))
            elif mine and line.startswith("Rss:"):
                kb += int(line.split()[1])
        return kb

    def qkv(m):
        x = m.input("x", ("s", k))
        return {"y": m.concat([m.linear(x, m.param(w, (n, k))) for w in ("w0", "w1", "w2")], axis=-1)}

    float(np.asarray(blob).sum())                      # every page resident
    before = resident_kb()
    exe = rlx_core.compile(Graph.define("qkv", qkv), backend="numpy")
    exe.set_params({f"w{i}": blob[i] for i in range(3)})
    assert before >= 3 * n * k * 4 // 1024 - 8 and resident_kb() < before // 4
    x = rng.standard_normal((2, k)).astype(np.float32)
    want = np.concatenate([x.astype(np.float64) @ w.T.astype(np.float64) for w in ws], -1)
    np.testing.assert_allclose(exe.run(x=x)["y"], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("scheme,act", [("q8_0", "identity"), ("q4_k", "silu")])
def test_numpy_decodes_a_large_weight_in_parts(rng, monkeypatch, scheme, act):
    """A packed weight over PARALLEL_BYTES is decoded in row ranges side by side (one per
    BLAS thread): the result equals the float64 reference, bias and activation included.
    The host's thread counts are set here, so the parts run on any machine."""
    import rlx_core.backends.numpy as nb

    calls = []
    monkeypatch.setattr(nb, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(nb, "_cores", lambda: 3)
    monkeypatch.setattr(nb, "blas_threads", lambda: 3)
    kernel = nb.KERNELS["dequant_matmul"]
    monkeypatch.setitem(nb.KERNELS, "dequant_matmul", lambda a, out, x, w, b=None: (
        calls.append(w.shape[0]), kernel(a, out, x, w, b)))
    n, k = 37, 512
    packed = quantize(rng.standard_normal((n, k)).astype(np.float32), scheme)
    x, b = rng.standard_normal((2, 5, k)).astype(np.float32), rng.standard_normal(n).astype(np.float32)

    def f(m):
        y = m.add("dequant_matmul", (m.input("x", (2, 5, k)), m.param("w", packed.data.shape, rlx_core.DType.U8),
                                     m.input("b", (n,))), scheme=scheme, act=act)
        return y
    exe = rlx_core.compile(Graph.define("dq", f), backend="numpy", params={"w": packed.data})
    got = exe.run({"x": x, "b": b})["out"]
    assert sorted(calls) == [12, 12, 13]
    y = matmul_reference(x.astype(np.float64), packed.data, scheme, (n, k)) + b
    want = y if act == "identity" else y / (1 + np.exp(-y))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
