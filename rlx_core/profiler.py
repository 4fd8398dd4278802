"""Where a compiled graph's time goes: time per node and per op kind, bytes moved and
achieved bandwidth, as a table, JSON or a Chrome/Perfetto trace.

`Executable.profile(inputs, repeat=N)` runs the runner of those inputs' dims the normal way
and through its `run_profiled` (host clock after every step on the CPU backends and OpenCL,
CUDA events between eagerly launched steps on CUDA) `repeat` times each, interleaved, and
keeps the median of every node. The report puts the sum of the per-node medians beside the
whole profiled run and the normal run (on CUDA: the graph replay), so what the per-node
timing adds or hides is in sight.

Bytes moved per node are counted from the LIR shapes: every distinct input read once and
every output written once (a packed weight is its packed bytes); views move nothing, a
gather reads only the rows it picks and a kv_write reads and writes only the new entries.
Attention counts its whole KV cache (masked keys included). Achieved GB/s compare with the
backend's own large-copy bandwidth (read + written bytes), measured once per backend.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import time

import attrs
import numpy as np

from .ir.errors import ModelError

TOP = 10
VIEW_OPS = frozenset({"reshape", "narrow", "expand"})
_BANDWIDTH: dict = {}          # id(backend) -> (backend, bytes per second)


# ----------------------------------------------------------------------------- facts
def copy_bandwidth(backend) -> float:
    """The backend's large-copy bandwidth in bytes/s, measured on first use (cached)."""
    if id(backend) not in _BANDWIDTH:
        _BANDWIDTH[id(backend)] = (backend, float(backend.copy_bandwidth()))
    return _BANDWIDTH[id(backend)][1]


def node_bytes(graph, i: int) -> int:
    """Bytes node `i` reads and writes, from its shapes (see the module docstring)."""
    if not 0 <= i < len(graph.nodes):
        return 0
    n = graph.nodes[i]
    if n.op in VIEW_OPS:
        return 0
    ins = [graph.nodes[r[0]].outs[r[1]] for r in dict.fromkeys(tuple(r) for r in n.inputs)]
    if n.op == "kv_write":           # cache, new, pos: the new entries are read and written
        return 2 * ins[1].nbytes() + sum(s.nbytes() for s in ins[2:])
    if n.op == "gather":             # table, index: only the picked rows are read
        return 2 * n.outs[0].nbytes() + sum(s.nbytes() for s in ins[1:])
    return sum(s.nbytes() for s in ins) + sum(s.nbytes() for s in n.outs)


def _shapes(graph, i: int) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    """(op, name, input shapes, output shapes) of node i as text; i past the last node is
    "output": the contiguous copies a backend makes of the graph's outputs."""
    if not 0 <= i < len(graph.nodes):
        return "output", "", (), ()
    n = graph.nodes[i]
    ins = tuple(str(graph.nodes[r[0]].outs[r[1]]) for r in n.inputs)
    return n.op, n.name or "", ins, tuple(str(s) for s in n.outs)


# ----------------------------------------------------------------------------- report
@attrs.frozen
class NodeTime:
    """One node: what it is, the bytes it moves and its time in each repeat (seconds)."""
    index: int
    op: str
    name: str
    inputs: tuple
    outputs: tuple
    bytes: int
    samples: tuple

    @property
    def seconds(self) -> float:
        return statistics.median(self.samples)


@attrs.frozen
class OpTime:
    """One op kind: how many nodes, their summed median time and bytes."""
    op: str
    nodes: int
    seconds: float
    bytes: int


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _size(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{int(b)} B"


def _table(rows: list, headers: list, right: set) -> list:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    return ["  " + "  ".join(str(x).rjust(w) if k in right else str(x).ljust(w)
                             for k, (x, w) in enumerate(zip(r, widths))).rstrip() for r in [headers, *rows]]


@attrs.frozen
class ProfileReport:
    """Per-node times of one graph at one set of dims. `nodes` are in run order; `runs` are
    the normal runs' seconds, `profiled_runs` the whole profiled runs' (in each, the node
    times add up to all but the input and output copies); `copy_bytes_per_s` is the
    backend's large-copy bandwidth (0 when not measured)."""
    graph: str
    backend: str
    dims: dict
    clock: str
    nodes: tuple
    runs: tuple
    profiled_runs: tuple
    copy_bytes_per_s: float = 0.0

    @property
    def repeat(self) -> int:
        return len(self.runs)

    @property
    def total_s(self) -> float:
        """The sum of the per-node medians."""
        return sum(n.seconds for n in self.nodes)

    @property
    def run_s(self) -> float:
        """The median normal run (on CUDA: the graph replay)."""
        return statistics.median(self.runs)

    @property
    def profiled_run_s(self) -> float:
        """The median whole profiled run."""
        return statistics.median(self.profiled_runs)

    def top(self, n: int = TOP) -> list:
        return sorted(self.nodes, key=lambda x: -x.seconds)[:n]

    def by_op(self) -> list:
        """OpTime per op kind, the most time first."""
        ops: dict = {}
        for n in self.nodes:
            c, s, b = ops.get(n.op, (0, 0.0, 0))
            ops[n.op] = (c + 1, s + n.seconds, b + n.bytes)
        return sorted((OpTime(op, *v) for op, v in ops.items()), key=lambda o: -o.seconds)

    def _pct(self, s: float) -> str:
        return f"{100 * s / self.total_s:.1f}%" if self.total_s > 0 else "-"

    def _bw(self, nbytes: int, s: float) -> list:
        gbps = _gbps(nbytes, s)
        bw = f"{100 * gbps * 1e9 / self.copy_bytes_per_s:.0f}%" if self.copy_bytes_per_s and nbytes else "-"
        return [_size(nbytes) if nbytes else "-", f"{gbps:.1f}" if nbytes else "-", bw]

    def table(self, top: int = TOP) -> str:
        """The header, the `top` slowest nodes and every op kind, as text."""
        dims = ", ".join(f"{k}={v}" for k, v in sorted(self.dims.items())) or "static"
        lines = [f"graph {self.graph} on {self.backend} ({dims}); median of {self.repeat} runs; "
                 f"{self.clock}",
                 f"  sum of {len(self.nodes)} nodes {_time(self.total_s)} | whole profiled run "
                 f"{_time(self.profiled_run_s)} | normal run {_time(self.run_s)} | copy bandwidth "
                 + (f"{self.copy_bytes_per_s / 1e9:.1f} GB/s" if self.copy_bytes_per_s else "not measured")]
        head = ["time", "%", "bytes", "GB/s", "of copy bw"]
        rows = [[f"%{n.index}", n.op, ",".join(n.outputs), _time(n.seconds), self._pct(n.seconds),
                 *self._bw(n.bytes, n.seconds)] for n in self.top(top)]
        lines += [f"top {len(rows)} nodes:"] + _table(rows, ["node", "op", "output", *head], {3, 4, 5, 6, 7})
        rows = [[o.op, o.nodes, _time(o.seconds), self._pct(o.seconds), *self._bw(o.bytes, o.seconds)]
                for o in self.by_op()]
        lines += ["by op kind:"] + _table(rows, ["op", "nodes", *head], {1, 2, 3, 4, 5, 6})
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict:
        total = self.total_s or 1.0
        return {"graph": self.graph, "backend": self.backend, "dims": dict(self.dims), "clock": self.clock,
                "repeat": self.repeat, "total_s": self.total_s, "profiled_run_s": self.profiled_run_s,
                "run_s": self.run_s, "runs": list(self.runs), "profiled_runs": list(self.profiled_runs),
                "copy_bytes_per_s": self.copy_bytes_per_s,
                "nodes": [{"index": n.index, "op": n.op, "name": n.name, "inputs": list(n.inputs),
                           "outputs": list(n.outputs), "bytes": n.bytes, "seconds": n.seconds,
                           "percent": 100 * n.seconds / total, "gb_per_s": _gbps(n.bytes, n.seconds),
                           "samples": list(n.samples)} for n in self.nodes],
                "ops": [{"op": o.op, "nodes": o.nodes, "seconds": o.seconds,
                         "percent": 100 * o.seconds / total, "bytes": o.bytes,
                         "gb_per_s": _gbps(o.bytes, o.seconds)} for o in self.by_op()]}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def chrome_events(self, tid: int = 1, start_us: float = 0.0) -> list:
        """Trace events ("X": complete) of every node in every repeat, the repeats laid end
        to end from `start_us`, each node where its run-order place puts it."""
        events, t = [], start_us
        for r in range(self.repeat):
            for n in self.nodes:
                dur = n.samples[r] * 1e6
                events.append({"name": n.op, "cat": self.graph, "ph": "X", "ts": t, "dur": dur, "pid": 1,
                               "tid": tid, "args": {"node": n.index, "repeat": r, "inputs": list(n.inputs),
                                                    "outputs": list(n.outputs), "bytes": n.bytes}})
                t += dur
        return events

    def chrome_trace(self, path) -> int:
        """Write this report as a Chrome/Perfetto trace (a JSON array); returns the events."""
        return write_chrome_trace(path, [self])


def write_chrome_trace(path, reports) -> int:
    """Several reports in one trace file, one track (tid) each, one after another; returns
    the number of events. Open it in https://ui.perfetto.dev or chrome://tracing."""
    events, t = [], 0.0
    for tid, rep in enumerate(reports, 1):
        evs = rep.chrome_events(tid, t)
        events += evs
        t = max([e["ts"] + e["dur"] for e in evs] + [t])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(events, f)
    return len(events)


# ----------------------------------------------------------------------------- measuring
def _count(name: str, v, lo: int) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
        raise ModelError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def profile_executable(exe, inputs: dict, repeat: int = 10, warmup: int = 2,
                       bandwidth: bool = True) -> ProfileReport:
    """Profile `exe` on `inputs` (see the module docstring). The runs are real runs: an
    executable that writes state (a KV cache) writes it each time, as its normal run would.
    `bandwidth=False` skips measuring the copy bandwidth."""
    repeat, warmup = _count("repeat", repeat, 1), _count("warmup", warmup, 0)
    if not isinstance(inputs, dict):
        raise ModelError(f"inputs must be a dict of input name -> array, got {type(inputs).__name__}")
    runner, arrays, env = exe.prepare(inputs)
    graph = exe.lir(**env).graph
    for _ in range(warmup):
        runner.run(arrays)
        runner.run_profiled(arrays)
    clock = time.perf_counter
    runs, profiled, samples = [], [], []
    for _ in range(repeat):
        t = clock()
        runner.run(arrays)
        runs.append(clock() - t)
        t = clock()
        _, steps = runner.run_profiled(arrays)
        profiled.append(clock() - t)
        per_node: dict = {}
        for i, s in steps:
            per_node[i] = per_node.get(i, 0.0) + s
        samples.append(per_node)
    order = list(dict.fromkeys(i for per_node in samples for i in per_node))
    nodes = tuple(NodeTime(i, *_shapes(graph, i), node_bytes(graph, i),
                           tuple(per_node.get(i, 0.0) for per_node in samples)) for i in order)
    return ProfileReport(graph.name, exe.backend.name, dict(env), runner.profile_clock, nodes,
                         tuple(runs), tuple(profiled), copy_bandwidth(exe.backend) if bandwidth else 0.0)


@contextlib.contextmanager
def recorded_inputs(*exes):
    """Within the block, every run of these executables keeps a copy of its inputs
    ({exe: [inputs, ...]}), so a model's real calls can be profiled after it made them
    (a model mutates some inputs, such as its decode mask, in place between calls)."""
    calls: dict = {exe: [] for exe in exes}

    def recording(exe, run):
        def run_recorded(inputs=None, fetch=None, **kw):
            inputs = dict(inputs or {}, **kw)
            calls[exe].append({k: np.array(v) for k, v in inputs.items()})
            return run(inputs, fetch=fetch)
        return run_recorded

    for exe in exes:
        exe.run = recording(exe, exe.run)
    try:
        yield calls
    finally:
        for exe in exes:
            del exe.run


def profile_generation(model, prompt: str, decode_steps: int = 4, repeat: int = 10, warmup: int = 2,
                       chat: bool = False) -> dict:
    """{"prefill": report[, "decode": report]} of a CausalLM generating from `prompt`: the
    prompt's prefill and the last of `decode_steps` greedy decode steps, each profiled on the
    inputs the model gave it (the KV cache then holds the prompt and those steps)."""
    decode_steps = _count("decode_steps", decode_steps, 0)
    ids = model.encode_prompt(prompt, chat=chat)
    with model._lock:
        prefill, decode = model.executable("prefill"), model.executable("decode")
        with recorded_inputs(prefill, decode) as calls:
            model.generate([ids], max_new_tokens=decode_steps + 1, min_new_tokens=decode_steps + 1)
        out = {"prefill": profile_executable(prefill, calls[prefill][-1], repeat, warmup)}
        if calls[decode]:
            out["decode"] = profile_executable(decode, calls[decode][-1], repeat, warmup)
    return out


__all__ = ["ProfileReport", "NodeTime", "OpTime", "profile_executable", "profile_generation",
           "recorded_inputs", "write_chrome_trace", "copy_bandwidth", "node_bytes"]
