"""Continuous batching: requests join a running decode batch as others finish.

A request is prefilled alone (batch 1, the model's prefill graph over the scheduler's own
states, the context bucket it would get alone) and its KV rows copied into a free row of
the batched decode cache (`BatchCache`); each row then decodes at its own positions
(per-row `positions`, `cache_pos` and `key_mask`). So a request admitted mid-decode
computes what it computes run alone by `CausalLM.generate`, up to the rounding of batched
matrix products. Decode graphs specialize once per (batch bucket, context bucket). Works
on any backend: the cache moves through `Backend.copy_into`. Idle a while, a scheduler
gives its KV caches back (release_cache).

Where the model has an `extend` graph (a prefill continuing the cached sequence), a prompt
starts from the longest prefix found in the prefix cache (rlx_core.runtime.prefix_cache:
blocks of earlier prompts and of finished requests' prompt + answer), and a prompt longer
than `prefill_chunk` is prefilled in chunks, one per round between the running batch's
decode steps, so streams keep producing tokens. A request being prefilled is in the
running list without a row (`slot` -1) until its last chunk places it. A model whose
caches cannot be extended (a ring-buffer window cache) gets whole prefills and no prefix
cache; `extend_refused` says why.

Nothing compiles in steady state: prefill pieces run through the extend graph at a few
lengths (powers of two; a prompt's tail padded up to one, its logits picked by the graph's
`last_token` input) over prefill states whose context only grows, in powers of two; decode
graphs take (batch bucket, context bucket). (A model with recurrent states cannot pad:
filler tokens would step its state; its pieces run at their own lengths.) While a batch
decodes, `stall_budget` bounds what a round's prefill may add in measured decode steps
(see `_prefill_round`).

Mixed steps (`mixed`, on by default with chunked prefill): while a batch decodes, the
waiting prompt's next piece rides in the decode step's own run (the graph mode "mixed" of
rlx_core.flow.recipe: the decode rows' tokens and the piece's packed on one token axis), so
the weights are read once for both; a run's fixed cost (on a CPU, reading every weight once,
about a decode step) is then not paid again for the piece. One piece a step, of a prompt with
more than PAD_TAIL tokens left when it started riding (shorter ones are prefilled alone, whole,
before the step, so requests arriving together join the batch together; a riding prompt's
tail rides too); the mixed graphs specialize per (batch
bucket, piece length: powers of two), all built by `warm_mixed` (the server's warm-up), so
a length's first step only specializes its graph to the cache's buffers. Families whose
layers do not split the packed tokens, and models whose pieces cannot pad, run their pieces
alone as before (`mixed_refused` says why where a mixed graph was refused).

Submission is thread-safe (`Scheduler.submit` from any thread); one scheduler thread runs
the model, holding the backend's lock for each step, so direct `generate` calls on the same
model interleave between steps."""
from __future__ import annotations

import collections
import itertools
import queue
import statistics
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..flow.blocks import PIECE_CTX, PIECE_PREFIX
from ..ir.errors import ModelError, RlxError
from ..pipeline import StateStore
from .args import bool_arg, callable_arg, float_arg, int_arg, token_rows
from .batch_cache import BatchCache
from .model import CTX_BUCKET, fetch_greedy, greedy_outputs, updates_in_place
from .prefix_cache import PrefixCache, cache_stats
from .sampling import SamplingParams, ask, check_constraint, prompt_token_logprobs, token_logprobs
from .stop_text import StopText

if TYPE_CHECKING:
    from ..pipeline import Executable

FINISH_REASONS = ("stop", "length", "cancelled", "error")
IDLE_RELEASE_S = 30.0          # idle this long, a scheduler gives its KV cache back (release_cache)
PIECE_MIN = 16                 # the shortest prefill run: a prompt's tail is padded up to 16, 32 or 64 tokens
PAD_TAIL = 64                  # a tail up to this long runs padded to a power of two; longer pieces run exact
FILL_CTX_MIN = 256             # the prefill states' smallest context (then powers of two)
COST_EMA = 0.3                 # the weight of the newest measurement in the run-cost averages
PROBE_FIRST = 8                # mixed steps after which a measured piece length is tried again, doubling
REMEASURE = 256                # with each measurement over the budget since it fit, up to this many
RECENT = 15                    # decode steps whose median is a step's cost
MIXED_RECENT = 5               # mixed steps of a piece length whose least is what it adds
REFERENCE = 8                  # mixed steps in a row at most, with a stall budget: then a plain step is timed
NOW = 3                        # timed plain steps whose least is the reference of a mixed step's addition
TIE = 0.25                     # budget below every addition: pieces adding <= (1 + TIE) x the least fit
GROWTH_KEYS = 128              # keys the streams gain in a ride before their step's growth is read
STEP_LOG = 4096                # runs the scheduler remembers (`step_log`)
SHRINK_AFTER = 16              # idle rounds a cache larger than its rows needs is kept before it shrinks
# The scheduler thread shares the GIL with its caller's threads (a server's event loop streaming
# tokens): a step back from the device waits for the GIL until the loop releases it or the
# interpreter's switch interval (5 ms by default) forces it. While a scheduler runs, the
# interval is at most this (the GPU race's 32-row decode step: 4.9-5.2 -> 4.1-4.2 ms, H200).
SWITCH_S = 0.0005


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere):
    freed buffers of a burst of big requests would otherwise stay in resident memory."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):          # not glibc (musl): nothing to trim with
        pass


@dataclass(frozen=True)
class StepRecord:
    """One run of the scheduler thread (`Scheduler.step_log`): a decode step ("decode"), a
    decode step carrying a prefill piece ("mixed") or a prefill piece run alone ("piece").
    `end` is time.monotonic() when it ended (on Linux the clock of time.perf_counter too,
    shared by every process: a client's timestamps compare with it); `seconds` its wall time,
    host work included; `rows` the decode rows, `piece` the prompt tokens it ran (padding
    included); `first`: its runner's first run (specialized for it: the cost of a new shape
    or of moved cache buffers, not of the tokens)."""
    end: float
    seconds: float
    kind: str
    rows: int
    piece: int
    first: bool


@dataclass
class Event:
    """What a request (choice `index` of its prompt) produced since its last event: new token
    ids, their text (what can be shown: see StopText), their `logprobs` (a TokenLogprob per
    token when the request asked for them) and, on its last event, why it finished (and the
    error, if one)."""
    token_ids: list
    text: str = ""
    finish_reason: str | None = None
    error: BaseException | None = None
    logprobs: list = field(default_factory=list)
    index: int = 0


@dataclass
class Completion:
    """A finished choice: its text and tokens, why it finished, and the logprobs asked for
    (`logprobs`: a TokenLogprob per new token; `prompt_logprobs`: None for the first prompt
    token, then a TokenLogprob each)."""
    text: str
    token_ids: list
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    index: int = 0


@dataclass(eq=False)
class Request:
    """A submitted request: iterate `events()` to stream it, or wait for `result()`."""
    id: str
    prompt_ids: list
    params: SamplingParams
    on_event: Callable[[Event], Any] | None = None
    index: int = 0                  # which of its prompt's n choices
    choices: list = field(default_factory=list)    # the n choices (this one first): set by submit
    # -- the scheduler's
    slot: int = -1                  # its row of the decode batch (-1: not placed yet, prefilling)
    length: int = 0                 # tokens in its KV cache
    filled: int = 0                 # prompt tokens in the prefill states (while prefilling)
    begun: bool = False             # its prefill begun: its cached prefix looked up, restored (_start_fill)
    rode: bool = False              # a piece of its prompt rode in a mixed step (its tail rides too)
    last: int = 0                   # the token the next decode step feeds
    ctx: int = 0                    # the context bucket it would get alone
    max_new: int = 0
    token_ids: list = field(default_factory=list)
    n_new: int = 0
    rng: np.random.Generator | None = None
    stream: StopText | None = None
    text: str = ""                  # the text of its events so far
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    constraint: Any = None          # its Constraint (params.constraint's), made when admitted
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    _queue: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if not self.choices:
            self.choices = [self]

    def _emit(self, ev: Event) -> None:
        self.text += ev.text
        self._queue.put(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:                       # noqa: BLE001  (a listener gone: stop)
                self.cancelled = True
        if ev.finish_reason is not None:
            self._done.set()

    def events(self, timeout: float | None = None):
        """Events as they come, the last one with finish_reason; a TimeoutError when none
        comes within `timeout` seconds."""
        while True:
            try:
                ev = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no event within {timeout} s") from None
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> Completion:
        """The finished request (raises what failed it)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id}: not finished within {timeout} s")
        if self.error is not None:
            raise self.error
        return Completion(self.text, list(self.token_ids), self.finish_reason, len(self.prompt_ids),
                          self.n_new, list(self.logprobs) if self.params.logprobs is not None else None,
                          self.prompt_logprobs, self.index)

    def results(self, timeout: float | None = None) -> list:
        """Every choice's Completion (n of them), in order."""
        return [c.result(timeout) for c in self.choices]

    def cancel(self) -> None:
        """Stop generating (the request and its other choices finish with "cancelled")."""
        for c in self.choices:
            c.cancelled = True

    @property
    def done(self) -> bool:
        return self._done.is_set()


def batch_buckets(max_batch: int) -> tuple:
    """Powers of two below max_batch, then max_batch."""
    out = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return tuple(out + [max_batch])


class Scheduler:
    """Runs `model` (a CausalLM) for many requests at once, up to `max_batch` in one decode
    batch. `prefix_cache_mb`: the prefix cache's bound in MiB (0: none); `prefill_chunk`:
    the most prompt tokens prefilled in a round while a batch decodes (None: the profile's
    [runtime] prefill_chunk; 0: whole prefills); `stall_budget`: what that round's prefill
    may cost, in decode steps of the batch as measured (None: no bound but the chunk; the
    pieces then follow only from the requests, as a tensor-parallel group's ranks need);
    `mixed`: while a batch decodes, a prompt's pieces run inside its decode steps (one run for
    both, where the model's layers allow: see the module docstring; needs chunked prefill).
    `idle_release_s`: idle this long, the KV caches and runners go back (None: IDLE_RELEASE_S;
    rebuilding them costs the next request ~0.1 s on a CPU, ~0.5 s on a GPU, so not after a
    pause between a client's requests). Use as a context manager or call close()."""

    def __init__(self, model, max_batch: int = 8, prefix_cache_mb: float = 256, prefill_chunk: int | None = None,
                 stall_budget: float | None = None, mixed: bool = True, idle_release_s: float | None = None):
        self.model = model
        self.max_batch = int_arg("max_batch", max_batch, lo=1)
        self.prefix_cache_mb = float_arg("prefix_cache_mb", prefix_cache_mb, 0.0)
        self.prefill_chunk = int_arg("prefill_chunk", prefill_chunk, none=True)
        self.stall_budget = None if stall_budget is None else float_arg("stall_budget", stall_budget, 0.0)
        self.mixed = bool_arg("mixed", mixed)
        idle = IDLE_RELEASE_S if idle_release_s is None else idle_release_s
        self.idle_release_s = float_arg("idle_release_s", idle, 0.0)
        self.buckets = batch_buckets(self.max_batch)
        self._cv = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._active: list = []
        self._closed = False
        self.closed_by = ""                    # why, when something other than close() closed it
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._decode: Executable | None = None
        self._prefill: Executable | None = None
        self._extend: Executable | None = None
        self._fills: collections.deque = collections.deque()   # requests to prefill, in order
        self.extend_refused = ""               # why this model cannot extend (then whole prefills)
        self.prefix: PrefixCache | None = None
        self.cache: BatchCache | None = None
        self.submitted = 0                     # requests taken in
        self.steps = 0                         # decode steps run (a test sees batching happen)
        self.max_rows = 0                      # most requests decoded in one step
        self.prefix_query_tokens = 0           # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0             # of them, found there (their prefill skipped)
        self.prefill_tokens = 0                # prompt tokens computed (prefill and extend runs)
        self.prefill_runs = 0                  # prefill and extend runs (chunks)
        self._fill_ctx = 0                     # the prefill states' context (padded pieces: grows, powers of two)
        self._run_steps: dict = {}             # prefill run length -> its cost in decode steps (moving average)
        self._step_times: collections.deque = collections.deque(maxlen=RECENT)   # timed decode steps, s
        self._last_piece_steps = 0.0           # the last prefill run's cost in decode steps
        self.mixed_refused = ""                # why this model runs no mixed steps (then pieces run alone)
        self.mixed_steps = 0                   # decode steps that carried a prefill piece
        self._mixed: dict = {}                 # (decode rows, piece length) -> the mixed executable
        self._mixed_states = StateStore()      # theirs: the batch cache's and the prefill's buffers
        self._mixed_added: dict = {}           # piece length -> what it added to its last steps, in steps
        self._riding: tuple | None = None      # (request, limit): the piece the next step carries
        self._mixed_when: dict = {}            # piece length -> mixed_steps when its cost was last measured
        self._mixed_over: dict = {}            # piece length -> its measurements over the budget since it fit
        self._ride_from: tuple | None = None   # (rider, rows, their mean length, _step_now) at its start
        self._plain_age = 0                    # mixed steps since the last timed plain step
        self._oversized = 0                    # idle rounds in a row the cache was larger than needed
        self._ran: weakref.WeakSet = weakref.WeakSet()   # runners run once (later runs are timed)
        self._log: collections.deque = collections.deque(maxlen=STEP_LOG)   # StepRecords, newest last

    # -- submission
    def submit(self, prompt, params: SamplingParams | None = None, on_event=None, chat: bool = False,
               **kw) -> Request:
        """Queue a request: prompt text (chat=True: in the chat template) or token ids;
        `params` or SamplingParams.checked's keywords (max_tokens, min_tokens as aliases).
        `on_event(Event)` is called from the scheduler thread as events come (keep it short).
        With n > 1 the request's `choices` are n Requests (this one first; each its own events,
        every Event with its `index`) admitted together: the prompt is prefilled once."""
        if params is None:
            params = SamplingParams.checked(**kw)
        elif kw:
            raise ModelError(f"pass either params or sampling keywords, not both ({sorted(kw)})")
        on_event = callable_arg("on_event", on_event)
        m = self.model
        if isinstance(prompt, str):
            ids = m.encode_prompt(prompt, bool_arg("chat", chat))
        else:
            if chat:
                raise ModelError("chat=True goes with a text prompt (use model.encode_chat for messages)")
            ids = prompt
        rows, one = token_rows("prompt", ids, m.vocab_size)
        if not one:
            raise ModelError("prompt must be one sequence of token ids (submit each row)")
        ids = rows[0]
        m._check_length(len(ids))
        if params.stop and m.tokenizer is None:
            raise ModelError(f"{m.source} has no tokenizer: stop strings cannot be matched")
        params.check_vocab(m.vocab_size)
        if type(self).round is not Scheduler.round and (params.n > 1 or params.constraint is not None):
            # (a subclass replaying rounds elsewhere, a tensor-parallel group, sends the params
            # as JSON and admits each request as one row)
            raise ModelError(f"n > 1 and constraint are not supported by {type(self).__name__}; "
                             f"got n={params.n}, constraint={params.constraint!r}")
        if params.n > self.max_batch:
            raise ModelError(f"n ({params.n}) is more than the scheduler's max_batch ({self.max_batch})")
        m._check_choices(len(ids), params)
        req = Request(f"req-{next(self._ids)}", list(ids), params, on_event)
        req.choices = [req] + [Request(f"{req.id}-{j}", list(ids), params, on_event, index=j)
                               for j in range(1, params.n)]
        with self._cv:
            if self._closed:
                raise ModelError(f"the scheduler is closed{self.closed_by}")
            self._waiting.append(req)
            self.submitted += 1
            if self._thread is None:
                sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_S))
                self._thread = threading.Thread(target=self._loop, name="rlx-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()
        return req

    def generate(self, prompt, timeout: float | None = None, **kw) -> str:
        """The new text for one text prompt (as CausalLM.generate), through the batch."""
        return self.submit(prompt, **kw).result(timeout).text

    def close(self, timeout: float | None = 30) -> None:
        """Finish: waiting and running requests end "cancelled"; the thread stops."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._waiting) + len(self._active)

    def stats(self) -> dict:
        """A snapshot for operators (the server's /metrics): requests waiting and running,
        the batch size, decode steps run (`mixed_steps` of them carried a prefill piece), and
        the prefix cache's looked-up and hit prompt tokens (0 while no prefix cache runs)."""
        with self._cv:
            waiting = sum(len(r.choices) for r in self._waiting)
            running = len(self._active)
            prefilling = sum(r.slot < 0 for r in self._active)
        cache = self.prefix.stats() if self.prefix is not None else cache_stats(
            capacity=int(self.prefix_cache_mb * 2**20))
        return {"waiting": waiting, "running": running, "max_batch": self.max_batch,
                "submitted": self.submitted, "steps": self.steps,
                "prefix_query_tokens": self.prefix_query_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefilling": prefilling, "prefill_tokens": self.prefill_tokens,
                "prefill_runs": self.prefill_runs, "mixed_steps": self.mixed_steps, **cache}

    def step_log(self, since: float = 0.0) -> list:
        """The last STEP_LOG runs that ended after `since` (time.monotonic()), oldest first, as
        StepRecords: what each step cost and what it carried, so a benchmark can say which of
        the streams' gaps were long and why (a new shape, a piece of some length, the load)."""
        return [r for r in list(self._log) if r.end > since]

    def _logged(self, t0: float, kind: str, rows: int, piece: int, timed: bool) -> None:
        end = time.monotonic()
        self._log.append(StepRecord(end, end - t0, kind, rows, piece, not timed))

    def memory_report(self) -> dict:
        """The model's memory_report with this scheduler's KV cache and runners, and its
        prefix cache (`prefix_cache_bytes`, in total_bytes too)."""
        from .memory import memory_report

        with self.model._lock:
            exes = [e for e in (self._prefill, self._extend, self._decode) if e is not None]
            stores = list({id(e.states): e.states for e in exes}.values())   # (extend shares the prefill's)
            mixed = list(self._mixed.values())        # (their states: the buffers of those stores)
            rep = memory_report(self.model, stores, exes + mixed)
            held = self.prefix.bytes if self.prefix is not None else 0
            rep["prefix_cache_bytes"] = held
            rep["total_bytes"] += held
            return rep

    def warm_mixed(self) -> int:
        """Build now the mixed graph of every (batch bucket, piece length) a mixed step can
        pick (`_piece_lengths`), so that none is built while the streams wait on the step
        that first needs it: a build costs 0.3-0.6 s for SmolLM2 on 2 CPU cores, tens of
        decode steps. What a length's first step still does is specialize its graph to the
        batch cache's buffers (~40 ms there). The server calls this while warming up (before
        /health says ready); release_cache keeps the graphs. Returns how many mixed graphs
        are built (0 where this scheduler does not mix: `_mixes`, `mixed_refused`)."""
        with self.model._lock:
            if not self._mixes():
                return 0
            for rows in self.buckets:
                for piece in self._piece_lengths():
                    if self._mixed_exe(rows, piece) is None:
                        return 0
            return len(self._mixed)

    def _piece_lengths(self) -> list:
        """The lengths a riding piece can have: powers of two up to the chunk (`_piece`: a
        piece is a power of two; a tail short enough to pad runs alone, `_short_ones_alone`)."""
        return [1 << i for i in range(self._chunk().bit_length())]

    def release_cache(self) -> None:
        """Drop the KV caches (the batched decode's and the last prefill's) with their
        executables (rebuilt by the next request, ~0.1 s each: the model is not reloaded;
        the mixed graphs stay built, without their runners and arenas) and trim the heap, so
        the memory long requests took goes back once the scheduler has been idle
        `idle_release_s` seconds (the scheduler thread calls this). The prefix cache
        stays (bounded by prefix_cache_mb): the next turn of a chat comes after a pause."""
        with self.model._lock:
            if self.cache is not None:
                self.cache.clear()
            self.cache = self._decode = self._prefill = self._extend = None
            for exe in self._mixed.values():     # (kept, built: `warm_mixed`; their arenas go)
                exe.drop_runners()
            self._mixed_states.clear()
            self._fill_ctx = 0
        trim_heap()

    # -- the scheduler thread
    def _idle(self) -> bool:
        """Under _cv: wait for work; True when none came for idle_release_s while a KV
        cache is held (the thread then releases it)."""
        while not (self._closed or self._waiting or self._active):
            timed_out = not self._cv.wait(None if self.cache is None else self.idle_release_s)
            if timed_out and self.cache is not None and not (self._closed or self._waiting or self._active):
                return True
        return False

    def _loop(self) -> None:
        while True:
            with self._cv:
                release = self._idle()
                if self._closed:
                    leftover = [c for r in self._waiting for c in r.choices] + self._active
                    self._waiting.clear()
                    self._active = []
                    break
                if not release:
                    room = self.max_batch - len(self._active)
                    new = []
                    while self._waiting and len(self._waiting[0].choices) <= room:
                        room -= len(self._waiting[0].choices)
                        new.append(self._waiting.popleft())
                    idle = not self._waiting
            if release:
                self.release_cache()
            else:
                self.round(new, idle)
        for r in leftover:
            self._finish(r, "cancelled")
        if self.cache is not None:
            self.cache.clear()

    def round(self, new: list, idle: bool) -> None:
        """One round of the scheduler thread, holding the model's lock: admit the `new`
        requests, drop cancelled ones, one decode step of the batch and, when `idle` (none
        waits), size the cache to the requests running. Everything a round does follows
        from `new`, `idle` and the requests' cancel flags (rlx_core.runtime.tp replays the
        rounds on tensor-parallel ranks)."""
        with self.model._lock:
            for r in new:
                self._guard(list(r.choices), self._admit, r)
            self._drop_cancelled()
            self._prefill_round()
            riding, self._riding = self._riding, None
            if riding is not None and self._running():
                self._guard(self._running() + list(riding[0].choices), self._mixed_step, *riding)
            elif self._running():
                self._guard(self._running(), self._step)
            if idle and self._running():
                self._guard(self._running(), self._fit)

    def _running(self) -> list:
        """The requests with a row in the decode batch (in slot order)."""
        return [r for r in self._active if r.slot >= 0]

    def _guard(self, reqs: list, fn, *a) -> None:
        """Run fn; an error fails `reqs` (a request's own problem, or a step's: every row)."""
        try:
            fn(*a)
        except Exception as e:                                   # noqa: BLE001  (handed over)
            err = e if isinstance(e, RlxError) else ModelError(f"{type(e).__name__}: {e}")
            err.__cause__ = e
            for r in reqs:
                if not r.done:
                    r.error = err
                    self._finish(r, "error")

    def _prefill_exe(self) -> Executable:
        """The model's prefill graph over this scheduler's own states (batch 1, the context
        of the request being prefilled; the extend graph shares them; its KV goes to a row
        of the batch cache; release_cache drops them)."""
        if self._prefill is None:
            from ..pipeline import StateStore

            self._prefill = self.model.executable_over("prefill", StateStore())
        return self._prefill

    def _extend_exe(self) -> Executable | None:
        """The model's extend graph over the prefill's states, or None where the model
        cannot extend its caches (`extend_refused` then says why, once)."""
        if self._extend is None and not self.extend_refused:
            prefill = self._prefill_exe()
            try:
                exe = self.model.executable_over("extend", prefill.states)
            except RlxError as e:
                self._refuse(str(e))
                return None
            if _state_specs(exe) != _state_specs(prefill):
                self._refuse("its extend graph's states differ from its prefill graph's")
                return None
            self._extend = exe
        return self._extend

    def _refuse(self, why: str) -> None:
        self.extend_refused = why
        warnings.warn(f"{self.model.source}: prompts are prefilled whole, without a prefix cache: "
                      f"the model cannot extend its caches ({why})", RuntimeWarning, stacklevel=2)

    def _chunk(self) -> int:
        """The prefill chunk in tokens (0: whole prefills)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        runtime = getattr(self.model.profile, "runtime", None)
        return runtime.prefill_chunk if runtime is not None else 0

    def _mixes(self) -> bool:
        """Whether a prefill piece may ride in the decode step's run (a mixed step): asked
        for, chunked prefill on, and a model whose pieces pad (no recurrent states) and whose
        mixed graph was not refused."""
        return self.mixed and not self.mixed_refused and self._chunk() > 0 and self._pads()

    def _mixed_exe(self, rows: int, piece: int) -> Executable | None:
        """The mixed graph of `rows` decode rows and a `piece`-token piece over the batch
        cache's and the prefill's buffers (`_bind_mixed`), or None where the model cannot
        build one whose states are exactly decode's and the prefill's (PIECE_PREFIX):
        `mixed_refused` then says why (a family whose attention or recurrent layers do not
        split the packed tokens leaves no piece states)."""
        key = (rows, piece)
        if key not in self._mixed and not self.mixed_refused:
            try:
                exe = self.model.executable_over("mixed", self._mixed_states, rows=rows, piece=piece)
            except RlxError as e:
                self.mixed_refused = str(e)
                return None
            want = self._mixed_state_dims(rows)
            got = {n: tuple(spec.dims) for n, spec in _state_specs(exe).items()}
            if got != want:
                self.mixed_refused = (f"its mixed graph's states {sorted(got)} are not the decode graph's "
                                      f"and the prefill's {sorted(want)}")
                return None
            self._mixed[key] = exe
        return self._mixed.get(key)

    def _mixed_state_dims(self, rows: int) -> dict:
        """State name -> dims a mixed graph of `rows` decode rows must have: decode's at that
        batch, and the prefill's (batch 1, context PIECE_CTX) under PIECE_PREFIX."""
        dec, pre = self._decode_exe(), self._prefill_exe()
        out = {n: tuple(spec.bind({dec.input_specs["ids"].dims[0]: rows}).dims)
               for n, spec in _state_specs(dec).items()}
        env = {pre.input_specs["ids"].dims[0]: 1, "ctx": PIECE_CTX}
        out.update({PIECE_PREFIX + n: tuple(spec.bind(env).dims) for n, spec in _state_specs(pre).items()})
        return out

    def _bind_mixed(self) -> None:
        """The mixed graphs' states: the batch cache's buffers, and the prefill's under
        PIECE_PREFIX (set only where another buffer is there: a runner stays bound)."""
        cache, fill = self._batch_cache().store, self._prefill_exe().states
        want = {**cache, **{PIECE_PREFIX + n: v for n, v in fill.items()}}
        for name, buf in want.items():
            if self._mixed_states.get(name) is not buf:
                self._mixed_states[name] = buf

    def _prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (made on first use), or None: off, or the model cannot extend."""
        if self.prefix is None and self.prefix_cache_mb > 0 and self._extend_exe() is not None:
            prefill = self._prefill_exe()
            self.prefix = PrefixCache(self.model.backend, _state_specs(prefill),
                                      prefill.input_specs["ids"].dims[0], int(self.prefix_cache_mb * 2**20))
        return self.prefix

    def _decode_exe(self) -> Executable:
        if self._decode is None:
            from ..pipeline import StateStore

            exe = self.model.executable_over("decode", StateStore())
            self.cache = BatchCache(self.model.backend, _state_specs(exe), exe.input_specs["ids"].dims[0])
            exe.states = self.cache.store
            self._decode = exe
        return self._decode

    def _batch_cache(self) -> BatchCache:
        """The batched KV cache (made with the decode executable)."""
        self._decode_exe()
        assert self.cache is not None            # (_decode_exe made it)
        return self.cache

    def _bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _fit(self, extra_ctx: int = 0, extra_row: bool = False) -> None:
        """Size the cache for the running requests (+ one being placed), rows compacted when
        the size changes. At the same size the rows of finished requests stay free holes (the
        graph runs the bucket's rows either way): compacting them moved every later row's KV,
        a copy a state and row, each time a request finished. A row being placed sizes the
        cache for every admitted request (placed or not): placed one by one, 32 requests
        arriving together grew it through 1, 2, 4, 8 and 16 rows, new buffers each time (those
        of the size before evicted: KEEP_SIZES), so the 32-row decode runner was specialized
        again in every such round (0.4-0.5 s on an H200). A larger cache than the rows need
        shrinks only after SHRINK_AFTER idle rounds: a round's last straggler shrank it, and
        the next round's requests grew it back, each size a decode runner built again (1.6 s
        for 8 rows on an H200)."""
        c = self._batch_cache()
        running = self._running()
        rows = max(len(running) + 1, len(self._active)) if extra_row else len(running)
        batch = self._bucket(max(rows, 1))
        ctx = max([r.ctx for r in running] + [extra_ctx])
        if (c.batch, c.ctx) == (batch, ctx):
            self._oversized = 0
            return
        if c.batch >= batch and c.ctx >= ctx:        # room already: grow when needed, shrink when it lasts
            if extra_row:
                return
            self._oversized += 1
            if self._oversized <= SHRINK_AFTER:
                return
        self._oversized = 0
        moves = [(r.slot, i, r.length) for i, r in enumerate(running)]
        c.resize(batch, ctx, moves)
        for i, r in enumerate(running):
            r.slot = i

    def _admit(self, r: Request) -> None:
        """Take r in: its choices join the running requests without a row (prefilled by
        `_prefill_round`, then placed), or finish at once (cancelled, no room to generate)."""
        m, p = self.model, r.params
        n = len(r.prompt_ids)
        for c in r.choices:
            c.max_new = min(p.max_tokens, m.max_positions - n)
            c.rng = np.random.default_rng(p.seed if c.index == 0 or p.seed is None else (p.seed, c.index))
            c.stream = StopText(m.tokenizer, p.stop) if m.tokenizer is not None else None
            c.constraint = check_constraint(p.constraint()) if p.constraint is not None else None
        if r.cancelled or r.max_new == 0:
            for c in r.choices:
                self._finish(c, "cancelled" if r.cancelled else "length")
            return
        ctx = min(-(-(n + r.max_new) // CTX_BUCKET) * CTX_BUCKET, m.max_positions)
        for c in r.choices:
            c.ctx, c.slot, c.filled = ctx, -1, 0
            self._active.append(c)
        self._active.sort(key=lambda q: q.slot)  # (slot order: the unplaced first, in their order)
        self._fills.append(r)

    def _prefill_round(self) -> None:
        """Prefill the waiting requests in order, in pieces (`_piece`). While no batch decodes,
        all of them; while one does, only what this round may add to its decode step: at most
        `prefill_chunk` tokens, and, with a `stall_budget`, pieces whose measured cost in
        decode steps fits in that budget (`_budget_limit`), at least one piece a round. A
        prompt with at most PAD_TAIL tokens left (a new request's question after a cached
        system prompt) is one piece of about a step: it goes in at once (the chunk allowing),
        so requests arriving together get their first tokens together.

        Why a budget in decode steps: the streams' inter-token gap during a long prefill is a
        decode step plus the round's prefill, so a budget of b steps keeps it <= (1 + b) x
        their pace, whatever the hardware; a piece's cost is measured as a multiple of the
        step (both slow down alike when the machine is loaded, so the ratios stay valid). A
        fixed chunk cannot do this: 256 tokens cost ~8 steps on 2 CPU cores, 1 on a GPU.

        With mixed steps (`_mixes`) no piece runs here while a batch decodes: the first
        waiting prompt's next piece rides in the decode step (`_next_rider`, `_mixed_step`),
        the budget then bounding what the piece adds to that step as measured."""
        chunk = self._chunk()
        running = bool(self._running())
        if running and self._mixes():
            self._short_ones_alone(chunk)
            self._riding = self._next_rider(chunk)
            return
        tokens_left = chunk if running and chunk else None
        steps_left = self.stall_budget if running and self.stall_budget else None
        ran = 0
        while (r := self._front()) is not None:
            limit = chunk if tokens_left is None else tokens_left
            if steps_left is not None and len(r.prompt_ids) - r.filled > PAD_TAIL:
                limit = self._budget_limit(limit or self.model.max_positions, steps_left, first=not ran)
                if not limit:
                    break
            done, runs = self.prefill_tokens, self.prefill_runs
            self._guard(list(r.choices), self._fill, r, limit)
            ran += 1
            if tokens_left is not None:
                tokens_left -= self.prefill_tokens - done
                if tokens_left <= 0:
                    break
            if steps_left is not None:
                steps_left -= self._last_piece_steps if self.prefill_runs > runs else 0.0

    def _short_ones_alone(self, chunk: int) -> None:
        """With mixed steps: waiting prompts with at most PAD_TAIL tokens left after their
        cached prefix (and at most `chunk`) are prefilled alone, whole, in order, before the
        step (as without mixed steps): so requests arriving together while a batch decodes
        join it together, and a new request's question after a cached system prompt gets its
        first token at once.
        Longer prompts ride in the steps (`_next_rider`), their tails too: a 64-token tail
        run alone cost 3-5 decode steps (one stall of every stream, the p99 of a short
        prefill's gaps), riding it costs its tokens a step at a time within the budget."""
        while (r := self._front()) is not None and len(r.prompt_ids) - r.filled <= min(PAD_TAIL, chunk) \
                and not r.rode:
            self._guard(list(r.choices), self._fill, r, chunk)

    def _front(self) -> Request | None:
        """The first waiting prompt still wanted (cancelled and finished ones dropped), its
        prefill begun (`_start_fill`), or None. Begun before it is judged: a prompt's length
        left (`len(prompt_ids) - filled`) then excludes its cached prefix, so a question after
        a cached 1,000-token system prompt is short and runs alone, whole (judged by its
        whole length, it rode at 16 tokens a step: serve_race scenario 1 lost ~3.5 s a
        round). Its prefix is copied into the prefill states at once, so a later eviction
        from the prefix cache cannot take it, and nothing is held for it there."""
        while self._fills:
            r = self._fills[0]
            if r.done or r.cancelled or r not in self._active:
                self._fills.popleft()
            elif not r.begun:
                self._guard(list(r.choices), self._start_fill, r)
            else:
                return r
        return None

    def _next_rider(self, chunk: int) -> tuple | None:
        """(request, limit) of the piece the next decode step carries (a mixed step): the
        first waiting prompt's (after `_short_ones_alone`: a long one), at most `chunk`
        tokens, and with a `stall_budget` as many as fit in it (`_mixed_limit`), but at least
        PIECE_MIN while other prompts wait behind it (the prefill states hold one prompt at a
        time: those wait for its whole prefill, which one-token pieces would stretch to a
        step a token). None when no prompt waits, and, with a budget, while no plain step was
        timed or REFERENCE mixed steps ran since one: what a piece adds is measured against
        the step of now (`_step_now`), not one from before the ride, when the machine's load
        may have been another (on a shared VM steps are bimodal, ~20 or ~300 ms: a stale
        reference read a one-token piece as adding a step or more, and the pieces stayed at
        one token for a whole 600-token prompt)."""
        if self.stall_budget is not None and (not self._step_times or self._plain_age >= REFERENCE):
            return None                          # a plain step, timed: the reference of what pieces add
        r = self._front()
        if r is None:
            return None
        limit = chunk
        if self.stall_budget is not None:
            limit = self._mixed_limit(chunk, self.stall_budget, self._growth(r))
            if any(not (q.done or q.cancelled) for q in itertools.islice(self._fills, 1, None)):
                limit = max(limit, min(PIECE_MIN, chunk))
        return r, limit

    def _growth(self, r: Request) -> float:
        """What the streams' step will grow by, in steps of now, while r's prompt rides at one
        token a step (at n a step: 1/n of it): their step's growth per key of context since r
        began to ride, times r's tokens left; 0 until they gained GROWTH_KEYS keys in the ride
        (less growth is within a step's noise); read afresh when a row joins or leaves (the step
        changes with its rows, not by growth). Every stream gains a key a step, so a long
        prompt ridden in short pieces makes their steps grow more than the pieces add (SmolLM2,
        2 cores, 8 streams: a 29 ms step grew to 83 ms over a 4,000-token prompt ridden in
        1,799 mixed steps of 1-8 tokens, each adding 0.3-0.6 steps)."""
        running = self._running()
        keys = statistics.fmean(q.length for q in running) if running else 0.0
        if self._ride_from is None or self._ride_from[0] is not r or self._ride_from[1] != len(running):
            self._ride_from = (r, len(running), keys, self._step_now)
            return 0.0
        *_, keys0, step0 = self._ride_from
        now = self._step_now
        if keys - keys0 < GROWTH_KEYS or not now:
            return 0.0
        per_key = max(now - step0, 0.0) / ((keys - keys0) * now)
        return per_key * (len(r.prompt_ids) - r.filled)

    @staticmethod
    def _end_gap(n: int, added: float, growth: float) -> float:
        """The streams' gap at the end of a prefill ridden in pieces of n tokens, in steps of
        now: a step grown by growth / n (`_growth`), with the piece's addition."""
        return (1.0 + added) * (1.0 + growth / n)

    def _mixed_limit(self, cap: int, steps: float, growth: float = 0.0) -> int:
        """The longest measured piece length (a power of two up to `cap`) whose addition to a
        decode step fits in `steps` steps, and no shorter one's over it (a longer piece adds
        no less: a lucky measurement of a long one does not make it fit), or one doubling
        above it where a try of that length is due (`_probe_due`) and its expected addition
        (`_probe_cost`) fits: the pieces start at one token and double
        while they fit, one measured doubling at a time (never a jump past what was measured:
        a one-token step once measured as adding nothing made every longer piece look free,
        and the chunk, 256 tokens, rode: a 20-step stall). No floor as for pieces run alone:
        a riding piece pays no run's fixed cost of its own, only its tokens' work.

        Where even the least any piece adds (a mixed step's own overhead) is over `steps`,
        the budget cannot hold whatever the piece: the pieces adding at most TIE more than
        that least fit, not one token a step, which would stall the streams as much for a
        prompt's whole length (quiet 2 cores, SmolLM2, 4 rows: a step 17-23 ms; 1, 2, 4, 8
        tokens add 0.59-0.69, 0.61-0.63, 0.55-0.94, 0.65-0.73 steps).

        With the streams' `growth` over the prefill (`_growth`), a longer length is taken, and
        tried, where it ends the prefill with shorter gaps (`_end_gap`: the step's growth it
        saves over what it adds, the additions read no less than a shorter one's as above): the
        budget bounds a step's addition, not the growth a slower prefill lets through."""
        cost = self._mixed_cost
        if not cost:
            return 1
        budget, steps = steps, self._fit_steps(steps, cost)
        lengths = sorted(k for k in cost if k <= cap)
        read = dict(zip(lengths, itertools.accumulate((cost[n] for n in lengths), max)))  # >= a shorter's
        size = max((n for n in lengths if read[n] <= steps), default=1)
        if size not in read:
            return size
        if growth:
            size = min((n for n in lengths if n >= size),
                       key=lambda n: (self._end_gap(n, read[n], growth), n))
        up = size * 2
        if up <= cap and self._probe_due(up):
            expected, blind = self._probe_cost(size, cost)
            expected = max(expected, read[size])
            if expected <= steps + (budget if blind else 0.0) or (
                    growth and self._end_gap(up, expected, growth) < self._end_gap(size, read[size], growth)):
                return up
        return size

    @staticmethod
    def _fit_steps(steps: float, cost: dict) -> float:
        """The addition a piece may make to a step with a budget of `steps`: the budget, or,
        where even the least any length adds is over it, TIE above that least (`_mixed_limit`)."""
        return max(steps, min(cost.values()) * (1 + TIE))

    def _probe_due(self, n: int) -> bool:
        """Whether a piece of `n` tokens may be tried: never measured, or PROBE_FIRST mixed
        steps after its last measurement, the wait doubling with each measurement over the
        budget since it last fit (up to REMEASURE). Its cost is the least of its recent
        measurements, so one probe in a spell of a loaded host only delays the next (the
        wait was REMEASURE from the first: two probes of +2 in slow spells held a 600-token
        prompt at one-token pieces, 68 s); a length that truly costs too much is tried
        ever more rarely (after 5 measurements over, once in REMEASURE steps: under 1% of
        the streams' gaps, which their p99 does not see)."""
        wait = min(PROBE_FIRST << self._mixed_over.get(n, 0), REMEASURE)   # 8; over: 16, 32, ...
        return self.mixed_steps - self._mixed_when.get(n, -REMEASURE) >= wait

    def _measured(self, n: int, added: float) -> None:
        """A mixed step with a piece of `n` tokens added `added` decode steps: kept among its
        last MIXED_RECENT, when noted, and counted over the budget (its cost, the least of
        those, over) or its count forgotten (it fits), for `_probe_due`."""
        self._mixed_added.setdefault(n, collections.deque(maxlen=MIXED_RECENT)).append(added)
        self._mixed_when[n] = self.mixed_steps
        cost = self._mixed_cost
        if self.stall_budget is not None and cost[n] > self._fit_steps(self.stall_budget, cost):
            self._mixed_over[n] = self._mixed_over.get(n, 0) + 1
        else:
            self._mixed_over.pop(n, None)

    @staticmethod
    def _probe_cost(size: int, cost: dict) -> tuple:
        """(what a piece of 2 x `size` tokens is expected to add, in steps; whether that is a
        guess): the line through the additions measured at `size` and the next length below
        it, extended (a fixed overhead plus a cost a token; no slope below 0). With no length
        below measured, twice `size`'s (as if it were all per token): a guess, which a probe
        may exceed the budget by up to the budget again to test (as often as `_probe_due`
        allows; without it pieces whose overhead is most of their cost would stay at one
        token)."""
        below = [n for n in cost if n < size]
        if not below:
            return 2 * cost[size], True
        lo = max(below)
        slope = max(cost[size] - cost[lo], 0.0) / (size - lo)
        return cost[size] + slope * size, False

    def _budget_limit(self, cap: int, steps: float, first: bool, cost: dict | None = None) -> int:
        """The longest piece (a power of two up to `cap`) whose estimated cost fits in `steps`
        decode steps; the round's first piece at least PIECE_MIN tokens (a prompt always
        advances at a useful rate: where the fixed cost of a run is a step or more, as on a
        loaded CPU, one-token pieces would stall the streams as much and take 16x the rounds);
        a later one that fits nothing: 0, the round stops. (A piece's cost is not proportional
        to its length: up to a few rows a packed matmul is a GEMV, beyond them it decodes the
        weights for BLAS; so the choice follows the costs measured, not a rate.)"""
        size = 1 << max(cap, 1).bit_length() - 1
        while size > 1 and self._estimate(size, cost) > steps:
            size //= 2
        if first:
            return max(size, min(PIECE_MIN, cap))
        return size if self._estimate(size, cost) <= steps else 0

    def _estimate(self, size: int, cost: dict | None = None) -> float:
        """A prefill run of `size` tokens in decode steps of the batch: its moving average,
        else interpolated between the nearest lengths measured below and above it (a fixed
        cost plus a cost a token), else scaled from the nearest one (proportionally:
        pessimistic going up, optimistic going down; the run it leads to corrects it); 0
        while none was measured. `cost`: the costs measured (the pieces run alone's unless
        given: a mixed step's additions)."""
        cost = self._run_steps if cost is None else cost
        if size in cost or not cost:
            return cost.get(size, 0.0)
        lo = max((k for k in cost if k < size), default=None)
        hi = min((k for k in cost if k > size), default=None)
        if lo is not None and hi is not None:
            return cost[lo] + (cost[hi] - cost[lo]) * (size - lo) / (hi - lo)
        near = lo if lo is not None else hi
        return cost[near] * size / near

    def _fill(self, r: Request, limit: int) -> None:
        """One piece of r's prefill (`_piece`: at most `limit` tokens, 0: no limit) as a run of
        its own; the last places its choices."""
        self._run_piece(r, *self._piece_feed(r, limit))

    def _run_piece(self, r: Request, exe, feed: dict, a: int, b: int, run: int) -> None:
        """Run a piece (`_piece_feed`'s) alone, its cost measured in decode steps."""
        began = time.monotonic()
        timed = self._warm(exe, feed)
        t0 = time.perf_counter()
        logits = exe.run(feed)["logits"][:, -1]
        if self._step_cost and timed:
            self._last_piece_steps = (time.perf_counter() - t0) / self._step_cost
            self._run_steps[run] = _average(self._run_steps.get(run), self._last_piece_steps)
        self._logged(began, "piece", 0, run, timed)
        self._filled(r, a, b, logits)

    def _piece_feed(self, r: Request, limit: int) -> tuple:
        """(executable, feed, start, end, run length) of r's next prefill piece (`_piece`),
        its states sized (r begun: `_front`)."""
        n = len(r.prompt_ids)
        a = r.filled
        b, run = self._piece(a, n, limit)
        pads = self._pads()
        ext = self._extend if a or pads else None
        exe = ext or self._prefill_exe()
        ctx = self._fill_ctx_of(r) if pads else r.ctx
        if pads:
            self._size_fill_states(ctx)
        exe.fixed_dims = {"ctx": ctx}
        ids = np.zeros((1, run), np.int64)
        ids[0, :b - a] = r.prompt_ids[a:b]
        if ext is None:
            feed = {"ids": ids, "positions": np.arange(b, dtype=np.int64)[None],
                    "key_mask": np.ones((1, 1, 1, b), bool), "cache_pos": np.zeros(1, np.int32)}
        else:
            mask = np.zeros((1, 1, 1, ctx), bool)
            mask[..., :a + run] = True            # (filler keys only follow the real ones: never seen)
            positions = np.minimum(np.arange(a, a + run, dtype=np.int64), b - 1)[None]
            last = np.zeros((1, 1, run), np.float32)
            last[0, 0, b - a - 1] = 1
            feed = {"ids": ids, "positions": positions, "key_mask": mask, "cache_pos": np.array([a], np.int32),
                    "last_token": last}
        return exe, feed, a, b, run

    def _filled(self, r: Request, a: int, b: int, logits) -> None:
        """r's prompt tokens [a, b) are in the prefill states (`logits` [1, vocab]: those of
        token b - 1): counted, cached, and at the prompt's end its choices placed."""
        self._counted(r, a, b)
        self._placed(r, logits)

    def _counted(self, r: Request, a: int, b: int) -> None:
        """r's prompt tokens [a, b) are in the prefill states: counted and cached."""
        r.filled = b
        self.prefill_tokens += b - a
        self.prefill_runs += 1
        if self.prefix is not None:
            blk = self.prefix.block
            self.prefix.insert(r.prompt_ids, self._prefill_exe().states, 0, b // blk * blk,
                               snapshot=b % blk == 0)

    def _placed(self, r: Request, logits) -> None:
        """At the end of r's prompt, its choices placed (`logits` [1, vocab]: its last token's)."""
        if r.filled == len(r.prompt_ids):
            self._fills.popleft()
            self._place(r, logits)

    def _pads(self) -> bool:
        """Whether prefill pieces run through the extend graph padded to a few lengths: a model
        that extends and has no recurrent state (filler tokens would step it; such a model's
        pieces run at their own lengths, each new one compiling its graph)."""
        ext = self._extend_exe()
        return ext is not None and all("ctx" in s.dims for s in _state_specs(ext).values())

    def _fill_ctx_of(self, r: Request) -> int:
        """The padded prefill states' context for r: room for its prompt and a padded tail, a
        power of two (at least FILL_CTX_MIN) that only grows, so its runners stay bound."""
        need = len(r.prompt_ids) + PAD_TAIL
        ctx = max(FILL_CTX_MIN, 1 << (need - 1).bit_length())
        self._fill_ctx = max(self._fill_ctx, ctx)
        return self._fill_ctx

    def _start_fill(self, r: Request) -> None:
        """Before r's first piece, once (`_front`): the prefill states sized to r's context, its
        longest cached prefix (at most all but the last prompt token: that one gives the
        logits) copied in, and r.filled set past it."""
        r.begun = True
        n = len(r.prompt_ids)
        if n > 1:
            self._extend_exe()                   # (pieces need it; refused: whole prefills)
        pc = self._prefix_cache()
        if pc is None:
            return
        self.prefix_query_tokens += n
        hit, entries = pc.lookup(r.prompt_ids, n - 1)
        if hit:
            self._size_fill_states(self._fill_ctx_of(r) if self._pads() else r.ctx)
            pc.restore(entries, self._prefill_exe().states)
            r.filled = hit
            self.prefix_hit_tokens += hit

    def _size_fill_states(self, ctx: int) -> None:
        """The prefill's state buffers at batch 1 and context `ctx` (what its run would make)."""
        exe = self._prefill_exe()
        states = exe.states
        env = {exe.input_specs["ids"].dims[0]: 1, "ctx": ctx}
        for name, spec in _state_specs(exe).items():
            dims = spec.bind(env).dims
            cur = states.get(name)
            if cur is None or tuple(cur.shape) != tuple(dims):
                states[name] = self.model.backend.zeros(dims, spec.dtype)

    def _piece(self, a: int, n: int, limit: int) -> tuple:
        """(end, run length) of the prefill piece starting at prompt token `a`: at most
        `limit` tokens (0: no limit), and, for a model with recurrent states and a prefix
        cache, ending at the prompt's last block boundary (a snapshot there lets a later
        prompt continue this one). Padded pieces (`_pads`) run at a few lengths only: a
        power of two, exact, or a tail of at most PAD_TAIL tokens padded up to one (at least
        PIECE_MIN), so after the first requests no piece compiles a graph; otherwise the
        piece runs at its own length."""
        end = n
        if self.prefix is not None and self.prefix.needs_snapshot:
            edge = n // self.prefix.block * self.prefix.block
            if a < edge:
                end = edge
        left = end - a
        if not self._pads():
            b = min(end, a + limit) if limit and self._extend is not None else end
            return b, b - a
        size = min(left, limit) if limit else left
        padded = 1 << (left - 1).bit_length()
        if left <= PAD_TAIL and (not limit or padded <= limit):
            return end, max(padded, min(PIECE_MIN, limit or PIECE_MIN))
        size = 1 << size.bit_length() - 1
        return a + size, size

    def _place(self, r: Request, logits) -> None:
        """r's prompt is prefilled: each choice gets a free row of the batch cache (its KV
        copied there) and its first token from the prefill's `logits`."""
        n = len(r.prompt_ids)
        prompt_lp = self._prompt_logprobs(r) if r.params.prompt_logprobs is not None else None
        for c in r.choices:
            if c.done:
                continue
            c.prompt_logprobs = prompt_lp
            self._fit(extra_ctx=c.ctx, extra_row=True)
            cache = self._batch_cache()
            used = {q.slot for q in self._running()}
            c.slot = next(i for i in range(cache.batch) if i not in used)
            cache.place(c.slot, self._prefill_exe().states, n)
            c.length = n
            self._active.sort(key=lambda q: q.slot)
            self._take(c, logits)

    def _prompt_logprobs(self, r: Request) -> list:
        """r's prompt logprobs from the model's logits graph (every position; no KV cache)."""
        ids = np.asarray([r.prompt_ids], np.int64)
        feed = self.model._inputs(ids, np.ones(ids.shape, bool))
        logits = self.model.executable("logits").run(feed)["logits"][0]
        if not np.isfinite(logits).all():
            raise ModelError(f"{self.model.source}: non-finite prompt logits for request {r.id}")
        return prompt_token_logprobs(logits, r.prompt_ids, r.params.prompt_logprobs)

    def _decode_feed(self, running: list) -> dict:
        """The inputs of a decode step of the batch cache's rows (`running` in theirs)."""
        c = self._batch_cache()
        b, ctx = c.batch, c.ctx
        ids = np.zeros((b, 1), np.int64)
        pos = np.zeros((b, 1), np.int64)
        cache_pos = np.zeros(b, np.int32)
        mask = np.zeros((b, ctx), bool)
        mask[:, 0] = True                     # an idle row attends to one stale key, not none
        for r in running:
            ids[r.slot, 0], pos[r.slot, 0], cache_pos[r.slot] = r.last, r.length, r.length
            mask[r.slot, :r.length + 1] = True
        return {"ids": ids, "positions": pos, "key_mask": mask[:, None, None, :], "cache_pos": cache_pos}

    def _mixed_step(self, r: Request, limit: int) -> None:
        """A decode step of the batch that also runs r's next prefill piece (at most `limit`
        tokens) in the same run (`_mixed_exe`): the weights are read once for both, so the
        streams wait a step plus the piece's own work, not a run's fixed cost more. It gives
        every row's next token (the graph's greedy ids where `_greedy_ids` allows, as a plain
        step) and, at the prompt's end, r's first (from the logits). Where the
        model refuses mixed graphs the piece runs alone before a plain step."""
        began = time.monotonic()
        ext, pfeed, a, b, run = self._piece_feed(r, limit)
        c = self._batch_cache()
        exe = self._mixed_exe(c.batch, run)
        if exe is None:
            self._run_piece(r, ext, pfeed, a, b, run)
            self._step()
            return
        running = self._running()
        dfeed = self._decode_feed(running)
        feed = {"ids": np.concatenate([dfeed["ids"].T, pfeed["ids"]], 1),
                "positions": np.concatenate([dfeed["positions"].T, pfeed["positions"]], 1),
                "key_mask": dfeed["key_mask"], "cache_pos": dfeed["cache_pos"],
                "piece_mask": pfeed["key_mask"], "piece_pos": pfeed["cache_pos"],
                "last_token": pfeed["last_token"]}
        exe.fixed_dims = {"ctx": c.ctx, PIECE_CTX: ext.fixed_dims["ctx"]}
        self._bind_mixed()
        self.steps += 1
        self.mixed_steps += 1
        self.max_rows = max(self.max_rows, len(running))
        timed = self._warm(exe, feed)
        t0 = time.perf_counter()
        last = b == len(r.prompt_ids)            # (then r's first token comes from the logits)
        greedy = None if last else self._greedy_ids(exe, feed, running)
        logits: Any = None if greedy is not None else exe.run(feed, fetch=("logits",))["logits"][:, -1]
        self._plain_age += 1
        if self._step_now and timed:
            self._measured(run, (time.perf_counter() - t0) / self._step_now - 1.0)
        self._logged(began, "mixed", len(running), run, timed)
        r.rode = True
        self._counted(r, a, b)                   # (before the rows' tokens: a listener sees the piece done)
        for q in running:
            q.length += 1
            if greedy is not None:
                self._guard([q], self._accept, q, int(greedy[q.slot]))
            elif not q.done:
                self._guard([q], self._take, q, logits[q.slot:q.slot + 1])
        self._placed(r, logits[c.batch:c.batch + 1] if last else None)   # (after: placing may move rows)

    @property
    def _step_cost(self) -> float:
        """Seconds a decode step of the batch takes: the median of the last RECENT timed
        (a moving average would carry one stalled step, the machine busy elsewhere, for
        many steps); 0 while none was timed."""
        return statistics.median(self._step_times) if self._step_times else 0.0

    @property
    def _step_now(self) -> float:
        """Seconds a decode step of the batch takes now: the least of the last NOW timed (the
        reference of a mixed step's addition: `_next_rider` keeps it fresh; see _mixed_cost
        for why the least); 0 while none was timed."""
        return min(list(self._step_times)[-NOW:]) if self._step_times else 0.0

    @property
    def _mixed_cost(self) -> dict:
        """Piece length -> what riding in a decode step adds to it, in steps: the least of its
        last MIXED_RECENT measurements (at least 0), each against the least of the plain steps
        timed just before (`_step_now`). The least, not the median: another process's load
        only ever slows a step, and on a shared machine it comes in spells of many steps, so
        a median of 5 read a spell as the piece's cost (SmolLM2 on 2 loaded cores, in a
        ride: 2 tokens measured 0.8 steps, 0.2 when the same executables ran interleaved),
        and the pieces stayed at one token (a 4,000-token prompt in 3,244 mixed steps, 364
        s, while the streams' own steps doubled as their contexts grew). What the streams see
        in a spell is their steps slowed with or without the piece; what the piece adds is
        its own work, which the least measures."""
        return {n: max(min(d), 0.0) for n, d in self._mixed_added.items()}

    def _warm(self, exe, feed: dict) -> bool:
        """Specialize exe for feed's shapes now (a no-op once done) and say whether its run
        may be timed: not its runner's first (compiled now, and a backend may compile kernels
        on a first call), whose time a cost average would carry for many steps."""
        runner = exe.prepare(feed)[0]
        if runner in self._ran:
            return True
        self._ran.add(runner)
        return False

    def _step(self) -> None:
        began = time.monotonic()
        exe, c = self._decode_exe(), self._batch_cache()
        running = self._running()
        exe.fixed_dims = {"ctx": c.ctx}
        feed = self._decode_feed(running)
        self.steps += 1
        self.max_rows = max(self.max_rows, len(running))
        timed = self._warm(exe, feed)
        t0 = time.perf_counter()
        greedy = self._greedy_ids(exe, feed, running)
        asked: dict = {}
        if greedy is None:
            wait = exe.submit(feed, ("logits",))
            for r in running:               # (the masks while the device runs the step)
                if r.constraint is not None:
                    self._guard([r], lambda r=r: asked.__setitem__(r.id, ask(r.constraint)))
            logits = wait()["logits"][:, -1]
        if timed:
            self._step_times.append(time.perf_counter() - t0)
            self._plain_age = 0
        self._logged(began, "decode", len(running), 0, timed)
        for r in running:
            r.length += 1
            if greedy is not None:
                self._guard([r], self._accept, r, int(greedy[r.slot]))
            elif not r.done:
                self._guard([r], self._take, r, logits[r.slot:r.slot + 1], asked.get(r.id))

    def _greedy_ids(self, exe, feed, running: list):
        """The graph's arg-max ids [batch] when every running request is greedy and
        fetch_greedy gives them (a few bytes per row instead of the logits), else None."""
        if not greedy_outputs(exe) or not all(r.params.argmax for r in running):
            return None
        banning = [r.slot for r in running if r.n_new < r.params.min_tokens]
        if banning and updates_in_place(exe):
            return None          # (a refused greedy id reruns the step: in-place states would step twice)
        return fetch_greedy(exe, feed, [r.slot for r in running], banning,
                            np.array(self.model.eos_ids, np.int64))

    def _take(self, r: Request, logits, asked=None) -> None:
        """Choose r's next token from its logits [1, vocab] (SamplingParams.process, then
        .choose; EOS where its constraint is finished) and pass it on. `asked`: its
        constraint's answers for this step (`ask`), when taken while the step ran."""
        if not np.isfinite(logits).all():
            raise ModelError(f"{self.model.source}: non-finite logits for request {r.id}")
        p, eos = r.params, tuple(self.model.eos_ids)
        cons = asked if asked is not None or r.constraint is None else ask(r.constraint)
        forced = cons is not None and cons.finished()
        if forced:
            if not eos:
                raise ModelError(f"{self.model.source}: request {r.id}'s constraint finished but the model "
                                 "has no EOS token")
            tok = eos[0]
        else:
            seen = [r.prompt_ids + r.token_ids] if p.repetition_penalty != 1.0 else ()
            x = p.process(logits, seen=seen, generated=[r.token_ids], n_new=r.n_new, eos=eos,
                          constraints=None if cons is None else [cons])
            tok = int(p.choose(x, [r.rng])[0])
        lp = token_logprobs(logits, [tok], p.logprobs)[0] if p.logprobs is not None else None
        self._accept(r, tok, lp, forced)

    def _accept(self, r: Request, tok: int, logprob=None, forced: bool = False) -> None:
        """Pass r's next token on: finish it (EOS, a forced EOS, a stop string, its length) or
        emit it (with its logprob, when asked)."""
        p, eos = r.params, self.model.eos_ids
        r.n_new += 1
        r.last = tok
        if forced or (tok in eos and not p.ignore_eos):
            self._finish(r, "stop")
            return
        r.token_ids.append(tok)
        lps = [logprob] if logprob is not None else []
        r.logprobs += lps
        if r.constraint is not None:
            r.constraint.accept(tok)
        text, stopped = r.stream.push(tok) if r.stream is not None else ("", False)
        if stopped:
            self._finish(r, "stop", [tok], text, lps)
        elif r.n_new >= r.max_new or r.length + 1 > self.model.max_positions:
            self._finish(r, "length", [tok], text, lps)
        elif r.cancelled:
            self._finish(r, "cancelled", [tok], text, lps)
        else:
            r._emit(Event([tok], text, logprobs=lps, index=r.index))

    def _remember(self, r: Request) -> None:
        """Keep a finished request's prompt + answer in the prefix cache (from its row of the
        batch cache): the next turn of a conversation starts with them."""
        pc, cache = self.prefix, self.cache
        if pc is None or cache is None or not all(name in cache.store for name in {**pc.kv, **pc.recurrent}):
            return
        self._guard([], lambda: pc.insert(r.prompt_ids + r.token_ids, cache.store, r.slot, r.length,
                                          snapshot=r.length % pc.block == 0))

    def _drop_cancelled(self) -> None:
        for r in [q for q in self._active if q.cancelled]:
            self._finish(r, "cancelled")

    def _finish(self, r: Request, reason: str, tokens=(), text: str = "", logprobs=()) -> None:
        if r.done:
            return
        if r in self._active:
            if reason in ("stop", "length") and r.slot >= 0:
                self._remember(r)
            self._active.remove(r)
        if r.stream is not None and reason != "error":
            text += r.stream.finish()
        r.finish_reason = reason
        r._emit(Event(list(tokens), text, reason, r.error, list(logprobs), r.index))


def _average(old: float | None, new: float) -> float:
    """A moving average of run costs (COST_EMA the newest's weight): follows the load."""
    return new if old is None else (1 - COST_EMA) * old + COST_EMA * new


def _state_specs(exe) -> dict:
    """State name -> its Shape, of an executable's graph."""
    return {n.name: n.outs[0] for n in exe.mir.nodes if n.op == "state"}


__all__ = ["Scheduler", "SamplingParams", "Request", "Event", "Completion", "StepRecord", "batch_buckets",
           "FINISH_REASONS", "IDLE_RELEASE_S", "trim_heap"]

