"""Tensor parallelism (issue 19) on the CPU: the sharding pass's per-rank MIR, its errors,
and rank processes over the shared-memory communicator giving the unsharded model's logits
and greedy tokens (the unsharded CausalLM in this process is the reference)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from rlx_core.ir.errors import GraphError, ModelError, ProfileError
from rlx_core.ir.graph import MIR, Builder
from rlx_core.passes.shard import reshape_groups, shard
from rlx_core.pipeline import CompilePipeline
from rlx_core.profile import CompileProfile
from rlx_core.runtime.model import find_recipe
from rlx_core.runtime.tp import TensorParallel, tensor_size
from rlx_core.testing.parity import assert_greedy_agrees
from rlx_core.weights.checkpoint import Checkpoint

PROMPT = [5, 7, 9, 11, 13, 3]


def _model(model_type: str, seed: int = 0, **config):
    """(config, tensors, model) of the recipe's tiny model (`config` overrides keys)."""
    r = find_recipe(model_type)
    cfg = dict(r.tiny_config(), **config)
    tensors = r.tiny_tensors(cfg, np.random.default_rng(seed))
    ckpt = Checkpoint(f"tiny-{model_type}", "tiny", cfg, tensors, None)
    return cfg, tensors, r.build(ckpt, backend="numpy")


def _rank_mir(model, mode: str, world: int, rank: int, fused: bool = True):
    pipe = CompilePipeline(model.profile.evolve(parallel={"tensor": world}), model.backend)
    pipe.rank = rank
    pipe.graphs = []
    mir = pipe.optimize(model.built(mode).graph)
    return mir if fused else dict(pipe.graphs)["shard"]


def _count(g, op):
    return sum(1 for n in g.nodes if n.op == op)


# ------------------------------------------------------------------ the pass
def test_rank_mir_has_the_megatron_collectives():
    cfg, _, m = _model("llama")
    layers = cfg["num_hidden_layers"]
    for fused in (False, True):                   # fusion keeps the collectives as boundaries
        g = _rank_mir(m, "decode", 2, 1, fused)
        # one after each o_proj and down_proj, one for the vocab-parallel embedding
        assert _count(g, "all_reduce") == 2 * layers + 1
        assert _count(g, "all_gather") == 1        # the logits, once for all their readers
        assert {n.a["rank"] for n in g.nodes if n.op in ("all_reduce", "all_gather")} == {1}
    params = {n.name: n for n in g.nodes if n.op == "param"}
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert q.outs[0].dims == (16, 32) and q.a["shard"] == ("model.layers.0.self_attn.q_proj.weight", 0, 16, 16, 16)
    down = params["model.layers.0.mlp.down_proj.weight"]
    assert down.outs[0].dims == (32, 24) and down.a["shard"][1:] == (1, 24, 24, 24)
    emb = params["model.embed_tokens.weight"]           # 61 rows: padded to 2 x 31
    assert emb.outs[0].dims == (31, 32) and emb.a["shard"][1:] == (0, 31, 30, 31)
    kv = [n for n in g.nodes if n.op == "state"]
    assert kv and all(n.outs[0].dims[1] == 1 for n in kv)   # 2 kv heads over 2 ranks
    assert "all_reduce" in g.text() and 'shard of "model.embed_tokens.weight"' in g.text()


def test_fewer_kv_heads_than_ranks_replicates_them():
    _, _, m = _model("llama")                     # 4 query heads, 2 kv heads
    for rank in range(4):
        g = _rank_mir(m, "decode", 4, rank, fused=False)
        k = next(n for n in g.nodes if n.op == "param" and n.name.endswith("layers.0.self_attn.k_proj.weight"))
        head = rank // 2                          # query head r reads kv head r // 2
        assert k.outs[0].dims == (8, 32) and k.a["shard"][2:4] == (8 * head, 8)


def test_heads_not_dividing_the_ranks_is_an_error_naming_the_node():
    _, _, m = _model("llama")
    with pytest.raises(GraphError, match=r"node %\d+ \(attention\): 4 query heads do not split over tensor = 3"):
        _rank_mir(m, "decode", 3, 0)


def _attention_graph(kv_read_elsewhere: bool):
    """x -> q/k/v projections -> attention -> o_proj; optionally k also summed whole."""
    m = Builder("g", MIR)
    x = m.input("x", (1, 2, 16))
    w = {n: m.param(n, (r, 16)) for n, r in (("q", 16), ("k", 4), ("v", 4), ("o", 16))}
    heads = lambda t, h: m.add("transpose", (m.add("reshape", (t,), shape=(1, 2, h, 4)),), perm=(0, 2, 1, 3))  # noqa: E731
    q = heads(m.matmul(x, w["q"], trans_b=True), 4)
    k = heads(m.matmul(x, w["k"], trans_b=True), 1)
    v = heads(m.matmul(x, w["v"], trans_b=True), 1)
    a = m.add("attention", (q, k, v), scale=0.5)
    y = m.add("reshape", (m.add("transpose", (a,), perm=(0, 2, 1, 3)),), shape=(1, 2, 16))
    m.output("y", m.matmul(y, w["o"], trans_b=True))
    if kv_read_elsewhere:
        m.output("ksum", m.reduce(k, "sum", (3,)))
    return m.build()


def test_unshardable_node_is_named():
    g = _attention_graph(False)
    s = shard(g, 2, 1)                            # one kv head, two ranks: each holds it
    assert _count(s, "all_reduce") == 1
    with pytest.raises(GraphError, match=r"a graph output needs the whole of %\d+ \(reduce\)"):
        shard(_attention_graph(True), 2, 0)
    with pytest.raises(GraphError, match="sharded already"):
        shard(s, 2, 1)


def test_bind_slices_reads_each_slice_once():
    """A rank's slice of a weight is one object for every executable of the model (their
    shared params are uploaded once), and an array-like weight is asked for its slice only."""
    from rlx_core.passes.shard import bind_slices

    _, tensors, m = _model("llama")

    class Lazy:                                   # an array-like weight recording what is read
        def __init__(self, a):
            self.a, self.shape, self.ndim, self.dtype, self.read = a, a.shape, a.ndim, a.dtype, []

        def __getitem__(self, idx):
            self.read.append(idx)
            return self.a[idx]

    params = {k: Lazy(v) for k, v in tensors.items()}
    nodes = _rank_mir(m, "decode", 2, 1).nodes
    one, two = bind_slices(nodes, params), bind_slices(nodes, params)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert one[q] is two[q] and one[q].shape == (16, 32)
    np.testing.assert_array_equal(one[q], tensors[q][16:32])
    assert params[q].read == [(slice(16, 32),)]


def test_reshape_groups():
    assert reshape_groups(("b", 1, 16), ("b", 1, 2, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert reshape_groups(("b", 4, 8), ("c", 32)) is None
    assert reshape_groups((1, "t", 24), ("t", 4, 6)) == [([0], []), ([1], [0]), ([2], [1, 2])]


def test_profile_section_and_overrides(monkeypatch):
    p = CompileProfile.from_toml_str("[parallel]\ntensor = 2\n")
    assert p.parallel.tensor == 2 and "[parallel]" in p.text()
    for bad in ("tensor = 0", "tensor = true", "ranks = 2"):
        with pytest.raises(ProfileError, match=r"\[parallel\]"):
            CompileProfile.from_toml_str(f"[parallel]\n{bad}\n")
    monkeypatch.setenv("RLX_TP", "4")
    assert tensor_size(None, p) == 4 and tensor_size(3, p) == 3
    monkeypatch.setenv("RLX_TP", "two")
    with pytest.raises(ProfileError, match="RLX_TP='two'"):
        tensor_size(None, p)
    monkeypatch.delenv("RLX_TP")
    assert tensor_size(None, p) == 2
    _, _, m = _model("llama")
    with pytest.raises(ProfileError, match="tensor = 2 but this process is no rank"):
        CompilePipeline(m.profile.evolve(parallel={"tensor": 2}), m.backend).optimize(m.built("decode").graph)


# ------------------------------------------------------------------ sharded = unsharded
@pytest.fixture
def spec(tmp_path):
    def make(model_type: str, config: dict | None = None, **extra):
        cfg, tensors, ref = _model(model_type, **(config or {}))
        path = tmp_path / f"{model_type}.npz"
        np.savez(path, **tensors)
        return {"config": cfg, "tensors": str(path), "backend": "numpy", **extra}, ref
    return make


@pytest.mark.parametrize("model_type,world", [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen3", 4),
                                              ("gemma3_text", 2), ("gemma3_text", 4), ("gemma2", 2)])
def test_sharded_equals_unsharded(spec, model_type, world):
    s, ref = spec(model_type)
    ids = np.array([PROMPT, [0, 0, 4, 8, 12, 16]])
    with TensorParallel(s, world, timeout=60) as tp:
        got, want = tp.logits(ids), ref.logits(ids)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        out = tp.generate(PROMPT, max_new_tokens=12)
        assert_greedy_agrees(out, ref.generate(PROMPT, max_new_tokens=12), ref.logits,
                             4e-5 * np.abs(want).max(), "sharded against unsharded")
        assert len(out) == len(PROMPT) + 12


BERT4 = {"num_attention_heads": 4}      # the kit's tiny BERT has 3 heads: 4 split over 2 and 4 ranks


def test_bert_rank_mir_is_megatron_sharded():
    """The fused QKV (a matmul on concat(q, k, v) read through views) and the matmul
    epilogues (bias + GELU) of BERT's `direct` MIR shard like separate projections."""
    cfg, _, m = _model("bert", **BERT4)
    g = _rank_mir(m, "padded", 2, 1, fused=False)
    layers = cfg["num_hidden_layers"]
    # attention output and FFN output per layer; word, position and token-type embeddings
    assert _count(g, "all_reduce") == 2 * layers + 3 and _count(g, "all_gather") == 0
    params = {n.name: n for n in g.nodes if n.op == "param"}
    q = params["encoder.layer.0.attention.self.query.weight"]
    assert q.outs[0].dims == (12, 24) and q.a["shard"][1:3] == (0, 12)
    assert params["encoder.layer.0.attention.self.value.bias"].outs[0].dims == (12,)
    assert params["encoder.layer.0.intermediate.dense.weight"].a["shard"][1:3] == (0, 20)
    out = params["encoder.layer.0.output.dense.weight"]
    assert out.outs[0].dims == (24, 20) and out.a["shard"][1:3] == (1, 20)
    bias = params["encoder.layer.0.output.dense.bias"]        # added once, after the all_reduce
    assert not bias.a.get("shard")
    assert all(n.outs[0].dims[1] == 2 for n in g.nodes if n.op == "attention")   # 2 of 4 heads
    fused = _rank_mir(m, "padded", 2, 1)
    assert _count(fused, "fused_matmul_bias_act") == 4 * layers       # q, k, v, FFN-in re-fused
    packed = _rank_mir(m, "packed", 2, 1, fused=False)     # [1, tokens, h] -> [tokens, heads, d]
    assert _count(packed, "all_reduce") == 2 * layers + 3 and _count(packed, "all_gather") == 0
    assert all(n.outs[0].dims[1] == 2 for n in packed.nodes if n.op == "varlen_attention")


def test_nomic_rank_mir_splits_the_one_qkv_weight():
    """NomicBERT's Wqkv is one [3h, h] weight read through three views: each becomes a
    column-parallel slice of that weight (a part of a part), no gather anywhere."""
    _, _, m = _model("nomic_bert")
    g = _rank_mir(m, "padded", 2, 1, fused=False)
    assert _count(g, "all_gather") == 0 and _count(g, "all_reduce") == 2 * 2 + 2   # + word, token-type
    w = "encoder.layers.0.attn.Wqkv.weight"
    shards = sorted(n.a["shard"] for n in g.nodes if n.op == "param" and (n.a.get("shard") or ("",))[0] == w)
    assert shards == [(w, 0, 24, 24, 24), (w, 0, 72, 24, 24), (w, 0, 120, 24, 24)]   # rank 1's q, k, v rows
    assert not any(n.op == "param" and n.name == w for n in g.nodes)                 # never bound whole


@pytest.mark.parametrize("model_type,config,world", [("bert", BERT4, 2), ("bert", BERT4, 4),
                                                     ("nomic_bert", None, 2)])
def test_bert_sharded_equals_unsharded(spec, model_type, config, world):
    s, ref = spec(model_type, config)
    ids = np.array([[2, 7, 9, 11, 13, 3], [2, 4, 8, 3, 0, 0]])
    mask = ids != 0
    types = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    rows = [r[r != 0].tolist() for r in ids]
    with TensorParallel(s, world, timeout=60) as tp:
        got = tp.forward(ids, mask, types)
        emb, tokens = tp.embed(rows)                 # (the layout embed runs: packed on numpy)
    want = ref.forward(ids, mask, types)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5 * np.abs(want[k]).max(), err_msg=k)
    np.testing.assert_allclose(emb, ref.embed(rows), rtol=1e-5, atol=1e-5)
    assert tokens == mask.sum()


def test_killed_rank_stops_the_group_naming_it(spec):
    s, _ = spec("llama", fault={"rank": 1, "after_tokens": 3})
    tp = TensorParallel(s, 2, timeout=60)
    pids = tp.pids()
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=r"rank 1 \(pid \d+\) died while generating \(exit code 9\)"):
        tp.generate(PROMPT, max_new_tokens=20)
    assert time.monotonic() - t0 < tp.timeout            # the rank's exit told, not the timeout
    for pid in pids:                              # no orphans
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ModelError, match="stopped"):
        tp.generate(PROMPT, max_new_tokens=2)


def test_group_scheduler_serves_like_the_scheduler_and_fails_with_the_rank(spec):
    """The serving path (GroupScheduler: Scheduler rounds replayed on the ranks): requests in
    one batch give the unsharded Scheduler's tokens; a rank killed mid-decode fails the
    running requests naming it, stops the group and closes the scheduler."""
    from rlx_core.runtime.scheduler import Scheduler
    from rlx_core.runtime.tp import GroupScheduler

    s, ref = spec("llama", fault={"rank": 1, "after_tokens": 14})
    prompts = [PROMPT, [4, 8, 12], [9, 9, 2, 30]]
    with Scheduler(ref, max_batch=4) as sched:
        want = [sched.submit(p, max_tokens=4).result(60).token_ids for p in prompts]
    tp = TensorParallel(s, 2, timeout=60)
    pids = tp.pids()
    sched = GroupScheduler(tp, ref, max_batch=4)
    try:
        reqs = [sched.submit(p, max_tokens=4) for p in prompts]     # 12 tokens: rank 1 lives on
        assert [r.result(60).token_ids for r in reqs] == want
        r = sched.submit(PROMPT, max_tokens=20)
        with pytest.raises(ModelError, match=r"rank 1 \(pid \d+\) died while serving \(exit code 9\)"):
            r.result(60)
        assert r.finish_reason == "error"
        with pytest.raises(ModelError, match=r"the scheduler is closed \(tensor parallel: rank 1 "):
            sched.submit(PROMPT, max_tokens=2)
    finally:
        sched.close()
        tp.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_cli_generate_tp_flag(monkeypatch):
    from click.testing import CliRunner

    from rlx_core.cli import main

    r = CliRunner().invoke(main, ["generate", "--help"])
    assert r.exit_code == 0 and "--tp" in r.output
    r = CliRunner().invoke(main, ["generate", "m", "hi", "--tp", "0"])
    assert r.exit_code == 2 and "--tp" in r.output
    monkeypatch.setenv("RLX_TP", "x")
    r = CliRunner().invoke(main, ["generate", "m", "hi"])
    assert r.exit_code != 0 and "RLX_TP='x'" in r.output
