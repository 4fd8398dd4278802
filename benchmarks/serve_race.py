"""The serving race of issue 48: `rlx serve` against llama.cpp's servers on the same GGUF file
(the packaged SmolLM2-135M Q4_1): llama-cpp-python's OpenAI server (`python -m llama_cpp.server`,
side `llama`) and llama.cpp's own `llama-server` binary (side `llama-server`, from
--llama-server-bin; built for CUDA on the GPU machine, see benchmarks/README.md). Each server is
its own process with the same thread count, pinned to the same cores, run one after the other;
the clients (the official openai package, streaming) run here.

Scenarios (each reports both sides and the ratio where both ran; a side that failed says so):

1. `shared`: --clients concurrent clients, a shared --system-tokens system prompt + distinct
   short user messages, greedy, --new tokens each, --rounds rounds (a warm-up round with another
   system prompt first): aggregate tokens/s and p50 / p99 time to first token (TTFT).
   Targets: RLX >= 1.5x the peer's tokens/s; RLX's p99 TTFT <= the peer's.
2. `prefix`: one request with a --prefix-tokens system prompt, then a second with the same
   prefix and another question, one after the other: the second's TTFT over the first's
   (median of --pairs pairs, each pair a fresh prefix). Target (RLX): <= 0.2x.
3. `stall` (RLX only, once with chunked prefill on, once off): --clients streams decoding; then a
   --long-tokens prompt arrives; the streams' p99 inter-token latency before it arrived vs while
   it prefilled (from its arrival to its first token). Target: during <= 2x before, chunked.
   Then a control run, the same streams without the long prompt, read at the same token
   positions as "during": during / control is what the long prompt adds to the streams' own
   growth with their context (both ratios reported).

Every side decodes exactly --new tokens (RLX and llama-server: `ignore_eos`; llama-cpp-python has no
such field, so it gets `logit_bias` -100 on the end tokens). llama-cpp-python's server runs one
request at a time (one llama context behind a lock; it has no parallel slots), with
`--interrupt_requests false` (its default, true, would cut a running stream short whenever another
request arrives), its prompt cache on (`--cache true`, RAM, 2 GiB) and its context keeping the
longest common prefix of the previous request anyway. llama-server gets one slot per client
(`--parallel`, each slot --ctx tokens), continuous batching, its prompt cache (`--cache-prompt`, and its
default 8 GiB RAM cache of slot states), and `-ngl 99` when RLX's --backend is cuda (every layer on
the GPU). `--quick` runs small sizes (a smoke run, ~1-2 min).

    python benchmarks/serve_race.py [--quick] [--threads 2] [--sides rlx llama llama-server]
                                    [--llama-server-bin DIR] [--backend numba|cuda]
                                    [--scenarios shared prefix stall] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import log  # noqa: E402
from hardware import cpu_name, loadavg  # noqa: E402
from serve import free_port  # noqa: E402

MODEL = "smollm2"
END_TOKENS = (0, 1, 2)          # SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>: banned on the peer


class SideFailed(Exception):
    """A server that crashed, did not start, or answered a request wrongly: no ratio."""


# ============================================================================ prompts
WORDS = ("the of and to in is was for on that with as by at from his her are were this which be or have an "
         "they one had not but all their has been more other time would when who will there so can if out "
         "about into up them some these its than only over new first also after any may most such then two "
         "like between many made well even back years through where much before must great same people "
         "city river music water history house field school north world state small long right place part "
         "family light night garden story winter summer market village mountain road teacher letter window "
         "bridge island forest doctor kitchen station harbor morning evening language number table "
         "paper").split()


class Texts:
    """Texts of an exact token count (by the model's own tokenizer): seeded word salad, cut at
    the token count and decoded back."""

    def __init__(self, gguf: str):
        from rlx_core.weights import load_checkpoint

        self.tok = load_checkpoint(gguf).tokenizer

    def of(self, tokens: int, seed: int) -> str:
        rng = random.Random(seed)
        words = " ".join(rng.choice(WORDS) for _ in range(int(tokens * 1.3) + 16))
        ids = self.tok.encode(words)
        if len(ids) < tokens:
            raise SystemExit(f"internal: {len(ids)} tokens of salad, wanted {tokens}")
        return self.tok.decode(ids[:tokens]).strip()

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))


def question(i: int) -> str:
    return f"Question {i}: write a long story about the number {i * 7 + 3} and a {WORDS[i % len(WORDS)]}."


# ============================================================================ servers
def server_cores(threads: int) -> list:
    """The cores every server is pinned to (hardware.pin's rule: the first `threads` of those
    this process may use, or all of them when there are no more)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:threads] if len(allowed) > threads else allowed


class Server:
    """One server process on a free loopback port, pinned to `cores` with every thread pool at
    `threads`, started once GET `ready` answers 200 (a server that answers before it is warm,
    rlx serve's /v1/models, would otherwise build its graphs inside the race); `alive()` says
    whether it still runs."""

    def __init__(self, name: str, cmd: list, port: int, threads: int, cores: list, wait: float,
                 ready: str = "/v1/models"):
        self.name, self.port = name, port
        env = dict(os.environ, RLX_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                   OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.cmd = shlex.join(cmd)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SideFailed(f"{name} exited ({self.proc.returncode}) while loading: {self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{ready}", timeout=2).read()
                return
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise SideFailed(f"{name} did not answer within {wait:.0f} s: {self.tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 1500) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def rlx_flags() -> str:
    rlx = os.path.join(os.path.dirname(sys.executable), "rlx")
    return subprocess.run([rlx, "serve", "--help"], capture_output=True, text=True).stdout


def rlx_server(a, port: int, chunk: int) -> Server:
    """`rlx serve` with the prefix cache on and prefill pieces of at most `chunk` tokens, within
    --stall-budget of a decode step (chunk 0: whole prompts, no budget)."""
    rlx = os.path.join(os.path.dirname(sys.executable), "rlx")
    cmd = [rlx, "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), "--backend", a.backend,
           "--max-batch", str(a.clients + 1), "--log-level", "warning"]
    helps = rlx_flags()
    budget = a.stall_budget if chunk else 0
    for flag, value in (("--prefix-cache-mb", a.prefix_cache_mb), ("--prefill-chunk", chunk),
                        ("--stall-budget", budget)):
        if value is None:
            continue
        if flag in helps:
            cmd += [flag, str(value)]
        else:
            log(f"  NOTE: this rlx serve has no {flag}: run without it")
    return Server(f"rlx (prefill chunk {chunk}, stall budget {budget})", cmd, port, a.threads, a.cores,
                  a.wait, ready="/health")


def llama_cpp_python(a, gguf: str, port: int) -> Server:
    """Side `llama`: llama-cpp-python's OpenAI server (one request at a time)."""
    try:
        import llama_cpp  # noqa: F401
        import sse_starlette  # noqa: F401
        import starlette_context  # noqa: F401
    except ImportError as e:
        raise SideFailed(f"peer not installed ({e}): pip install llama-cpp-python fastapi sse-starlette "
                         "pydantic-settings starlette-context")
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(a.ctx),
           "--n_threads", str(a.threads), "--n_threads_batch", str(a.threads),
           "--cache", "true", "--cache_type", "ram", "--cache_size", str(2 << 30),
           "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]
    return Server("llama-cpp-python server", cmd, port, a.threads, a.cores, a.wait)


def llama_server_cmd(binary: str, gguf: str, port: int, clients: int, ctx: int, threads: int,
                     gpu: bool) -> list:
    """llama-server's command line: one slot of `ctx` tokens per client (the KV cache holds
    clients x ctx), continuous batching, its prompt cache, every layer on the GPU when `gpu`."""
    return [binary, "--model", gguf, "--alias", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(clients), "--ctx-size", str(clients * ctx), "--cont-batching",
            "--cache-prompt", "--threads", str(threads), "--threads-batch", str(threads),
            "--n-gpu-layers", "99" if gpu else "0", "--no-webui"]


def llama_server(a, gguf: str, port: int) -> Server:
    """Side `llama-server`: llama.cpp's own server binary from --llama-server-bin."""
    if not a.llama_server_bin:
        raise SideFailed("no --llama-server-bin DIR (the folder holding llama.cpp's llama-server)")
    binary = os.path.join(a.llama_server_bin, "llama-server")
    if not os.access(binary, os.X_OK):
        raise SideFailed(f"--llama-server-bin {a.llama_server_bin}: no executable llama-server there")
    cmd = llama_server_cmd(binary, gguf, port, a.clients, a.ctx, a.threads, a.backend == "cuda")
    return Server("llama-server", cmd, port, a.threads, a.cores, a.wait, ready="/health")


PEERS = {"llama": ("llama-cpp-python server", llama_cpp_python),      # side: (its name, its start)
         "llama-server": ("llama-server", llama_server)}


# ============================================================================ clients
def percentile(xs: list, p: float) -> float:
    """The nearest-rank p-th percentile (p in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def no_eos(side: str) -> dict:
    """The request fields that make `side` decode exactly max_tokens tokens."""
    if side in ("rlx", "llama-server"):
        return {"ignore_eos": True}
    return {"logit_bias": {str(t): -100 for t in END_TOKENS}}


class Stream:
    """One streamed greedy chat completion, run on a thread: its start, its first token's time,
    every content chunk's arrival time; `stop` (an Event) makes it close the stream early."""

    def __init__(self, client, side: str, messages: list, new: int, stop: threading.Event | None = None):
        self.client, self.side, self.messages, self.new, self.halt = client, side, messages, new, stop
        self.t0 = self.first = None
        self.arrivals: list = []
        self.finish = self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Stream:
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> Stream:
        self.thread.join(timeout)
        return self

    def _run(self) -> None:
        try:
            self.t0 = time.perf_counter()
            stream = self.client.chat.completions.create(
                model=MODEL, messages=self.messages, max_tokens=self.new, temperature=0, stream=True,
                extra_body=no_eos(self.side))
            with stream:
                for ch in stream:
                    now = time.perf_counter()
                    if ch.choices and ch.choices[0].delta.content:
                        self.arrivals.append(now)
                        if self.first is None:
                            self.first = now
                    if ch.choices and ch.choices[0].finish_reason:
                        self.finish = ch.choices[0].finish_reason
                    if self.halt is not None and self.halt.is_set():
                        self.finish = "closed by the client"
                        break
        except Exception as e:  # noqa: BLE001 (a side's failure is reported, not raised here)
            self.error = f"{type(e).__name__}: {e}"[:500]

    @property
    def ttft(self) -> float:
        return self.first - self.t0

    def gaps(self) -> list:
        """(arrival time, gap since the previous arrival) of every content chunk after the first."""
        return [(b, b - a) for a, b in zip(self.arrivals, self.arrivals[1:])]


def check(server: Server, streams: list, what: str, full: bool = True) -> None:
    """Raise SideFailed when the server died or a stream failed (or, `full`, did not reach its
    max_tokens: a wrong count would skew tokens/s)."""
    if not server.alive():
        raise SideFailed(f"{server.name} crashed during {what}: {server.tail()}")
    for s in streams:
        if s.error:
            raise SideFailed(f"{server.name}: a request of {what} failed: {s.error}")
        if s.first is None:
            raise SideFailed(f"{server.name}: a request of {what} streamed no text (finish {s.finish})")
        if full and s.finish != "length":
            raise SideFailed(f"{server.name}: a request of {what} finished {s.finish!r}, "
                             "not after max_tokens")


def chat(system: str, user: str) -> list:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# ============================================================================ scenarios
def shared(client, server: Server, side: str, a, texts: Texts) -> dict:
    """Scenario 1: rounds of --clients concurrent requests sharing one system prompt."""
    def one_round(system: str, r: int) -> tuple:
        streams = [Stream(client, side, chat(system, question(r * 100 + i)), a.new) for i in range(a.clients)]
        t0 = time.perf_counter()
        for s in streams:
            s.start()
        for s in streams:
            s.join()
        wall = time.perf_counter() - t0
        check(server, streams, f"scenario 1 round {r}")
        return streams, wall

    one_round(texts.of(a.system_tokens, seed=1), 0)            # warm-up: compile, another prompt
    system = texts.of(a.system_tokens, seed=2)
    load0, rounds, ttfts, cpu0 = loadavg(), [], [], time.process_time()
    for r in range(1, a.rounds + 1):
        t0 = time.perf_counter()
        streams, wall = one_round(system, r)
        tokens = a.new * len(streams)
        ttfts += [s.ttft for s in streams]
        rounds.append({"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                       "ttft_s": [s.ttft for s in streams], "t0": t0})
    if side == "rlx":
        round_runs(server.port, rounds)
    tokens, wall = sum(r["tokens"] for r in rounds), sum(r["wall_s"] for r in rounds)
    return {"tokens_per_s": tokens / wall, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "rounds": rounds, "system_tokens": texts.count(system),
            "loadavg": [load0, loadavg()], "wall_s": wall,
            "client_cpu_s": time.process_time() - cpu0}    # near wall_s: the clients' one GIL bounds the race


def prefix(client, server: Server, side: str, a, texts: Texts) -> dict:
    """Scenario 2: a second request sharing a long prefix with the first, one after the other."""
    def pair(seed: int) -> tuple:
        system = texts.of(a.prefix_tokens, seed=seed)
        out = []
        for i in range(2):
            s = Stream(client, side, chat(system, question(seed * 10 + i)), a.prefix_new).start().join()
            check(server, [s], "scenario 2")
            out.append(s.ttft)
        return tuple(out)

    pair(1000)                                                 # warm-up: compile both graphs
    load0 = loadavg()
    pairs = [pair(1001 + k) for k in range(a.pairs)]
    ratios = [second / first for first, second in pairs]
    return {"first_s": [p[0] for p in pairs], "second_s": [p[1] for p in pairs],
            "ratio": statistics.median(ratios), "ratios": ratios, "loadavg": [load0, loadavg()]}


def window(arrivals: list, t0: float, t1: float) -> range:
    """The positions i of a stream's gaps (arrivals[i] - arrivals[i - 1], the i-th text chunk's
    wait: one chunk a token) that overlap (t0, t1): those ending after t0 and starting before t1.
    Positions, not times, carry the measured window over to the control run."""
    lo = next((i for i in range(1, len(arrivals)) if arrivals[i] > t0), len(arrivals))
    hi = next((i for i in range(lo, len(arrivals)) if arrivals[i - 1] >= t1), len(arrivals))
    return range(lo, hi)


def p99_at(arrivals: list, windows: list) -> tuple:
    """(p99, count) of the gaps at each stream's window of positions (lists paired by stream);
    SideFailed where a stream did not decode past its window or no gap is in any."""
    gaps = []
    for arr, w in zip(arrivals, windows):
        if w.stop > len(arr):
            raise SideFailed(f"a stream decoded {len(arr)} chunks, not past its window's position "
                             f"{w.stop - 1}")
        gaps += [arr[i] - arr[i - 1] for i in w]
    if not gaps:
        raise SideFailed("no gaps in the windows")
    return percentile(gaps, 99), len(gaps)


def stall(client, server: Server, side: str, a, texts: Texts) -> dict:
    """Scenario 3: --clients streams decoding when a --long-tokens prompt arrives; their
    inter-token gaps before it arrived and while it prefilled (arrival to its first token).
    Then the control: the same streams (prompts, max tokens, all started at once) with no long
    prompt, their gaps at the same positions as the measured "during" window: what the streams'
    own growth costs there, so during / control is what the long prompt adds. The same max
    tokens reach past the window: the measured run fails unless every stream outlived the prefill."""
    def start_streams(seed: int, halt: threading.Event) -> list:
        return [Stream(client, side, [{"role": "user", "content": question(seed + i)}], a.stall_new,
                       halt).start() for i in range(a.clients)]

    def wait_tokens(streams: list, halt: threading.Event, n: int, what: str, since: float = 0.0) -> None:
        """Until every stream has n tokens after time `since` (halting them and failing if one
        stops first)."""
        deadline = time.monotonic() + a.wait
        while any(sum(t > since for t in s.arrivals) < n for s in streams):
            if time.monotonic() > deadline or any(s.error or s.finish for s in streams):
                halt.set()
                check(server, streams, f"scenario 3 ({what})", full=False)
                raise SideFailed(f"{server.name}: scenario 3's streams stopped before {n} tokens "
                                 f"({what})")
            time.sleep(0.005)

    def finish(streams: list, halt: threading.Event, also: list) -> None:
        halt.set()
        for s in streams:
            s.join(a.wait)
        check(server, streams + also, "scenario 3", full=False)

    def run(seed: int) -> dict:
        halt = threading.Event()
        streams = start_streams(seed, halt)
        wait_tokens(streams, halt, a.steady, "warming up")          # all decoding, past their first steps
        t_ready = time.perf_counter()
        wait_tokens(streams, halt, a.steady + a.window, "before the long prompt")
        long_prompt = [{"role": "user", "content": texts.of(a.long_tokens, seed=seed)}]
        long_ = Stream(client, side, long_prompt, 2).start()
        long_.join()
        if long_.first is not None:
            wait_tokens(streams, halt, 2, "after the long prompt's first token", since=long_.first)
        finish(streams, halt, [long_])
        t_arrive, t_first = long_.t0, long_.first
        if any(s.arrivals[-1] < t_first for s in streams):
            raise SideFailed(f"{server.name}: a stream of scenario 3 ended before the long prompt's first "
                             "token; raise --stall-new")
        gaps = [g for s in streams for g in s.gaps()]
        before = [d for t, d in gaps if t_ready <= t - d and t <= t_arrive]
        windows = [window(s.arrivals, t_arrive, t_first) for s in streams]
        if not before or not any(windows):
            raise SideFailed(f"{server.name}: scenario 3 saw no gaps before ({len(before)}) or during "
                             "the prefill")
        during_p99, during_n = p99_at([s.arrivals for s in streams], windows)
        overlap = [(s.arrivals[i], s.arrivals[i] - s.arrivals[i - 1]) for s, w in zip(streams, windows)
                   for i in w]
        timeline = sorted((round(t - t_arrive, 4), round(d, 4)) for t, d in overlap)
        out = {"before_p99_s": percentile(before, 99), "during_p99_s": during_p99,
               "during_max_s": max(d for _, d in overlap), "before_n": len(before), "during_n": during_n,
               "long_ttft_s": t_first - t_arrive, "during_gaps": timeline,   # (end after arrival, gap) s
               "windows": [[w.start, w.stop] for w in windows]}
        if side == "rlx":
            out.update(server_steps(server.port, t_ready, t_arrive, t_first))
        return out

    def control(seed: int, windows: list) -> dict:
        """run(seed)'s streams without the long prompt, until each is past the measured window."""
        halt = threading.Event()
        streams = start_streams(seed, halt)
        wait_tokens(streams, halt, max(w.stop for w in windows), "the control")
        finish(streams, halt, [])
        p99, n = p99_at([s.arrivals for s in streams], windows)
        return {"control_p99_s": p99, "control_n": n}

    run(5000)                                                   # rehearsal: the same graphs compiled
    load0 = loadavg()
    out = run(6000)
    out.update(control(6000, [range(*w) for w in out["windows"]]))
    out["ratio"] = out["during_p99_s"] / out["before_p99_s"]
    out["ratio_control"] = out["during_p99_s"] / out["control_p99_s"]
    out["loadavg"] = [load0, loadavg()]
    return out


SCENARIOS = {"shared": shared, "prefix": prefix, "stall": stall}


def debug_steps(port: int, since: float) -> list | None:
    """rlx serve's step log since `since` (GET /debug/steps: each run's end on the monotonic
    clock this process's perf_counter reads too, its seconds, rows, piece tokens, and whether
    its runner was specialized for it); None where the server has no log."""
    try:
        url = f"http://127.0.0.1:{port}/debug/steps?since={since}"
        return json.loads(urllib.request.urlopen(url, timeout=30).read())["steps"]
    except OSError:
        return None


def server_steps(port: int, t_ready: float, t_arrive: float, t_first: float) -> dict:
    """What rlx serve's scheduler ran before and during the long prompt's prefill: the median
    decode step before, and every run during ({} where the server has no log)."""
    steps = debug_steps(port, t_ready)
    return {} if steps is None else steps_around(steps, t_arrive, t_first)


def round_runs(port: int, rounds: list) -> None:
    """Add to each round of scenario 1 the server's runs in it (rlx serve's GET /debug/steps;
    nothing added where it has no log): where a round's time and TTFTs went."""
    steps = debug_steps(port, rounds[0]["t0"])
    if steps is None:
        return
    for rd, nxt in zip(rounds, rounds[1:] + [None]):
        end = nxt["t0"] if nxt else float("inf")
        rd["runs"] = [s for s in steps if rd["t0"] < s["end"] <= end]


def runs_line(runs: list, wall: float, slow_s: float = 1.0) -> str:
    """A round's runs (`round_runs`): their seconds by kind and piece length (count, total)
    against the round's wall (the rest is outside the scheduler's runs), then those over
    `slow_s` or first of their runner (specialized: a shape the warm-up did not reach)."""
    def what(s):
        return s["kind"] + (f" +{s['piece']}" if s["piece"] else "")
    kinds: dict = {}
    for s in runs:
        n, t = kinds.get(what(s), (0, 0.0))
        kinds[what(s)] = (n + 1, t + s["seconds"])
    total = sum(t for _, t in kinds.values())
    by_time = sorted(kinds.items(), key=lambda kv: -kv[1][1])
    odd = [("first " if s["first"] else "") + what(s) + f" r{s['rows']} {s['seconds']:.1f} s"
           for s in runs if s["first"] or s["seconds"] > slow_s]
    return (f"runs {total:.1f} of {wall:.1f} s: "
            + ", ".join(f"{k} {n} ({t:.1f} s)" for k, (n, t) in by_time)
            + f"; over {slow_s:g} s or first: " + (", ".join(odd) or "none"))


def steps_around(steps: list, t_arrive: float, t_first: float) -> dict:
    """{"step_before_s": the median decode step ended before t_arrive, "during_steps": the
    runs ended after it, up to t_first} of a scheduler's step log (dicts of StepRecord's
    fields); {} where either is empty."""
    before = [s["seconds"] for s in steps if s["end"] <= t_arrive and s["kind"] == "decode"]
    during = [s for s in steps if t_arrive < s["end"] <= t_first + 1e-3]
    if not before or not during:
        return {}
    return {"step_before_s": statistics.median(before), "during_steps": during}


def step_medians(d: dict) -> str:
    """The median seconds of the runs during the prefill by kind and piece length, with their
    counts: what a piece of each length cost the streams there (the step before beside)."""
    ref, steps = d.get("step_before_s"), d.get("during_steps")
    if not ref or not steps:
        return ""
    groups: dict = {}
    for s in steps:
        groups.setdefault((s["kind"], s["piece"]), []).append(s["seconds"])
    runs = [f"{k}{f' +{n}' if n else ''} {ms(statistics.median(v))} ({len(v)})"
            for (k, n), v in sorted(groups.items())]
    return f"median run during (step before {ms(ref)}): " + ", ".join(runs)


def slow_steps(d: dict, times: float = 2.0) -> str:
    """The runs during the prefill longer than `times` the median decode step before, by what
    they were (a first run: specialized for its shapes; a mixed step's piece length; a plain
    step), with their median."""
    ref, steps = d.get("step_before_s"), d.get("during_steps")
    if not ref or not steps:
        return ""
    groups: dict = {}
    for s in steps:
        if s["seconds"] > times * ref:
            what = ("first run " if s["first"] else "") + (f"{s['kind']} +{s['piece']}" if s["piece"]
                                                         else s["kind"])
            groups.setdefault(what, []).append(s["seconds"])
    kinds: dict = {}
    for s in steps:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
    parts = [f"{k} {len(v)} (median {ms(statistics.median(v))})" for k, v in
             sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    runs = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return (f"runs during: {runs}; step before {ms(ref)}; longer than {times:g}x it: "
            f"{sum(map(len, groups.values()))}" + (": " + "; ".join(parts) if parts else ""))


def prefix_cache_tokens(port: int) -> tuple | None:
    """(prompt tokens found in rlx serve's prefix cache, prompt tokens looked up) so far, from
    its /metrics; None where the server has no such metrics (the peer)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    except OSError:
        return None
    got = {}
    for line in text.splitlines():
        for key in ("rlx_prefix_cache_hit_tokens_total", "rlx_prefix_cache_query_tokens_total"):
            if line.startswith(key):
                got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    if len(got) < 2:
        return None
    return got["rlx_prefix_cache_hit_tokens_total"], got["rlx_prefix_cache_query_tokens_total"]


# ============================================================================ the race
def serve_side(a, name: str, start, scenarios: list, side: str, texts: Texts) -> dict:
    """Start one server, run `scenarios` against it, stop it: {scenario: result or {"failed": why}}."""
    import openai

    log(f"[{name}] starting (loadavg {loadavg()})")
    out: dict = {}
    try:
        server = start(free_port())
    except SideFailed as e:
        log(f"[{name}] FAILED: {e}")
        return {s: {"failed": str(e)} for s in scenarios}
    out["command"] = server.cmd
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=a.wait)
    try:
        for sc in scenarios:
            t, cached = time.perf_counter(), prefix_cache_tokens(server.port) if side == "rlx" else None
            try:
                out[sc] = SCENARIOS[sc](client, server, side, a, texts)
                now = prefix_cache_tokens(server.port) if cached else None
                if now:
                    out[sc]["prefix_cache_hit_tokens"] = [now[0] - cached[0], now[1] - cached[1]]
                log(f"[{name}] {sc}: done in {time.perf_counter() - t:.0f} s (loadavg {loadavg()})")
            except SideFailed as e:
                out[sc] = {"failed": str(e)}
                log(f"[{name}] {sc}: FAILED: {e}")
                if not server.alive():
                    for rest in scenarios[scenarios.index(sc) + 1:]:
                        out[rest] = {"failed": f"{name} had crashed"}
                    break
    finally:
        server.stop()
    return out


def ms(x: float) -> str:
    return f"{x * 1e3:.0f} ms"


def ratio(a_: dict, b: dict, key: str) -> str:
    if "failed" in a_ or "failed" in b:
        return "no ratio (a side failed)"
    return f"{a_[key] / b[key]:.2f}x"


def report(a, res: dict, hw: str) -> None:
    r = res.get("rlx", {})
    peers = [(PEERS[k][0], k, res[k]) for k in PEERS if k in res]     # (name, side, its results)
    say = print
    say(f"\n=== serve race: SmolLM2-135M Q4_1 ({res['model']}), {a.threads} threads each, RLX backend "
        f"{a.backend}, {hw}; Python {platform.python_version()}")
    say(f"    client pinning: {res['client_pin']}; loadavg at the end {loadavg()} (1/5/15 min)")
    commands = (("rlx", r), *((k, d) for _, k, d in peers), ("rlx chunk off", res.get("rlx_nochunk", {})))
    for name, side in commands:
        if "command" in side:
            say(f"    {name}: {side['command']}")

    def side_line(name, d, fmt):
        if "failed" in d:
            return f"  {name:<26} FAILED: {d['failed'][:300]}"
        hit = d.get("prefix_cache_hit_tokens")
        line = f"  {name:<26} {fmt(d)}"
        if hit:
            line += f"\n  {'':<26} prefix cache: {hit[0]:.0f} of {hit[1]:.0f} prompt tokens found"
            line += " (warm-up included)"
        return line

    if "shared" in a.scenarios:
        say(f"\n1. {a.clients} clients, shared {a.system_tokens}-token system prompt, {a.new} new tokens "
            "each, "
            f"{a.rounds} rounds (p99 of {a.rounds * a.clients} TTFTs)")
        f1 = (lambda d: f"{d['tokens_per_s']:7.1f} tokens/s  TTFT p50 {ms(d['ttft_p50_s'])}, p99 "
              f"{ms(d['ttft_p99_s'])}  (loadavg {d['loadavg'][0]} -> {d['loadavg'][1]}"
              + (f"; clients' CPU {d['client_cpu_s']:.2f} s of {d['wall_s']:.1f} s" if "wall_s" in d else "")
              + ")")
        if r.get("shared") is not None:
            say(side_line("rlx", r["shared"], f1))
        for i, rd in enumerate((r.get("shared") or {}).get("rounds", []), 1):
            if "runs" in rd:
                say(f"  {'':<26} rlx round {i} ({rd['tokens_per_s']:.1f} tokens/s): "
                    + runs_line(rd["runs"], rd["wall_s"]))
        for name, _, p in peers:
            if p.get("shared") is not None:
                say(side_line(name, p["shared"], f1))
        for _, k, p in peers:
            if r.get("shared") and p.get("shared"):
                say(f"  throughput rlx/{k}: {ratio(r['shared'], p['shared'], 'tokens_per_s')} "
                    "(target >= 1.5x); "
                    f"p99 TTFT rlx/{k}: {ratio(r['shared'], p['shared'], 'ttft_p99_s')} (target <= 1x)")
    if "prefix" in a.scenarios:
        say(f"\n2. TTFT of a second request sharing a {a.prefix_tokens}-token prefix / the first's "
            f"(median of {a.pairs} pairs)")
        f2 = (lambda d: f"first {ms(statistics.median(d['first_s']))}, "
              f"second {ms(statistics.median(d['second_s']))}"
              f", ratio {d['ratio']:.3f}  (loadavg {d['loadavg'][0]} -> {d['loadavg'][1]})")
        for name, d in (("rlx (target <= 0.2)", r.get("prefix")),
                        *((n, p.get("prefix")) for n, _, p in peers)):
            if d is not None:
                say(side_line(name, d, f2))
    if "stall" in a.scenarios:
        say(f"\n3. a {a.long_tokens}-token prompt arriving during {a.clients} decoding streams: their p99 "
            "inter-token latency before / during its prefill, and during / a control run without it at the "
            "same token positions (target during <= 2x before, chunked)")
        f3 = (lambda d: f"before {ms(d['before_p99_s'])} ({d['before_n']} gaps), "
              f"during {ms(d['during_p99_s'])} ({d['during_n']} gaps, longest {ms(d['during_max_s'])}), "
              f"{d['ratio']:.2f}x; control {ms(d['control_p99_s'])} (no long prompt, the same positions: "
              f"{d['control_n']} gaps), during / control {d['ratio_control']:.2f}x; long prompt's TTFT "
              f"{ms(d['long_ttft_s'])}  (loadavg {d['loadavg'][0]} -> {d['loadavg'][1]})")
        budget = "default" if a.stall_budget is None else a.stall_budget
        for name, d in ((f"rlx, chunk {a.prefill_chunk}, budget {budget}", r.get("stall")),
                        ("rlx, chunk 0 (off)", res.get("rlx_nochunk", {}).get("stall"))):
            if d is not None:
                say(side_line(name, d, f3))
                for line in (step_medians(d), slow_steps(d)):
                    if line:
                        say(f"  {'':<26} {line}")
    say(f"\nreproduce: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}")


SIZES_FREE = ("sides", "json", "llama_server_bin", "report", "wait")   # may differ between --report's runs


def report_files(files: list) -> None:
    """The report of earlier runs' --json files (sides run apart, e.g. one while the peer was
    still building): their sizes must match."""
    res: dict = {}
    first = None
    for path in files:
        with open(path) as f:
            d = json.load(f)
        args = {k: v for k, v in d["args"].items() if k not in SIZES_FREE}
        if first is None:
            first, a, hw = (path, args), argparse.Namespace(**d["args"]), d["hardware"]
        elif args != first[1] or d["hardware"] != hw:
            diff = sorted(k for k in set(args) | set(first[1]) if args.get(k) != first[1].get(k))
            raise SystemExit(f"--report: {path} ran other sizes than {first[0]}: "
                             f"{', '.join(diff) or 'the hardware'} differ")
        res.update({k: v for k, v in d.items() if k not in ("hardware", "args")})
    report(a, res, hw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--sides", nargs="+", default=["rlx", "llama"], choices=["rlx", *PEERS])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--threads", type=int, default=2, help="threads (and cores) of each server")
    ap.add_argument("--backend", default="numba",
                    help="rlx serve --backend (cuda: llama-server's layers on the GPU too)")
    ap.add_argument("--llama-server-bin", default=None, metavar="DIR",
                    help="side llama-server: the folder holding llama.cpp's llama-server binary")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="scenario 1: new tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="scenario 1: measured rounds")
    ap.add_argument("--system-tokens", type=int, default=1000, help="scenario 1: the shared system prompt")
    ap.add_argument("--prefix-tokens", type=int, default=2000, help="scenario 2: the shared prefix")
    ap.add_argument("--prefix-new", type=int, default=4, help="scenario 2: new tokens per request")
    ap.add_argument("--pairs", type=int, default=3, help="scenario 2: measured pairs")
    ap.add_argument("--long-tokens", type=int, default=4000, help="scenario 3: the arriving prompt")
    ap.add_argument("--stall-new", type=int, default=4000, help="scenario 3: the streams' max_tokens")
    ap.add_argument("--steady", type=int, default=8,
                    help="scenario 3: tokens each stream has before 'before'")
    ap.add_argument("--window", type=int, default=32, help="scenario 3: tokens each stream decodes between "
                    "'--steady' and the long prompt's arrival (the 'before' window)")
    ap.add_argument("--prefix-cache-mb", type=int, default=512, help="rlx serve --prefix-cache-mb")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="rlx serve --prefill-chunk (scenario 3 "
                    "also runs it at 0)")
    ap.add_argument("--stall-budget", type=float, default=None, help="rlx serve --stall-budget (default: the "
                    "server's; 0 with --prefill-chunk 0)")
    ap.add_argument("--ctx", type=int, default=8192, help="the peers' context (llama-server's per slot; "
                    "SmolLM2's)")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for a server or a request")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the report of earlier runs' --json "
                    "files (sides run apart, with the same sizes) and exit")
    a = ap.parse_args()
    if a.report:
        return report_files(a.report)
    if a.quick:
        for k, v in dict(clients=4, new=16, rounds=1, system_tokens=200, prefix_tokens=400, pairs=1,
                         long_tokens=600, stall_new=2000, steady=4).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if max(a.long_tokens, a.prefix_tokens, a.system_tokens + a.new) + 64 > a.ctx:
        raise SystemExit(f"a prompt does not fit the context ({a.ctx})")

    from rlx_core.weights import resolve_model_path

    gguf = resolve_model_path(MODEL)
    texts = Texts(gguf)
    hw = f"{cpu_name()} ({os.cpu_count()} logical cores)"
    allowed, a.cores = sorted(os.sched_getaffinity(0)), server_cores(a.threads)
    if len(allowed) > a.threads:            # the servers take the first cores, the clients the rest
        os.sched_setaffinity(0, allowed[a.threads:])
        client_pin = f"servers on cores {a.cores}, clients on {allowed[a.threads:]}"
    else:
        client_pin = f"servers and clients share all {len(allowed)} cores"
    log(f"{hw}; {client_pin}; loadavg {loadavg()}; model {gguf}")
    res: dict = {"client_pin": client_pin, "model": gguf}
    if "rlx" in a.sides:
        res["rlx"] = serve_side(a, "rlx", lambda port: rlx_server(a, port, a.prefill_chunk), a.scenarios,
                                "rlx", texts)
        if "stall" in a.scenarios:
            res["rlx_nochunk"] = serve_side(a, "rlx chunk off", lambda port: rlx_server(a, port, 0),
                                            ["stall"], "rlx", texts)
    for side in (k for k in PEERS if k in a.sides):
        res[side] = serve_side(a, side, lambda port: PEERS[side][1](a, gguf, port),
                               [s for s in a.scenarios if s != "stall"], side, texts)
    report(a, res, hw)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hw, "args": vars(a), **res}, f, indent=1)


if __name__ == "__main__":
    main()
