"""Streams in the flow DSL (rlx_core.flow.stream): inputs bound to streams, store / load /
accumulate / join / split, dual_stream with the Emit handle, a plugin block reading and
writing streams through plugin_named, errors naming the stage and the streams that exist,
and the generic DiT pieces (rlx_core.flow.dit) against numpy written out by hand."""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from rlx_core.flow import ModelFlow
from rlx_core.flow import stream
from rlx_core.flow.dit import MultiAxisRope, TimestepEmbed
from rlx_core.ir.dtype import F32
from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl
from rlx_core.plugins.manager import temporary_plugin


def run(flow: ModelFlow, weights: dict, feed: dict) -> dict:
    exe = flow.build(weights).compile("numpy")
    return exe.run(feed)


def two_inputs(f: ModelFlow) -> ModelFlow:
    return f.input("a", (2, 3, 4), F32).input("b", (2, 5, 4), F32)


def test_streams_move_values_and_dual_stream_rewrites_two(rng):
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 5, 4)).astype(np.float32)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    f = two_inputs(ModelFlow("s")).bind_inputs_to_streams({stream.IMG: "a", stream.TXT: "b"})
    f.load_stream(stream.IMG).linear("w").store_stream(stream.IMG)
    f.dual_stream("swap_scale", stream.IMG, stream.TXT, lambda m, x, y: (x * 2.0, y + 1.0))
    f.load_stream(stream.TXT).accumulate_stream(stream.TXT)            # txt = 2 * txt
    f.join_streams((stream.TXT, stream.IMG), into=stream.MAIN).split_stream(stream.MAIN)
    f.load_stream(stream.IMG).output("img").load_stream(stream.TXT)
    out = run(f, {"w": w}, {"a": a, "b": b})
    np.testing.assert_allclose(out["img"], 2 * (a @ w.T), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["logits"], 2 * (b + 1), rtol=1e-6, atol=1e-6)


def test_stream_records_say_who_bound_wrote_and_read():
    f = two_inputs(ModelFlow("s")).bind_inputs_to_streams({"img": "a"}).load_stream("img")
    built = f.build({})
    recs = [(r.stream, r.action, r.stage, r.source) for r in built.streams]
    assert recs == [("img", "write", "bind_inputs_to_streams", "input a"), ("img", "read", "load_stream", "")]


def test_a_missing_stream_names_the_stage_and_the_streams_there_are():
    f = two_inputs(ModelFlow("s")).bind_inputs_to_streams({"img": "a", "txt": "b"}).load_stream("image")
    with pytest.raises(ModelError, match=r"load_stream: no stream 'image'; streams that exist: \['img', 'txt'\]"):
        f.build({})
    f = two_inputs(ModelFlow("s")).dual_stream("mix", "img", "txt", lambda m, x, y: (x, y))
    with pytest.raises(ModelError, match=r"dual_stream: no stream 'img'; streams that exist: none"):
        f.build({})


def test_binding_an_undeclared_input_names_it():
    with pytest.raises(ModelError, match=r"stream 'img' names input 'pixels'.*inputs: \['a', 'b'\]"):
        two_inputs(ModelFlow("s")).bind_inputs_to_streams({"img": "pixels"}).load_stream("img").build({})


def test_dual_stream_must_return_a_pair():
    f = two_inputs(ModelFlow("s")).bind_inputs_to_streams({"x": "a", "y": "b"})
    f.dual_stream("bad", "x", "y", lambda m, x, y: x).load_stream("x")
    with pytest.raises(ModelError, match="dual_stream 'bad': fn must return a pair"):
        f.build({})


@attrs.frozen
class ScaleStreams:
    """A plugin block that reads two streams and writes one, inside a layer."""
    src: str
    dst: str

    def emit(self, ctx, value):
        w = ctx.param(ctx.key("gain"), (4,))
        ctx.set_stream(self.dst, ctx.stream(self.src, self) * w + ctx.stream(self.dst, self), self)
        return value


class StreamBlocks:
    @hookimpl
    def rlx_register_blocks(self, register):
        register("test_scale_streams", ScaleStreams)


def test_plugin_named_block_reads_and_writes_streams_in_layers(rng):
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 3, 4)).astype(np.float32)
    g0, g1 = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    with temporary_plugin(StreamBlocks(), "test-stream-blocks"):
        f = ModelFlow("s", layer_prefix="blocks").input("a", (2, 3, 4), F32).input("b", (2, 3, 4), F32)
        f.bind_inputs_to_streams({"img": "a", "txt": "b"})
        f.repeat_layers(2, lambda s: s.plugin_named("test_scale_streams", src="img", dst="txt"))
        f.load_stream("txt")
        out = run(f, {"blocks.0.gain": g0, "blocks.1.gain": g1}, {"a": a, "b": b})
        f2 = ModelFlow("s").input("a", (2, 3, 4), F32).plugin_named("test_scale_streams", src="img", dst="txt")
        with pytest.raises(ModelError, match="scale_streams: no stream 'img'; streams that exist: none"):
            f2.build({"gain": g0})
    np.testing.assert_allclose(out["logits"], a * g1 + (a * g0 + b), rtol=1e-6, atol=1e-6)


def test_timestep_embedding_and_multi_axis_rope_match_numpy(rng):
    t = rng.uniform(0, 1, 3).astype(np.float32)
    ids = rng.integers(0, 20, (5, 3)).astype(np.float32)
    w1, b1 = rng.standard_normal((6, 16)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    w2, b2 = rng.standard_normal((6, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    f = ModelFlow("dit").input("t", (3,), F32).input("ids", (5, 3), F32)
    f.raw_stage(MultiAxisRope(("ids",), (2, 4, 6), theta=100.0))
    f.custom(lambda m, v, ctx: ctx.state["rope"][0]).output("cos")
    f.raw_stage(TimestepEmbed("t", "te", channels=16))
    out = run(f, {"te.linear_1.weight": w1, "te.linear_1.bias": b1, "te.linear_2.weight": w2,
                  "te.linear_2.bias": b2}, {"t": t, "ids": ids})
    # numpy, in float64, written from the definitions
    half = 8
    freqs = np.exp(-math.log(10000) * np.arange(half) / half)
    arg = (t.astype(np.float64) * 1000)[:, None] * freqs[None]
    emb = np.concatenate([np.cos(arg), np.sin(arg)], -1)
    h = emb @ w1.T + b1
    want = (h / (1 + np.exp(-h))) @ w2.T + b2
    np.testing.assert_allclose(out["logits"], want, rtol=2e-4, atol=2e-4)
    cols = [ids[:, j:j + 1].astype(np.float64) / 100.0 ** (np.arange(0, d, 2) / d) for j, d in enumerate((2, 4, 6))]
    np.testing.assert_allclose(out["cos"], np.cos(np.concatenate(cols, -1)), rtol=0, atol=2e-6)


def test_multi_axis_rope_checks_the_id_columns():
    f = ModelFlow("dit").input("ids", (5, 2), F32).raw_stage(MultiAxisRope(("ids",), (2, 4, 6)))
    with pytest.raises(ModelError, match=r"input 'ids': position ids must be \[tokens, 3\].*got \[5, 2\]"):
        f.build({})
