"""Tensor-parallel launch: one process per rank, supervised.

`TensorParallel(spec, world)` starts `world` rank processes (spawned: no state forked from
the caller), each binding the CPU communicator (backends/numpy/comm.py) or NCCL and
loading the model with `[parallel] tensor = world`, so its graphs compile through the
sharding pass (passes/shard.py) as that rank. Requests go to every rank as JSON over a
pipe; every rank answers (rank 0's answer is the result). A rank that exits before it
answers aborts the group's barrier, the others are stopped, and the error names the rank.

A spec is JSON: {"model": path or name} (rlx_core.runtime.model.load), or {"config": {...},
"tensors": "file.npz"} (weights saved by the caller, read with allow_pickle=False) or
{"config": {...}, "make_tensors": "module:function"} (function(config) makes them in each
rank: array-likes with shape, dtype, __getitem__ and __array__ let a rank make only its
slices), built by the config's recipe, plus
optional "backend", "profile", "max_context", "comm" (a communicator class as "module:Class"
taking (block, world, rank, barrier, slot bytes, timeout); RLX_TP_COMM; default the CPU one) and, for tests, "fault": {"rank", "after_tokens"}.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import wait

import numpy as np

from ..ir.errors import ModelError, ProfileError, RlxError
from .scheduler import Event, Request, SamplingParams, Scheduler

TIMEOUT = float(os.environ.get("RLX_TP_TIMEOUT", "300"))


def tensor_size(flag: int | None = None, profile=None) -> int:
    """Ranks asked for: a --tp flag, else RLX_TP, else the profile's [parallel] tensor."""
    if flag is not None:
        value, where = flag, "--tp"
    elif os.environ.get("RLX_TP"):
        value, where = os.environ["RLX_TP"], "RLX_TP"
    else:
        return profile.parallel.tensor if profile is not None else 1
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(value).strip() not in (str(n), f"+{n}"):
        raise ProfileError(f"{where}={value!r}: expected a whole number of ranks >= 1")
    return n


# ------------------------------------------------------------------ the rank process
def named(path: str, what: str):
    """The object "module:name" names (a spec's communicator, tensor maker or call)."""
    import importlib

    mod, _, name = str(path).partition(":")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ModelError(f"tensor parallel: {what} {path!r}: expected 'module:name' of an importable "
                         f"module ({type(e).__name__}: {e})") from None


def _build(spec: dict, world: int):
    from ..profile import CompileProfile
    from ..weights.checkpoint import Checkpoint
    from .encoder import Encoder
    from .model import CausalLM, find_recipe, load

    kw = {"max_context": spec["max_context"]} if spec.get("max_context") else {}
    if "model" in spec:
        model = load(spec["model"], backend=spec.get("backend"), profile=spec.get("profile"),
                     progress=False, **kw)
    else:
        cfg = spec["config"]
        if "make_tensors" in spec:       # made in the rank (array-likes: only the slices are read)
            tensors, source = named(spec["make_tensors"], "make_tensors")(cfg), spec["make_tensors"]
        else:
            with np.load(spec["tensors"], allow_pickle=False) as z:
                tensors = {k: z[k] for k in z.files}
            source = spec["tensors"]
        recipe = find_recipe(cfg.get("model_type", ""))
        model = recipe.build(Checkpoint(source, "npz", cfg, tensors, None),
                             backend=spec.get("backend"), profile=spec.get("profile"), **kw)
    if not isinstance(model, (CausalLM, Encoder)):
        raise ModelError(f"{spec.get('model')}: tensor parallelism runs causal language models "
                         f"and encoders, not {type(model).__name__}")
    model.profile = CompileProfile.resolve(model.profile).evolve(parallel={"tensor": world})
    return model


def _fault(fault: dict | None, rank: int, held: dict) -> None:
    """For tests (the spec's "fault"): its rank exits (exit_code, else 9) at its
    after_tokens-th new token, counted over its requests."""
    if fault and fault.get("rank") == rank:
        held["tokens"] = held.get("tokens", 0) + 1
        if held["tokens"] >= fault.get("after_tokens", 1):
            os._exit(fault.get("exit_code", 9))


def _round(model, msg: dict, rank: int, held: dict, fault: dict | None) -> dict:
    """One Scheduler round on this rank, as the driver's GroupScheduler ran it: the same new
    requests (ids, params and seeds), cancel flags and idleness on every rank, so every rank
    runs the same graphs in the same order. Rank 0 answers the events of the round."""
    if "scheduler" not in held:
        held["scheduler"] = Scheduler(model, msg["max_batch"])
    sched = held["scheduler"]
    held["events"] = []

    def on_event(r, ev):              # (a request's listener outlives this round: held's list)
        if ev.token_ids:
            _fault(fault, rank, held)
        held["events"].append({"id": r.id, "tokens": ev.token_ids, "text": ev.text, "n_new": r.n_new,
                               "finish": ev.finish_reason,
                               "error": None if ev.error is None else str(ev.error)})

    req = {r.id: r for r in sched._active}
    new = []
    for x in msg["new"]:
        r = req[x["id"]] = Request(x["id"], list(x["ids"]),
                                   SamplingParams(**dict(x["params"], stop=tuple(x["params"]["stop"]))))
        r.on_event = lambda ev, r=r: on_event(r, ev)
        new.append(r)
    for rid in msg["cancel"]:
        if rid in req:
            req[rid].cancel()
    sched.round(new, msg["idle"])
    return {"events": held["events"] if rank == 0 else []}


def _answer(model, msg: dict, rank: int, fault: dict | None, held: dict):
    op = msg["op"]
    if op == "round":
        return _round(model, msg, rank, held, fault)
    if op == "call":
        return {"result": named(msg["fn"], "call")(model, **msg.get("kwargs", {}))}
    if op == "embed":                  # (rank 0's rows are the answer: the others send none)
        out = model.embed(msg["inputs"])
        return {"embeddings": out.tolist() if rank == 0 else [],
                "tokens": int(model.last_timings.get("tokens", 0))}
    if op == "forward":
        out = model.forward(np.asarray(msg["ids"], np.int64), msg.get("mask"), msg.get("token_type_ids"))
        return {"outputs": {k: np.asarray(v).tolist() for k, v in out.items()}}
    if op == "logits":
        return {"logits": model.logits(np.asarray(msg["ids"], np.int64)).tolist()}
    if op == "generate":
        kw = dict(msg.get("kwargs", {}))
        stream = (lambda _: _fault(fault, rank, held)) if fault and fault.get("rank") == rank else None
        out = model.generate(msg["prompt"], stream=stream, **kw)
        return {"output": out if isinstance(out, (str, list)) else np.asarray(out).tolist(),
                "timings": model.last_timings}
    raise ModelError(f"unknown request {op!r}")


def _rank_main(rank: int, world: int, spec_json: str, block: str, slot_bytes: int, barrier, conn,
               timeout: float) -> None:
    from ..backends.numpy.comm import ShmCommunicator
    from ..ir import comm

    spec = json.loads(spec_json)
    c = None
    try:
        factory = spec.get("comm") or os.environ.get("RLX_TP_COMM") or ""
        # "module:Class", e.g. rlx_backend_cuda.nccl:NcclCommunicator
        cls = named(factory, "communicator") if factory else ShmCommunicator
        c = cls(block, world, rank, barrier, slot_bytes, timeout)
        comm.bind(c)
        model = _build(spec, world)
        conn.send_bytes(json.dumps({"ready": rank}).encode())
        held: dict = {}                  # what requests keep between them (a Scheduler)
        while True:
            msg = json.loads(conn.recv_bytes())
            if msg["op"] == "exit":
                break
            try:
                reply = _answer(model, msg, rank, spec.get("fault"), held)
            except RlxError as e:
                reply = {"error": type(e).__name__, "message": str(e)}
            conn.send_bytes(json.dumps(reply).encode())
    except (EOFError, KeyboardInterrupt):
        pass
    except (RlxError, ImportError, AttributeError) as e:
        conn.send_bytes(json.dumps({"error": type(e).__name__, "message": str(e)}).encode())
    finally:
        comm.bind(None)
        if c is not None and hasattr(c, "close"):
            c.close()


# ------------------------------------------------------------------ the supervisor
class TensorParallel:
    """`world` supervised rank processes of one model; `generate` and `logits` as on a
    CausalLM (ids or text), `forward` and `embed` as on an Encoder, `close()` (or a with
    block) stops them."""

    def __init__(self, spec: dict, world: int, timeout: float = TIMEOUT,
                 slot_bytes: int | None = None):
        from ..backends.numpy.comm import SLOT_BYTES, create_block

        if world < 1:
            raise ProfileError(f"tensor parallel: {world} ranks; expected >= 1")
        self.world, self.timeout = world, timeout
        self._lock = threading.Lock()        # one request at a time (the server's threads share a group)
        ctx = mp.get_context("spawn")
        slot = slot_bytes or SLOT_BYTES
        self.block = create_block(world, slot)
        self.barrier = ctx.Barrier(world)
        self.conns, self.procs = [], []
        spec_json = json.dumps(spec)
        try:
            for r in range(world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, name=f"rlx-tp-rank{r}", daemon=True,
                                args=(r, world, spec_json, self.block.name, slot, self.barrier, child,
                                      timeout))
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
            self._collect("starting")
        except BaseException:
            self.close()
            raise

    def _collect(self, what: str) -> list:
        """Every rank's next answer; a rank that dies first or an overdue group is an error
        (after the group is stopped)."""
        replies: dict = {}
        deadline = time.monotonic() + self.timeout
        try:
            while len(replies) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [r for r in range(self.world) if r not in replies]
                    raise ModelError(f"tensor parallel: rank(s) {late} did not answer {what} within "
                                     f"{self.timeout:.0f} s (RLX_TP_TIMEOUT)")
                waiting = {self.conns[r]: r for r in range(self.world) if r not in replies}
                sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
                for ready in wait(list(waiting) + list(sentinels), timeout=min(left, 1.0)):
                    if ready in waiting:
                        r = waiting[ready]
                        try:
                            replies[r] = json.loads(ready.recv_bytes())
                        except EOFError:
                            self._died(r, what)
                    else:
                        r = sentinels[ready]
                        if not self.conns[r].poll():
                            self._died(r, what)
        except BaseException:
            self.close()
            raise
        errors = [(r, x) for r, x in sorted(replies.items()) if "error" in x]
        if errors:
            r, x = errors[0]
            raise ModelError(f"tensor parallel: rank {r} {what}: {x['error']}: {x['message']}")
        return [replies[r] for r in range(self.world)]

    def _died(self, r: int, what: str):
        self.barrier.abort()                 # ranks waiting in a collective stop at once
        p = self.procs[r]
        p.join(1.0)
        code = p.exitcode
        raise ModelError(f"tensor parallel: rank {r} (pid {p.pid}) died while {what} "
                         f"(exit code {code}); the group of {self.world} is stopped")

    def request(self, msg: dict, what: str, every: bool = False):
        """Send `msg` to every rank; rank 0's answer (every=True: the list of all answers)."""
        with self._lock:
            if not self.procs:
                raise ModelError("tensor parallel: the group is stopped")
            data = json.dumps(msg).encode()
            for r, c in enumerate(self.conns):
                try:
                    c.send_bytes(data)
                except (BrokenPipeError, OSError):
                    self.barrier.abort()
                    self.close()
                    raise ModelError(f"tensor parallel: rank {r} is gone (before {what})") from None
            replies = self._collect(what)
        return replies if every else replies[0]

    def generate(self, prompt, **kw):
        """CausalLM.generate on the ranks (no stream callback: the text comes back whole)."""
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        out = self.request({"op": "generate", "prompt": prompt, "kwargs": kw}, "generating")
        self.last_timings = out.get("timings", {})
        return out["output"]

    def logits(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64).tolist()
        return np.asarray(self.request({"op": "logits", "ids": ids}, "computing logits")["logits"],
                          np.float32)

    def call(self, fn: str, **kwargs) -> list:
        """fn(model, **kwargs) on every rank ("module:function", importable there; answers
        JSON): each rank's answer, in rank order. What benchmarks measure on the ranks."""
        return [r["result"] for r in self.request({"op": "call", "fn": fn, "kwargs": kwargs},
                                                  f"calling {fn}", every=True)]

    def forward(self, ids, attention_mask=None, token_type_ids=None) -> dict:
        """Encoder.forward on the ranks: every output of the encoder for right-padded ids."""
        msg = {"op": "forward", "ids": np.asarray(ids, np.int64).tolist()}
        if attention_mask is not None:
            msg["mask"] = np.asarray(attention_mask, bool).tolist()
        if token_type_ids is not None:
            msg["token_type_ids"] = np.asarray(token_type_ids, np.int64).tolist()
        out = self.request(msg, "encoding")["outputs"]
        return {k: np.asarray(v, np.float32) for k, v in out.items()}

    def embed(self, inputs: list) -> tuple:
        """Encoder.embed of `inputs` (texts or token-id lists) on the ranks: (embeddings
        [n, dim] float32, tokens embedded)."""
        out = self.request({"op": "embed", "inputs": list(inputs)}, "embedding")
        return np.asarray(out["embeddings"], np.float32), out["tokens"]

    def close(self) -> None:
        """Stop every rank (asked, then terminated, then killed) and free the shared block."""
        for c in self.conns:
            try:
                c.send_bytes(b'{"op": "exit"}')
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(2.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        if self.block is not None:
            self.block.close()
            self.block.unlink()
            self.block = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def pids(self) -> list:
        return [p.pid for p in self.procs]


class GroupScheduler(Scheduler):
    """The Scheduler of a model served tensor-parallel: this process keeps the queue and the
    requests (`model` is the model loaded here for its tokenizer and config; its weights
    stay unread); each round runs on the group's ranks (`_round`), rank 0's events come
    back. A sampled request without a seed gets one here, so every rank draws alike. A
    group that fails (a rank died) fails the requests and closes the scheduler."""

    def __init__(self, group: TensorParallel, model, max_batch: int = 8):
        super().__init__(model, max_batch)
        self.group = group

    def round(self, new: list, idle: bool) -> None:
        import dataclasses
        import random

        sent = []
        for r in new:
            p = r.params
            if p.do_sample and p.seed is None:
                r.params = p = dataclasses.replace(p, seed=random.getrandbits(63))
            sent.append({"id": r.id, "ids": r.prompt_ids, "params": dataclasses.asdict(p)})
        self._active += new
        msg = {"op": "round", "max_batch": self.max_batch, "new": sent, "idle": idle,
               "cancel": [r.id for r in self._active if r.cancelled]}
        try:
            events = self.group.request(msg, "serving")["events"]
        except RlxError as e:
            with self._cv:
                self._closed, self.closed_by = True, f" ({e})"
            for r in self._active + list(self._waiting):
                r.error = e
                self._finish(r, "error")
            return
        by_id = {r.id: r for r in self._active}
        for ev in events:
            r = by_id[ev["id"]]
            r.n_new = ev["n_new"]
            r.token_ids += ev["tokens"]
            if ev["finish"] is None:
                r._emit(Event(ev["tokens"], ev["text"]))
                continue
            if ev["error"] is not None:
                r.error = ModelError(f"tensor parallel: rank 0: {ev['error']}")
            self._finish(r, ev["finish"], ev["tokens"], ev["text"])


__all__ = ["TensorParallel", "GroupScheduler", "tensor_size", "TIMEOUT"]
