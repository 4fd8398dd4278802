"""The pure parts of benchmarks/serve_race.py's peers (llama-server's command line) and of
benchmarks/gguf_standin.py (a GGUF's header travelling without its weights, filled again with
random weights of the same types: what the GPU race serves when the packaged file cannot travel)."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gguf_standin  # noqa: E402
import serve_race  # noqa: E402

Q = gguf.GGMLQuantizationType


def test_llama_server_cmd_gives_a_slot_of_ctx_tokens_per_client():
    cmd = serve_race.llama_server_cmd("/b/llama-server", "/m.gguf", 8123, clients=32, ctx=4096, threads=4,
                                      gpu=True)
    flag = {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}
    assert cmd[0] == "/b/llama-server"
    assert flag["--model"] == "/m.gguf" and flag["--port"] == "8123"
    assert flag["--alias"] == serve_race.MODEL          # the name the clients ask for
    assert flag["--parallel"] == "32" and flag["--ctx-size"] == str(32 * 4096)
    assert flag["--threads"] == flag["--threads-batch"] == "4"
    assert flag["--n-gpu-layers"] == "99"
    assert "--cont-batching" in cmd and "--cache-prompt" in cmd
    cpu = serve_race.llama_server_cmd("b", "m", 1, clients=1, ctx=8, threads=1, gpu=False)
    assert cpu[cpu.index("--n-gpu-layers") + 1] == "0"


def test_every_peer_decodes_exactly_max_tokens():
    assert serve_race.no_eos("llama-server") == {"ignore_eos": True}
    bias = serve_race.no_eos("llama")["logit_bias"]     # llama-cpp-python has no ignore_eos
    assert {int(t) for t in bias} == set(serve_race.END_TOKENS) and set(bias.values()) == {-100}


def write_gguf(path: str, rng: np.random.Generator) -> dict:
    """A small GGUF (test_weights' writer: metadata and a vocabulary) with one tensor of each
    type gguf_standin fills: {name: (GGML type, numpy shape)}."""
    from test_weights import _write_gguf

    tensors = {"norm.weight": (Q.F32, (64,)), "emb.weight": (Q.Q8_0, (5, 64)),
               "ffn.weight": (Q.Q4_1, (3, 96)), "attn.weight": (Q.Q4_0, (2, 32)), "out.weight": (Q.F16, (4, 64))}
    _write_gguf(path, "llama", {n: (rng.standard_normal(shape).astype(np.float32), kind)
                                for n, (kind, shape) in tensors.items()},
                tokens=["<s>", "</s>", "a", "b"], merges=["a b"])
    return tensors


def test_standin_keeps_the_header_and_fills_bounded_random_weights(tmp_path, rng):
    src, head, out = (str(tmp_path / n) for n in ("src.gguf", "src.head", "out.gguf"))
    tensors = write_gguf(src, rng)
    gguf_standin.cut(src, head)
    gguf_standin.fill(head, out, seed=int(rng.integers(1 << 30)))
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert os.path.getsize(out) == os.path.getsize(src)
    with open(src, "rb") as f, open(out, "rb") as g:
        assert f.read(a.data_offset) == g.read(b.data_offset)           # metadata, tokenizer, table
    got = {t.name: t for t in b.tensors}
    for t in a.tensors:
        kind, shape = tensors[t.name]
        u = got[t.name]
        assert u.tensor_type == t.tensor_type == kind and list(u.shape) == list(t.shape)
        x = gguf.quants.dequantize(np.asarray(u.data), kind).astype(np.float64).reshape(shape)
        assert np.isfinite(x).all()
        if len(shape) == 1:                                             # a norm's gain: near 1
            assert abs(x.mean() - 1) < 0.02 and x.std() < 0.05
        else:                                   # uniform in +-sqrt(3 / row): unit variance per row's dot
            bound = math.sqrt(3 / shape[-1])
            tol = bound * (2 ** -10 + 2 ** -9) if kind != Q.F32 else 1e-7  # float16 scales and values
            assert np.abs(x).max() <= bound + tol and x.std() > bound / 4
            assert not np.array_equal(x, gguf.quants.dequantize(np.asarray(t.data), kind).reshape(shape))


def test_standin_names_a_type_it_cannot_fill():
    with pytest.raises(SystemExit, match="Q6_K"):
        gguf_standin.weights("Q6_K", [256, 2], 420, np.random.default_rng(0))


def run_json(path, side: str, tokens_per_s: float, **sizes) -> str:
    """An earlier run's --json file: one side's scenario 1 at `sizes`."""
    import json

    args = dict(dict(sides=[side], json=str(path), threads=2, backend="cuda", clients=32, new=64, rounds=3,
                     system_tokens=1000, scenarios=["shared"], stall_budget=None, prefill_chunk=256), **sizes)
    shared = {"tokens_per_s": tokens_per_s, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "loadavg": [0.5, 0.6]}
    with open(path, "w") as f:
        json.dump({"hardware": "H200", "args": args, "client_pin": "servers on cores [0, 1]",
                   "model": "m.gguf", side: {"command": side, "shared": shared}}, f)
    return str(path)


def test_report_joins_runs_of_the_same_sizes(tmp_path, capsys):
    rlx = run_json(tmp_path / "rlx.json", "rlx", 300.0)
    serve_race.report_files([rlx, run_json(tmp_path / "peer.json", "llama-server", 200.0)])
    out = capsys.readouterr().out
    assert "throughput rlx/llama-server: 1.50x" in out and "p99 TTFT rlx/llama-server: 1.00x" in out
    with pytest.raises(SystemExit, match="peer2.json ran other sizes than .*rlx.json: clients"):
        serve_race.report_files([rlx, run_json(tmp_path / "peer2.json", "llama-server", 1.0, clients=8)])


def test_window_positions_and_their_p99_carry_over_to_another_run(rng):
    gaps = rng.uniform(0.01, 0.05, 40)
    gaps[10:14] = rng.uniform(1.0, 2.0, 4)               # a stall: the "during" gaps
    arrivals = list(np.cumsum(gaps))                      # chunk i at arrivals[i]; gap i ends there
    t0 = arrivals[10] - gaps[10] / 2                     # inside gap 10 ...
    t1 = arrivals[13] - gaps[13] / 2                     # ... to inside gap 13
    w = serve_race.window(arrivals, t0, t1)
    assert w == range(10, 14)
    assert serve_race.window(arrivals, arrivals[10], arrivals[12]) == range(11, 13)   # ends, not inside
    assert serve_race.window(arrivals, arrivals[-1], arrivals[-1] + 1) == range(40, 40)
    other = list(np.cumsum(rng.uniform(0.01, 0.05, 40)))  # a control run: the same positions, other times
    p99, n = serve_race.p99_at([arrivals, other], [w, w])
    want = sorted(list(gaps[10:14]) + [other[i] - other[i - 1] for i in w])
    assert n == 8 and p99 == pytest.approx(want[-1], rel=1e-12)   # nearest rank: p99 of 8 is the largest
    assert serve_race.p99_at([other], [w]) == (max(other[i] - other[i - 1] for i in w), 4)
    with pytest.raises(serve_race.SideFailed, match="not past its window's position 13"):
        serve_race.p99_at([other[:13]], [w])
