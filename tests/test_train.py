"""rlx_core.runtime.train: the optimizer's update inside the step graph, weights and moments
as states written by `assign`. Trajectories against float64 NumPy references of the same
optimizers, on every backend that runs here; the errors name the argument."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import rlx_core
from rlx_core import BF16, F32, F64, Builder
from rlx_core.ir.errors import GraphError, ModelError, ShapeError
from rlx_core.runtime.train import MASTER, SGD, Adam, Trainer, train_graph
from rlx_core.testing.parity import backend_params

BACKENDS = backend_params()


def regression(dtype=F32) -> rlx_core.Graph:
    """loss = mean((x @ W + b - y)^2) with W [3, 2], b [2]."""
    m = Builder("regression")
    x, y = m.input("x", (8, 3), dtype), m.input("y", (8, 2), dtype)
    d = m.matmul(x, m.param("W", (3, 2), dtype)) + m.param("b", (2,), dtype) - y
    m.output("loss", m.mean(m.cast(d * d, F64 if dtype == F64 else F32), (0, 1)))
    return m.build()


def reference(opt, w: dict, batches, steps: int, lrs=None, clip=None) -> tuple:
    """(losses, weights, gradient norms) of `steps` float64 steps of `opt` (the formulas
    written out), with per-step learning rates `lrs` and clipping at global norm `clip`."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    slots = {k: {s: np.zeros_like(v) for s in ("m", "v", "buf")} for k, v in w.items()}
    losses, norms = [], []
    for t in range(1, steps + 1):
        lr = opt.lr if lrs is None else lrs[t - 1]
        x, y = (a.astype(np.float64) for a in batches[(t - 1) % len(batches)])
        d = x @ w["W"] + w["b"] - y
        losses.append(float(np.mean(d * d)))
        dd = 2 * d / d.size
        grads = {"W": x.T @ dd, "b": dd.sum(0)}
        norms.append(math.sqrt(sum(float((g * g).sum()) for g in grads.values())))
        if clip is not None:
            grads = {k: g * min(1.0, clip / (norms[-1] + 1e-6)) for k, g in grads.items()}
        for k, g in grads.items():
            s = slots[k]
            if isinstance(opt, Adam):
                b1, b2 = opt.betas
                s["m"] = b1 * s["m"] + (1 - b1) * g
                s["v"] = b2 * s["v"] + (1 - b2) * g * g
                w[k] = w[k] * (1 - lr * opt.weight_decay) - lr * (s["m"] / (1 - b1 ** t)) / (
                    np.sqrt(s["v"] / (1 - b2 ** t)) + opt.eps)
            else:
                s["buf"] = opt.momentum * s["buf"] + g if opt.momentum else g
                w[k] = w[k] * (1 - lr * opt.weight_decay) - lr * s["buf"]
    return losses, w, norms


def problem(rng):
    w = {"W": rng.standard_normal((3, 2)).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)}
    batches = [(rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32))
               for _ in range(3)]
    return w, batches


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", [Adam(lr=0.05), Adam(lr=0.02, betas=(0.8, 0.99), weight_decay=0.1),
                                 SGD(lr=0.1), SGD(lr=0.05, momentum=0.9, weight_decay=0.01)], ids=repr)
def test_trajectory_matches_the_formulas(backend, rng, opt):
    w, batches = problem(rng)
    tr = Trainer(regression(), w, opt, backend=backend)
    losses = [tr.step({"x": x, "y": y}) for x, y in (batches * 3)[:7]]
    want_losses, want_w, _ = reference(opt, w, batches, 7)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=1e-6)
    got = tr.weights()
    for k in want_w:
        np.testing.assert_allclose(got[k], want_w[k], rtol=2e-5, atol=2e-6, err_msg=k)
    assert got["W"].dtype == np.float32


@pytest.mark.parametrize("backend", backend_params(only=("numpy", "numba", "cuda")))
@pytest.mark.parametrize("opt", [Adam(lr=0.05, weight_decay=0.1), SGD(lr=0.1, momentum=0.5)], ids=repr)
def test_a_schedule_and_clipping(backend, rng, opt):
    """lr per step (a warmup then decay) and gradients clipped at a global norm that the
    first steps exceed and later ones do not; grad_norm is the norm before clipping."""
    w, batches = problem(rng)
    lrs = [opt.lr * f for f in (0.2, 0.6, 1.0, 0.8, 0.5, 0.3, 0.1)]
    _, _, norms = reference(opt, w, batches, 7, lrs)
    clip = float(np.median(norms))
    tr = Trainer(regression(), w, opt, clip_norm=clip, backend=backend)
    losses, got_norms = [], []
    for t, (x, y) in enumerate((batches * 3)[:7]):
        losses.append(tr.step({"x": x, "y": y}, lr=lrs[t]))
        got_norms.append(tr.grad_norm)
    want_losses, want_w, want_norms = reference(opt, w, batches, 7, lrs, clip)
    assert min(want_norms) < clip < max(want_norms)            # clipping both bit and did not
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got_norms, want_norms, rtol=2e-5)
    for k in want_w:
        np.testing.assert_allclose(tr.weights()[k], want_w[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_the_callers_weights_are_not_written(rng):
    w, batches = problem(rng)
    before = {k: v.copy() for k, v in w.items()}
    tr = Trainer(regression(), w, SGD(lr=0.5), backend="numpy")
    tr.step({"x": batches[0][0], "y": batches[0][1]})
    for k in w:
        np.testing.assert_array_equal(w[k], before[k])
        assert not np.array_equal(tr.weights()[k], before[k])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_weights_train_through_an_f32_master(backend, rng):
    """Updates below a bf16 step accumulate in the f32 master; the bf16 weight the forward
    pass reads is the master's rounding."""
    w, batches = problem(rng)
    w16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()}
    opt = SGD(lr=1e-4)
    try:
        tr = Trainer(regression(BF16), w16, opt, backend=backend)
    except rlx_core.RlxError as e:
        if "bf16" not in str(e):
            raise
        pytest.skip(f"backend {backend!r}: {e}")
    for x, y in (batches * 14)[:40]:
        tr.step({"x": x.astype(ml_dtypes.bfloat16), "y": y.astype(ml_dtypes.bfloat16)})
    master = {k: tr.exe.backend.to_host(tr.exe.states[MASTER + k]) for k in w}
    got = tr.weights()
    for k in w:
        assert got[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[k], master[k].astype(ml_dtypes.bfloat16))
    # the weights moved, and the master holds what a bf16 weight cannot
    assert any((got[k] != w16[k]).any() for k in w)
    assert any((master[k] != master[k].astype(ml_dtypes.bfloat16).astype(np.float32)).any() for k in w)


def test_frozen_params_stay_bound(rng):
    w, batches = problem(rng)
    tr = Trainer(regression(), w, SGD(lr=0.1), wrt=["W"], backend="numpy")
    assert sorted(tr.exe.states) == ["W"]
    for x, y in batches:
        tr.step({"x": x, "y": y})
    assert sorted(tr.weights()) == ["W"]
    wb = {"W": w["W"].astype(np.float64)}
    for x, y in batches:
        d = x @ wb["W"] + w["b"] - y
        wb["W"] = wb["W"] - 0.1 * (x.T @ (2 * d / d.size))
    np.testing.assert_allclose(tr.weights()["W"], wb["W"], rtol=1e-5, atol=1e-6)


def test_the_graph_writes_every_state_last():
    g = train_graph(regression(), ["W", "b"], Adam())
    ops = [n.op for n in g.nodes]
    first = ops.index("assign")
    assert ops[first:] == ["assign"] * 6 and ops.count("assign") == 6
    assert sorted(g.states) == ["W", "b", "opt.m.W", "opt.m.b", "opt.v.W", "opt.v.b"]
    assert sorted(g.inputs) == ["opt.eps", "opt.lr", "opt.step_size", "x", "y"]
    assert [name for name, _ in g.outputs] == ["loss"]


def test_adam_scalars_fold_the_bias_corrections():
    opt = Adam(lr=0.1, betas=(0.9, 0.99), eps=1e-6)
    s = opt.scalars(3, 0.1)
    assert math.isclose(s["step_size"], 0.1 * math.sqrt(1 - 0.99 ** 3) / (1 - 0.9 ** 3))
    assert math.isclose(s["eps"], 1e-6 * math.sqrt(1 - 0.99 ** 3))


@pytest.mark.parametrize("make,needle", [
    (lambda: Adam(lr=0), "lr"), (lambda: Adam(lr=float("nan")), "lr"), (lambda: Adam(lr="a"), "lr"),
    (lambda: Adam(betas=(0.9,)), "betas"), (lambda: Adam(betas=(0.9, 1.0)), "betas[1]"),
    (lambda: Adam(eps=0), "eps"), (lambda: Adam(weight_decay=-1), "weight_decay"),
    (lambda: SGD(lr=-0.1), "lr"), (lambda: SGD(lr=0.1, momentum=1.0), "momentum"),
    (lambda: SGD(lr=True), "lr"),
])
def test_bad_hyperparameters_are_named(make, needle):
    with pytest.raises(ModelError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_bad_trainer_arguments_are_named(rng):
    w, _ = problem(rng)
    with pytest.raises(GraphError, match=r"\['V'\] are not params"):
        Trainer(regression(), w, Adam(), wrt=["V"])
    with pytest.raises(ModelError, match=r"weights lack \['b'\]"):
        Trainer(regression(), {"W": w["W"]}, Adam())
    with pytest.raises(ModelError, match="weight 'W' is \\[2, 3\\]"):
        Trainer(regression(), dict(w, W=w["W"].T.copy()), Adam())
    with pytest.raises(ModelError, match="optimizer must be"):
        Trainer(regression(), w, "adam")
    with pytest.raises(ModelError, match="clip_norm"):
        Trainer(regression(), w, Adam(), clip_norm=0.0)
    tr = Trainer(regression(), w, Adam(), backend="numpy")
    with pytest.raises(ModelError, match=r"Trainer.step: lr must be"):
        tr.step({"x": np.zeros((8, 3), np.float32), "y": np.zeros((8, 2), np.float32)}, lr=-1.0)
    assert tr.t == 0                                   # a refused step is not counted


def test_assign_writes_only_a_state_of_its_shape():
    m = Builder("g")
    x = m.input("x", (2,))
    with pytest.raises(ShapeError, match="assign value"):
        m.assign(m.state("s", (3,)), x)
    m.assign(x, x * 2.0)
    m.output("y", x)
    with pytest.raises(GraphError, match="assign writes a state"):
        rlx_core.compile(m.build(), backend="numpy")


@pytest.mark.parametrize("backend", backend_params(only=("numpy", "numba", "cuda")))
def test_tiny_llama_steps_equal_gradient_steps(backend, rng):
    """Three SGD steps of a 2-layer Llama through the Trainer (weights as states, written at
    the end of the step) equal three steps of value_and_grad with the update on the host:
    no backward read sees a weight already updated."""
    from rlx_core.passes.transform import params_as_inputs
    from rlx_core.runtime.model import find_recipe

    cfg = dict(model_type="llama", vocab_size=23, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_hidden_layers=2, max_position_embeddings=8, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=True)
    recipe = find_recipe("llama")
    weights = {k: (1.0 + 0.1 * rng.standard_normal(v.shape) if "norm" in k else 0.2 * rng.standard_normal(v.shape))
               .astype(np.float32) for k, v in recipe.tiny_tensors(cfg, rng).items()}
    built = recipe.flow_class.for_training(cfg, batch=2, seq=8).build(weights)
    batches = [{"ids": rng.integers(0, 23, (2, 8)), "labels": rng.integers(0, 23, (2, 8)),
                "positions": np.tile(np.arange(8), (2, 1)), "key_mask": np.ones((2, 1, 1, 8), bool)}
               for _ in range(3)]
    tr = Trainer(built.graph, built.params, SGD(lr=0.5), backend=backend)
    losses = [tr.step(b) for b in batches]
    names = list(built.params)
    exe = rlx_core.compile(rlx_core.value_and_grad(params_as_inputs(built.graph), names, output="loss"),
                           backend=backend)
    w = {k: np.array(v, np.float32) for k, v in built.params.items()}
    want = []
    for b in batches:
        out = exe.run({**b, **w})
        want.append(float(out["loss"]))
        w = {k: w[k] - np.float32(0.5) * out[f"grad_{k}"] for k in names}
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got = tr.weights()
    for k in names:
        np.testing.assert_allclose(got[k], w[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_f64_weights_update_in_f64(rng):
    """f64 weights keep f64 moments and scalars: the trajectory equals the float64 formulas
    to rounding."""
    w, batches = problem(rng)
    w = {k: v.astype(np.float64) for k, v in w.items()}
    batches = [(x.astype(np.float64), y.astype(np.float64)) for x, y in batches]
    tr = Trainer(regression(F64), w, Adam(lr=0.05), backend="numpy")
    assert tr.exe.states["opt.m.W"].dtype == np.float64 and not any(k.startswith(MASTER) for k in tr.exe.states)
    losses = [tr.step({"x": x, "y": y}) for x, y in batches]
    want_losses, want_w, _ = reference(Adam(lr=0.05), w, batches, 3)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    np.testing.assert_allclose(tr.weights()["W"], want_w["W"], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", backend_params(only=("numpy", "cuda")))
def test_state_resumes_a_run(backend, rng):
    """Two steps, state(), a new Trainer loads it, two more: the same as four in a row
    (Adam: the moments and the step count come back too)."""
    w, batches = problem(rng)
    feeds = [{"x": x, "y": y} for x, y in (batches * 2)[:4]]
    one = Trainer(regression(), w, Adam(lr=0.05), backend=backend)
    straight = [one.step(f) for f in feeds]
    a = Trainer(regression(), w, Adam(lr=0.05), backend=backend)
    first = [a.step(f) for f in feeds[:2]]
    saved = a.state()
    assert sorted(saved) == ["W", "b", "opt.m.W", "opt.m.b", "opt.step", "opt.v.W", "opt.v.b"]
    b = Trainer(regression(), w, Adam(lr=0.05), backend=backend)
    b.load_state(saved)
    np.testing.assert_allclose(first + [b.step(f) for f in feeds[2:]], straight, rtol=1e-6)
    for k, v in one.weights().items():
        np.testing.assert_allclose(b.weights()[k], v, rtol=1e-6, atol=1e-7)


def test_load_state_names_every_problem(rng):
    w, _ = problem(rng)
    tr = Trainer(regression(), w, Adam(), backend="numpy")
    good = tr.state()
    bad = dict(good, W=good["W"].T.copy(), extra=np.zeros(1))
    del bad["opt.v.b"]
    with pytest.raises(ModelError) as e:
        tr.load_state(bad)
    msg = str(e.value)
    assert "missing ['opt.v.b']" in msg and "unexpected ['extra']" in msg and "W: expected float32[3, 2]" in msg
    with pytest.raises(ModelError, match="opt.step: expected a step count"):
        tr.load_state(dict(good, **{"opt.step": np.array(-1)}))
