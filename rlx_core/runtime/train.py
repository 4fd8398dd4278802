"""Training on the backend: one graph holds the forward pass, the gradients and the
optimizer's update. The trained weights and the optimizer's moments are states, kept on the
backend between steps and overwritten in place by `assign` nodes at the end of the graph, so
a step moves only the batch in and the loss out (on a GPU, nothing of the size of the model
crosses to the host).

The update runs in f32 (f64 for f64 weights). Weights of a 16-bit dtype train through an
f32 master copy (a state too): the update adds to the f32 value and the weight the forward
pass reads is its rounding, so updates smaller than a bf16 step accumulate instead of
vanishing.

    trainer = Trainer(graph, weights, Adam(lr=3e-3), clip_norm=1.0, backend="cuda")
    for t, batch in enumerate(batches):
        loss = trainer.step(batch, lr=schedule(t))      # lr optional: the optimizer's
    weights = trainer.weights()
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Protocol

import attrs
import numpy as np

from ..ir.autodiff import inline, value_and_grad
from ..ir.dtype import F32, F64, DType
from ..ir.errors import GraphError, ModelError
from ..ir.graph import MIR, Builder, Graph, Value
from ..passes.transform import params_as_inputs
from ..profile import CompileProfile

MASTER = "opt.master."             # + weight name: the f32 copy of a 16-bit weight
STEP = "opt.step"                  # in Trainer.state(): the steps taken (Adam's bias corrections)


def _number(owner: str, name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False,
            hi_open: bool = True) -> float:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > lo if lo_open else value >= lo) and \
        (value < hi if hi_open else value <= hi)
    if not ok:
        span = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ModelError(f"{owner}: {name} must be a number in {span}, got {value!r}")
    return float(value)


@attrs.frozen
class SGD:
    """Stochastic gradient descent, with heavy-ball `momentum` (torch.optim.SGD's form: the
    buffer sums gradients, the step is lr times the buffer) and decoupled `weight_decay`."""
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __attrs_post_init__(self) -> None:
        _number("SGD", "lr", self.lr, 0.0, lo_open=True)
        _number("SGD", "momentum", self.momentum, 0.0, 1.0)
        _number("SGD", "weight_decay", self.weight_decay, 0.0)

    @property
    def slots(self) -> tuple:
        return ("momentum",) if self.momentum else ()

    def scalars(self, t: int, lr: float) -> dict:
        return {"lr": lr}

    def update(self, m: Builder, w: Value, g: Value, slots: dict, sc: dict) -> tuple[Value, dict]:
        if self.momentum:
            g = slots["momentum"] * self.momentum + g
            slots = {"momentum": g}
        if self.weight_decay:
            w = w - w * (sc["lr"] * self.weight_decay)
        return w - g * sc["lr"], slots


@attrs.frozen
class Adam:
    """Adam (Kingma & Ba), with decoupled `weight_decay` (AdamW) when it is set. The bias
    corrections of step t come in as the step's scalars: step_size = lr * sqrt(1 - b2^t) /
    (1 - b1^t) and eps_t = eps * sqrt(1 - b2^t), the paper's efficient form."""
    lr: float = 1e-3
    betas: tuple = attrs.field(default=(0.9, 0.999), converter=tuple)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __attrs_post_init__(self) -> None:
        _number("Adam", "lr", self.lr, 0.0, lo_open=True)
        if len(self.betas) != 2:
            raise ModelError(f"Adam: betas must be two numbers, got {self.betas!r}")
        for k, b in enumerate(self.betas):
            _number("Adam", f"betas[{k}]", b, 0.0, 1.0)
        _number("Adam", "eps", self.eps, 0.0, lo_open=True)
        _number("Adam", "weight_decay", self.weight_decay, 0.0)

    slots = ("m", "v")

    def scalars(self, t: int, lr: float) -> dict:
        b1, b2 = self.betas
        c2 = math.sqrt(1.0 - b2 ** t)
        return {"lr": lr, "step_size": lr * c2 / (1.0 - b1 ** t), "eps": self.eps * c2}

    def update(self, m: Builder, w: Value, g: Value, slots: dict, sc: dict) -> tuple[Value, dict]:
        b1, b2 = self.betas
        mo = slots["m"] * b1 + g * (1.0 - b1)
        v = slots["v"] * b2 + g * g * (1.0 - b2)
        if self.weight_decay:
            w = w - w * (sc["lr"] * self.weight_decay)
        return w - mo * sc["step_size"] / (m.act(v, "sqrt") + sc["eps"]), {"m": mo, "v": v}


class Optimizer(Protocol):
    """What Trainer needs of an optimizer (SGD, Adam): its default lr, the names of its
    per-weight slots, the step's scalars and the graph of one weight's update."""
    lr: float

    @property
    def slots(self) -> tuple: ...

    def scalars(self, t: int, lr: float) -> dict: ...

    def update(self, m: Builder, w: Value, g: Value, slots: dict, sc: dict) -> tuple[Value, dict]: ...


def slot_name(slot: str, weight: str) -> str:
    return f"opt.{slot}.{weight}"


def train_graph(g: Graph, wrt: Iterable[str], optimizer: Optimizer, output: str = "loss",
                clip_norm: float | None = None) -> Graph:
    """One training step as a graph: `output` of `g`, the gradient of each weight in `wrt`
    and the optimizer's update written back into the weights, which become states of the
    same name (with their optimizer slots `opt.<slot>.<name>` and, for 16-bit weights, the
    f32 master `opt.master.<name>`). The step's scalars are inputs `opt.<scalar>` (f64 when a
    weight is f64, else f32).
    With `clip_norm` the gradients are scaled by min(1, clip_norm / (norm + 1e-6)), norm
    being their global L2 norm (torch's clip_grad_norm_), output as `grad_norm` beside
    `output`."""
    wrt = list(wrt)
    if clip_norm is not None:
        clip_norm = _number("train_graph", "clip_norm", clip_norm, 0.0, lo_open=True)
    vg = value_and_grad(params_as_inputs(g, wrt), wrt, output)
    trained = set(wrt)
    m = Builder(f"{g.name}.train", MIR)
    leaf = {n.name: (m.state if n.name in trained else m.input)(n.name, n.outs[0].dims, n.outs[0].dtype)
            for n in vg.nodes if n.op == "input"}
    outs = dict(zip((name for name, _ in vg.outputs), inline(m, vg, leaf)))
    sdt = F64 if any(leaf[n].dtype == F64 for n in wrt) else F32
    sc = {k: m.input(f"opt.{k}", (), sdt) for k in optimizer.scalars(1, optimizer.lr)}
    grads = {}
    for name in wrt:             # the update runs in f32 (f64 for f64 weights)
        gr = outs[f"grad_{name}"]
        ct = _update_dtype(leaf[name].dtype)
        grads[name] = gr if gr.dtype == ct else m.cast(gr, ct)
    norm = None
    if clip_norm is not None:
        squares = [m.sum(gr * gr, tuple(range(gr.shape.rank))) if gr.shape.rank else gr * gr
                   for gr in grads.values()]
        norm = m.act(functools.reduce(lambda a, b: a + b, squares), "sqrt")
        coef = m.minimum(m.lift(clip_norm, F32) / (norm + 1e-6), m.lift(1.0, F32))
        grads = {k: gr * coef for k, gr in grads.items()}
    writes = []
    for name in wrt:
        w = leaf[name]
        ct = _update_dtype(w.dtype)
        master = w if w.dtype == ct else m.state(MASTER + name, w.dims, ct)
        slots = {s: m.state(slot_name(s, name), w.dims, ct) for s in optimizer.slots}
        new, new_slots = optimizer.update(m, master, grads[name], slots, sc)
        writes.append((master, new))
        if master is not w:
            writes.append((w, m.cast(new, w.dtype)))
        writes += [(slots[s], new_slots[s]) for s in new_slots]
    for state, value in writes:      # last: every read of the old values comes before
        m.assign(state, value)
    m.output(output, outs[output])
    if norm is not None:
        m.output("grad_norm", norm)
    return m.build()


def _update_dtype(dt: DType) -> DType:
    return F64 if dt == F64 else F32


class Trainer:
    """Train the params `wrt` (default: all) of a graph whose output `output` is the loss:
    `step(inputs)` runs one step on the backend and returns the loss; `weights()` copies the
    trained weights back. Params not in `wrt` stay bound as they are."""

    def __init__(self, graph: Graph, weights: dict, optimizer: Optimizer, *,
                 wrt: str | Iterable[str] | None = None, output: str = "loss", clip_norm: float | None = None,
                 backend: str | None = None, profile: CompileProfile | str | None = None):
        from ..pipeline import compile, numeric

        if not hasattr(optimizer, "update") or not hasattr(optimizer, "scalars"):
            raise ModelError(f"Trainer: optimizer must be an rlx_core optimizer (SGD, Adam), got {optimizer!r}")
        params = graph.params
        specs = {name: graph.nodes[i].outs[0] for name, i in params.items()}
        wrt = list(params) if wrt is None else [wrt] if isinstance(wrt, str) else list(wrt)
        unknown = sorted(set(wrt) - set(params))
        if unknown:
            raise GraphError(f"Trainer: {unknown} are not params of graph {graph.name!r}; it has {sorted(params)}")
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ModelError(f"Trainer: weights lack {missing} (params of graph {graph.name!r})")
        self.optimizer, self.output, self.wrt, self.t = optimizer, output, wrt, 0
        self.graph = train_graph(graph, wrt, optimizer, output, clip_norm)
        self.fetch = (output,) + (("grad_norm",) if clip_norm is not None else ())
        self.grad_norm: float | None = None    # the last step's global gradient norm (with clip_norm)
        frozen = {k: weights[k] for k in params if k not in set(wrt)}
        self.exe = compile(self.graph, backend=backend, profile=profile, params=frozen)
        b = self.exe.backend
        for name in wrt:
            s = specs[name]
            w = numeric(f"weight {name!r}", weights[name], s.dtype)
            if tuple(w.shape) != s.dims:
                raise ModelError(f"Trainer: weight {name!r} is {list(w.shape)}, the graph's param is {list(s.dims)}")
            self.exe.states[name] = b.to_device(w.copy())
            ct = _update_dtype(s.dtype)
            if s.dtype != ct:
                self.exe.states[MASTER + name] = b.to_device(np.asarray(weights[name], ct.np).copy())
            for slot in optimizer.slots:
                self.exe.states[slot_name(slot, name)] = b.zeros(s.dims, ct)

    def step(self, inputs: dict, lr: float | None = None) -> float:
        """One step on `inputs` (the batch); the loss before the update. `lr` overrides the
        optimizer's for this step (a schedule: the scalars are inputs, nothing recompiles)."""
        lr = self.optimizer.lr if lr is None else _number("Trainer.step", "lr", lr, 0.0, lo_open=True)
        scalars = self.optimizer.scalars(self.t + 1, lr)
        out = self.exe.run(dict(inputs, **{f"opt.{k}": np.float64(v) for k, v in scalars.items()}),
                           fetch=self.fetch)
        self.t += 1
        if "grad_norm" in out:
            self.grad_norm = float(out["grad_norm"])
        return float(out[self.output])

    def weights(self) -> dict:
        """The trained weights now, as host arrays of their dtype."""
        b = self.exe.backend
        return {name: np.array(b.to_host(self.exe.states[name])) for name in self.wrt}

    def state(self) -> dict:
        """What resuming needs, as host arrays: the weights, their masters, the optimizer's
        moments (by state name) and the steps taken (`opt.step`)."""
        b = self.exe.backend
        out = {k: np.array(b.to_host(v)) for k, v in self.exe.states.items()}
        out[STEP] = np.array(self.t, np.int64)
        return out

    def load_state(self, state: dict) -> None:
        """Resume from a `state()` of a Trainer of the same graph and optimizer: every entry
        of its name, shape and dtype (all problems in one error)."""
        want = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in self.exe.states.items()}
        missing = sorted((set(want) | {STEP}) - set(state))
        problems = [f"missing {missing}"] if missing else []
        extra = sorted(set(state) - set(want) - {STEP})
        if extra:
            problems.append(f"unexpected {extra}")
        for k, (shape, dt) in want.items():
            if k in state and (np.shape(state[k]) != shape or np.asarray(state[k]).dtype != dt):
                problems.append(f"{k}: expected {dt.name}{list(shape)}, got "
                                f"{np.asarray(state[k]).dtype.name}{list(np.shape(state[k]))}")
        t = state.get(STEP)
        if t is not None and (np.shape(t) != () or not np.issubdtype(np.asarray(t).dtype, np.integer) or t < 0):
            problems.append(f"{STEP}: expected a step count (an integer >= 0), got {t!r}")
        if problems:
            raise ModelError("Trainer.load_state: " + " | ".join(problems))
        b = self.exe.backend
        for k in want:
            self.exe.states[k] = b.to_device(np.array(state[k], copy=True))
        self.t = int(state[STEP])


__all__ = ["SGD", "Adam", "Trainer", "train_graph"]
