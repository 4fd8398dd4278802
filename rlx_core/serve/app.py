"""The OpenAI-compatible ASGI app (Starlette): GET /v1/models, POST /v1/completions,
/v1/chat/completions (through each causal model's Scheduler, so concurrent requests share
its decode batch; streamed as server-sent events) and /v1/embeddings (encoder models, and
models that embed images: base64 data URLs in, as vLLM's multimodal embeddings take them).

Hostile requests get a 4xx and cost little: a body is bounded (max_body_mb: a 413 before
it is read when Content-Length says more, or as its chunks pass the limit; a 400 when it
stops short), parsing, tokenizing and rendering run off the event loop (GET /v1/models
answers while a multi-MB prompt is tokenized), and every request, streamed or not, stops decoding when
its client leaves. Client errors never show a path on this server.

For operators (rlx_core.serve.ops): GET /health (503 until every model is warm), GET /metrics
(Prometheus), POST /tokenize and /detokenize (vLLM's shapes), an API key, CORS origins, a
queue bound (429 with Retry-After), a request timeout and a graceful shutdown's drain."""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..ir.errors import ModelError, RlxError
from ..runtime.encoder import embeds_images
from ..runtime.sampling import SamplingParams
from ..runtime.scheduler import Scheduler, trim_heap
from . import protocol as P
from .ops import METRICS_TYPE, Gate, Ops, Timing, error_response
from .page import routes as page_routes
from .protocol import ApiError


MAX_BODY_MB = 8              # the default limit of a request body (rlx serve --max-body-mb)
STALL_BUDGET = 0.35          # a round's prefill (pieces run alone, or what the piece riding in a mixed step
                             # adds to it) costs <= this share of a decode step (rlx serve --stall-budget;
                             # 0.5 let a 4,000-token prompt raise 8 streams' p99 gap 1.64-2.16x on 2 cores,
                             # 0.35 1.24-1.25x, its time to first token 73-77 s against 70-100 s)
BODY_IDLE_S = 30.0           # a body that stops arriving this long is a 400 (not a wait forever)
BIG_BODY = 1 << 20           # after a request this big, freed memory goes back to the OS
RETRY_AFTER_S = 1            # a 429's Retry-After: a batch row frees within a few decode steps
log = logging.getLogger("rlx.serve")
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"]+/)+[^\s/'\",;:)]*")


class ClientGone(Exception):
    """The client disconnected: nothing more is read or computed for its request."""


class Served:
    """The models of one server by name: causal LMs with their schedulers, and encoders.
    `groups` (name -> rlx_core.runtime.tp.TensorParallel): those models run on the group's
    rank processes (the model given here serves its tokenizer and config); `close` stops them.
    `max_body_mb` bounds a request body; `body_idle_s`: how long a body may stop arriving;
    `max_queue`: how many requests (choices) may wait for a batch row per model (beyond it a
    429), None: no bound; `request_timeout` (seconds): a generation running longer is
    cancelled; `scheduler_options`: keywords for each model's Scheduler (only those given;
    a scheduler run here gets STALL_BUDGET unless they give stall_budget)."""

    def __init__(self, models: dict, max_batch: int = 8, default_max_tokens: int | None = None,
                 groups: dict | None = None, max_body_mb: float = MAX_BODY_MB,
                 body_idle_s: float = BODY_IDLE_S, max_queue: int | None = None,
                 request_timeout: float | None = None, scheduler_options: dict | None = None):
        from ..runtime.model import CausalLM

        from ..runtime.args import float_arg, int_arg

        self.max_body = int(float_arg("max_body_mb", max_body_mb, 0.0, lo_open=True) * 2**20)
        self.body_idle_s = float_arg("body_idle_s", body_idle_s, 0.0, lo_open=True)
        self.max_queue = None if max_queue is None else int_arg("max_queue", max_queue, lo=0)
        self.request_timeout = None if request_timeout is None else float_arg(
            "request_timeout", request_timeout, 0.0, lo_open=True)
        self.models, self.created = dict(models), int(time.time())
        self.groups = dict(groups or {})
        options = dict(scheduler_options or {})
        self.schedulers = {n: self._scheduler(n, m, max_batch, options)
                           for n, m in self.models.items() if isinstance(m, CausalLM)}
        self.default_max_tokens = default_max_tokens
        self._admitted = dict.fromkeys(self.schedulers, 0)   # choices submitted and not finished
        self._admit_lock = threading.Lock()

    def _scheduler(self, name: str, model, max_batch: int, options: dict) -> Scheduler:
        """`name`'s Scheduler with `options`; a ModelError naming those it cannot take (a
        tensor-parallel group's ranks run rounds of their own: it takes none)."""
        from ..runtime.tp import GroupScheduler

        if name in self.groups:
            if options:
                raise ModelError(f"scheduler options {sorted(options)} are not available for '{name}', which "
                                 "is served tensor-parallel (its rank processes run the rounds)")
            return GroupScheduler(self.groups[name], model, max_batch)
        takes = inspect.signature(Scheduler.__init__).parameters
        unknown = sorted(k for k in options if k not in takes)
        if unknown:
            raise ModelError(f"scheduler options {unknown} are not taken by this runtime's Scheduler "
                             f"(it takes {sorted(k for k in takes if k not in ('self', 'model'))})")
        return Scheduler(model, max_batch, **{"stall_budget": STALL_BUDGET, **options})

    def admit(self, name: str, count: int) -> None:
        """Reserve `count` choices of `name`'s scheduler: a 429 (with Retry-After) when
        they would wait beyond max_queue others for a batch row."""
        with self._admit_lock:
            if self.max_queue is None:
                self._admitted[name] += count
                return
            if self._admitted[name] + count > self.schedulers[name].max_batch + self.max_queue:
                waiting = max(self._admitted[name] - self.schedulers[name].max_batch, 0)
                raise ApiError(429, f"'{name}' has {waiting} requests waiting for a batch row, this server's "
                               f"limit (rlx serve --max-queue {self.max_queue}); retry later",
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
            self._admitted[name] += count

    def release(self, name: str, count: int = 1) -> None:
        """`count` admitted choices of `name` finished."""
        with self._admit_lock:
            self._admitted[name] -= count

    def warm(self) -> None:
        """Build every model's executables before /health says ready: a causal model runs one
        greedy request of two tokens (its prefill and decode graphs) and builds its mixed
        graphs (Scheduler.warm_mixed: none then builds while streams wait), an encoder embeds
        once."""
        from ..runtime.model import CausalLM

        for name, m in self.models.items():
            if name in self.schedulers:
                params = SamplingParams.checked(max_new_tokens=2, ignore_eos=True)
                self.schedulers[name].submit([0], params).result()
                if name not in self.groups:             # (a group's ranks build their own graphs)
                    t0 = time.perf_counter()
                    built = self.schedulers[name].warm_mixed()
                    if built:
                        log.info("'%s': %d mixed graphs built in %.1f s", name, built,
                                 time.perf_counter() - t0)
            elif name in self.groups:
                self.groups[name].embed([[0, 0]])
            elif embeds_images(m):
                import numpy as np

                size = int(getattr(m, "image_size", None) or 224)
                m.embed(images=[np.full((size, size, 3), 128, np.uint8)])
            elif not isinstance(m, CausalLM):
                m.embed(["warm"] if getattr(m, "tokenizer", None) is not None else [[0, 0]])

    def get(self, name, kind: str):
        if not isinstance(name, str) or not name:
            raise P.bad("'model' must be the name of a served model", "model")
        if name not in self.models:
            raise ApiError(404, f"The model '{name}' does not exist; served: {sorted(self.models)}",
                           "model", "model_not_found")
        if kind == "causal" and name not in self.schedulers:
            raise P.bad(f"'{name}' is an embedding model; it does not generate text", "model")
        if kind == "encoder" and name in self.schedulers:
            raise P.bad(f"'{name}' generates text; embeddings come from an encoder model", "model")
        return self.models[name]

    def public(self, message: str) -> str:
        """`message` fit for a client: a model's source (a path on this server) becomes the
        name it is served as; any other absolute path is hidden."""
        for name, m in self.models.items():
            src = str(getattr(m, "source", "") or "")
            if os.path.isabs(src):
                message = message.replace(src, name)
        return _ABS_PATH.sub("<path>", message)

    def bad(self, e: Exception, param: str | None = None) -> ApiError:
        """The 400 of an RlxError a request caused, with no server path in it."""
        return P.bad(self.public(str(e)), param)

    def close(self) -> None:
        """Stop the schedulers, then the tensor-parallel groups' rank processes."""
        for s in self.schedulers.values():
            s.close()
        for g in self.groups.values():
            g.close()


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body ({size} bytes) is over this server's limit of {limit} bytes "
                    f"(rlx serve --max-body-mb)", code="request_too_large")


def declared_length(request: Request, limit: int) -> int | None:
    """The Content-Length, if given: a 413 at once when over `limit` (nothing is read)."""
    v = request.headers.get("content-length")
    if v is None:
        return None
    if not (v.isascii() and v.strip().isdigit()):
        raise P.bad(f"Content-Length must be a whole number of bytes, got {v[:40]!r}")
    if int(v) > limit:
        raise too_large(int(v), limit)
    return int(v)


async def read_body(request: Request, limit: int, idle_s: float) -> bytes:
    """The body in chunks, at most `limit` bytes: a 413 as soon as Content-Length or the
    bytes read pass it (the rest is never read), a 400 when it ends short of its
    Content-Length or stops arriving for `idle_s` seconds; ClientGone when the client left."""
    declared = declared_length(request, limit)
    chunks, size, more = [], 0, True
    while more:
        try:
            msg = await asyncio.wait_for(request.receive(), idle_s)
        except asyncio.TimeoutError:
            of = f" of the {declared} its Content-Length says" if declared is not None else ""
            raise P.bad(f"the request body stopped arriving: {size} bytes{of} came, then nothing "
                        f"for {idle_s:g} s") from None
        if msg["type"] == "http.disconnect":
            raise ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
        more = msg.get("more_body", False)
    if declared is not None and size != declared:
        raise P.bad(f"the request body has {size} bytes; its Content-Length says {declared}")
    return b"".join(chunks)


async def _body(request: Request, endpoint: str) -> dict:
    """The request's JSON object, read within the limits and parsed off the event loop;
    its keys checked for `endpoint` (protocol.KEYS)."""
    served: Served = request.app.state.served
    raw = await read_body(request, served.max_body, served.body_idle_s)
    if len(raw) >= BIG_BODY:
        request.state.big = True
    body = await run_in_threadpool(P.parse_body, raw)
    P.check_keys(body, endpoint)
    return body


def _releasing(handler):
    """handler, then (after a big request) the freed heap given back to the OS."""
    async def endpoint(request: Request):
        try:
            return await handler(request)
        finally:
            if getattr(request.state, "big", False):
                await run_in_threadpool(trim_heap)
    endpoint.__name__ = handler.__name__
    return endpoint


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()


def surely_too_long(model, text: str, param: str) -> None:
    """A 400 when `text` has surely more tokens than the model's context: prefixes of it,
    each twice as long as the last, are tokenized until one has over twice the context (or
    the text is reached). A tokenizer holds the GIL, so a multi-MB prompt tokenized whole
    stalls every request for seconds, thread pool or not; this costs about what tokenizing a
    prompt of twice the context does."""
    n, context = 4 * model.max_positions, model.max_positions
    while n < len(text):
        count = len(model.encode_prompt(text[:n]))
        if count > 2 * context:
            raise P.bad(f"This model's maximum context length is {context} tokens; the first {n} of the "
                        f"{len(text)} characters of the {param} already have {count}", param)
        n *= 2


class Choices:
    """One chat or completions request's choices in the scheduler (n for each prompt, choice
    i*n+j being prompt i's j-th): their requests, text, logprobs and finish reasons as events
    come; an echoed prompt starts its choices' text (and logprobs, the first None)."""

    def __init__(self, served: Served, name, body: dict, chat: bool, opts: P.Options,
                 timing: Timing | None = None):
        self.served, self.name, self.body, self.chat, self.opts = served, name, body, chat, opts
        self.model = served.get(name, "causal")
        self.timing = timing             # the request's token clock (metrics), if any
        self.deadline: float | None = None   # (time.monotonic) when the request times out
        self.reqs: list = []             # a scheduler Request per prompt (its `choices`: n)
        self.choices: list = []          # every choice's Request, by index
        self.texts: dict = {}
        self.logprobs: dict = {}
        self.reasons: dict = {}
        self.prompts: dict = {}          # index -> the prompt's text its choice echoes
        self.style = ""                  # the chat template's tool-call syntax, when tools are offered
        self._pieces: dict = {}

    def piece(self, token: int) -> str:
        """The text of one token (special tokens shown), for logprobs."""
        if token not in self._pieces:
            self._pieces[token] = self.model.tokenizer.decode([token], skip_special_tokens=False)
        return self._pieces[token]

    def _encode(self, p, param: str) -> list:
        model, chat = self.model, isinstance(p, list) and p and isinstance(p[0], dict)
        if chat or isinstance(p, str):
            surely_too_long(model, "\n".join(m["content"] for m in p) if chat else p, param)
        if chat and self.opts.tools is not None:
            tok = model._tokenizer()
            return tok.encode(tok.apply_chat_template(p, tools=self.opts.tools), add_special_tokens=False)
        return model.encode_chat(p) if chat else (model.encode_prompt(p) if isinstance(p, str) else p)

    def _constraint(self):
        """The structured output's or the forced tool call's ConstraintFactory (compiled once)."""
        opts, tok = self.opts, self.model.tokenizer
        if opts.grammar is not None:
            from ..runtime.grammar import constraint_factory

            try:
                return constraint_factory(tok, vocab_size=self.model.vocab_size, **opts.grammar[1])
            except RlxError as e:
                raise self.served.bad(e, opts.grammar[0]) from None
        if opts.tools is not None and opts.tool_choice != "auto":
            from ..runtime.tools import tool_constraint

            try:
                return tool_constraint(tok, opts.tools, opts.tool_choice, self.style, self.model.vocab_size)
            except RlxError as e:
                raise self.served.bad(e, "tool_choice") from None
        return None

    def _check_group(self) -> None:
        """A 400 naming what a tensor-parallel group's rounds do not carry yet (its ranks get
        each request's parameters as JSON and send back tokens and text only)."""
        if self.name not in self.served.groups:
            return
        opts = self.opts
        for param, asked in (("n", opts.n > 1), ("logprobs", opts.logprobs is not None),
                             (opts.grammar[0] if opts.grammar else "", opts.grammar is not None),
                             ("tool_choice", opts.tools is not None and opts.tool_choice != "auto")):
            if asked:
                raise P.bad(f"'{param}' is not available for '{self.name}', which is served tensor-parallel",
                            param)

    def submit(self, prompts: list, loop, queue) -> None:
        """Tokenize and check every prompt, then submit each as one request of n choices (all
        checked before any is submitted); off the event loop."""
        model, opts, body = self.model, self.opts, self.body
        param = "messages" if "messages" in body else "prompt"
        if model.tokenizer is None and (opts.grammar is not None or opts.tools is not None):
            raise P.bad(f"'{self.name}' has no tokenizer: its output cannot be constrained or parsed",
                        opts.grammar[0] if opts.grammar else "tools")
        if opts.tools is not None:
            from ..runtime.tools import STYLES, tool_prompt_style

            style = tool_prompt_style(model.tokenizer)
            if style is None:
                raise P.bad(f"'{self.name}': its chat template offers no tools in a tool-call syntax known here "
                            f"({', '.join(STYLES)})", "tools")
            self.style = style
        jobs = []
        for p in prompts:
            try:
                ids = self._encode(p, param)
            except RlxError as e:
                raise self.served.bad(e, param) from None
            max_new = P.max_new_tokens(body, opts.n, len(ids), model.max_positions,
                                       self.served.default_max_tokens if self.chat else 16)
            jobs.append((p, ids, max_new))
        self._check_group()
        constraint = self._constraint()
        try:
            params = SamplingParams.checked(**opts.sampling, n=opts.n, constraint=constraint,
                                            max_new_tokens=max(m for _, _, m in jobs))
        except RlxError as e:
            raise self.served.bad(e) from None
        served, sched = self.served, self.served.schedulers[self.name]
        if opts.n > sched.max_batch:
            raise P.bad(f"'n' ({opts.n}) is more than this server's batch of {sched.max_batch} (rlx serve "
                        "--max-batch)", "n")
        served.admit(self.name, opts.n * len(jobs))
        for i, (p, ids, max_new) in enumerate(jobs):
            if opts.echo:
                for j in range(opts.n):
                    self.prompts[i * opts.n + j] = p if isinstance(p, str) else model.tokenizer.decode(ids)

            def cb(ev, i=i):             # (the scheduler thread's; a finished choice frees its admission)
                if ev.finish_reason is not None:
                    served.release(self.name)
                loop.call_soon_threadsafe(queue.put_nowait, (i * opts.n + ev.index, ev))
            try:
                self.reqs.append(sched.submit(ids, replace(params, max_new_tokens=max_new), on_event=cb))
            except RlxError as e:
                served.release(self.name, opts.n * (len(jobs) - i))
                self.cancel()
                raise self.served.bad(e) from None
        self.choices = [c for r in self.reqs for c in r.choices]

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()

    def take(self, index: int, ev) -> tuple:
        """Record an event: (its text, its tokens' logprobs or None)."""
        text, lps = ev.text, None
        if self.timing is not None:
            self.timing.tokens(index, len(ev.token_ids))
        if self.opts.logprobs is not None:
            lps = list(ev.logprobs)
            if index in self.prompts and index not in self.logprobs:       # the echo comes first
                lps = prompt_logprobs(self.choices[index]) + lps
        if index in self.prompts and index not in self.texts:
            text = self.prompts[index] + text
        self.texts[index] = self.texts.get(index, "") + text
        if lps is not None:
            self.logprobs.setdefault(index, []).extend(lps)
        if ev.finish_reason is not None:
            if ev.error is not None:
                raise ApiError(500, self.served.public(f"generation failed: {ev.error}"))
            self.reasons[index] = ev.finish_reason
        return text, lps

    def choice(self, index: int) -> P.Choice:
        text, calls = self.texts.get(index, ""), None
        if self.opts.tools is not None:
            from ..runtime.tools import parse_tool_calls

            content, calls = parse_tool_calls(text, self.style)
            calls = calls[:1] if calls and not self.opts.parallel_tool_calls else calls
            text = content or "" if calls else text
        return P.Choice(index, text, P.finish_reason(self.reasons[index], bool(calls)),
                        self.logprobs.get(index) if self.opts.logprobs is not None else None, calls)

    def usage(self) -> dict:
        """The prompts' tokens (each prefilled once) and every choice's new tokens."""
        return P.usage(sum(len(r.prompt_ids) for r in self.reqs), sum(c.n_new for c in self.choices))


def prompt_logprobs(choice) -> list:
    """The echoed prompt's logprobs (the runtime's: None for the first token, then a
    TokenLogprob each), the first as an entry whose logprob is None."""
    return [lp if lp is not None else _NoLogprob(tok)
            for tok, lp in zip(choice.prompt_ids, choice.prompt_logprobs or ())]


class _NoLogprob:
    """A prompt's first token: no logprob (nothing before it)."""
    logprob = None
    top = ()

    def __init__(self, token: int):
        self.token = token


async def _watch(request: Request, queue: asyncio.Queue) -> None:
    """Put None in `queue` when the client disconnects (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(None)


def timed_out(seconds: float) -> ApiError:
    return ApiError(504, f"the request ran longer than this server's limit of {seconds:g} s (rlx serve "
                    "--request-timeout); it was cancelled", code="request_timeout")


async def _next(queue: asyncio.Queue, gen: Choices):
    """The next item of `queue`; timed_out's ApiError when the request's deadline passes first."""
    if gen.deadline is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), max(gen.deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        raise timed_out(float(gen.served.request_timeout or 0.0)) from None


async def _collect(request: Request, gen: Choices, queue: asyncio.Queue) -> None:
    """Wait until every choice finished; when the client leaves first, they are cancelled
    (they stop decoding) and ClientGone raised; past the request timeout, a 504."""
    watch = asyncio.ensure_future(_watch(request, queue))
    left = len(gen.choices)
    try:
        while left:
            item = await _next(queue, gen)
            if item is None:
                raise ClientGone
            gen.take(*item)
            left -= item[1].finish_reason is not None
    finally:
        watch.cancel()
        gen.cancel()


async def _generate(request: Request, chat: bool):
    served: Served = request.app.state.served
    ops: Ops = request.app.state.ops
    arrived = time.monotonic()
    body = await _body(request, "chat" if chat else "completions")
    name = body.get("model")
    model = served.get(name, "causal")
    prompts = [P.chat_messages(body)] if chat else P.completion_prompts(body)
    opts = P.options(body, chat, model.vocab_size)
    gen = Choices(served, name, body, chat, opts, Timing(ops.metrics, str(name), arrived))
    gen.deadline = None if served.request_timeout is None else arrived + served.request_timeout
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    await run_in_threadpool(gen.submit, prompts, loop, queue)         # tokenizing, compiling grammars
    ops.live.add(gen)                    # (cancelled when a shutdown's grace ends)
    ops.metrics.prompt_tokens.labels(name).inc(sum(len(r.prompt_ids) for r in gen.reqs))
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if opts.stream:
        return StreamingResponse(_stream(gen, rid, queue, ops.live), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await _collect(request, gen, queue)
    finally:
        ops.live.discard(gen)
    choices = [gen.choice(i) for i in range(len(gen.choices))]
    return JSONResponse(await run_in_threadpool(P.completion_body, rid, name, choices, gen.usage(), chat,
                                                gen.piece))


def _chunk_logprobs(gen: Choices, index: int, lps: list | None, offsets: dict):
    """A streamed chunk's logprobs in the endpoint's shape (completions: text offsets in the
    choice's text so far, from where the last chunk's ended)."""
    if lps is None:
        return None
    if gen.chat:
        return P.chat_logprobs(lps, gen.piece)
    out, offsets[index] = P.completion_logprobs(lps, gen.piece, gen.texts.get(index, ""), offsets.get(index, 0))
    return out


async def _stream(gen: Choices, rid: str, queue: asyncio.Queue, live=None):
    created, chat, name = int(time.time()), gen.chat, gen.name
    offsets: dict = {}
    parsers = {}
    if gen.opts.tools is not None:
        from ..runtime.tools import ToolCallStream

        parsers = {i: ToolCallStream(gen.style) for i in range(len(gen.choices))}
    try:
        if chat:
            for i in range(len(gen.choices)):
                yield sse(P.chunk_body(rid, name, i, None, None, True, role=True, created=created))
        left = len(gen.choices)
        while left:
            try:
                index, ev = await _next(queue, gen)
            except ApiError as e:            # the request timeout: an error event, then the end
                yield sse(e.body())
                yield sse("[DONE]")
                return
            try:
                text, lps = gen.take(index, ev)
            except ApiError as e:
                yield sse(e.body())
                return
            calls = None
            if index in parsers:
                text, calls = parsers[index].feed(text)
                if ev.finish_reason is not None:
                    more, last = parsers[index].finish()
                    text, calls = text + more, calls + last
                if not gen.opts.parallel_tool_calls:
                    calls = [c for c in calls if c["index"] == 0]
            if text or lps or calls:
                yield sse(P.chunk_body(rid, name, index, text, None, chat, created=created,
                                       logprobs=_chunk_logprobs(gen, index, lps, offsets), tool_calls=calls))
            if ev.finish_reason is not None:
                left -= 1
                called = index in parsers and bool(parsers[index].calls)
                yield sse(P.chunk_body(rid, name, index, None, P.finish_reason(ev.finish_reason, called), chat,
                                       created=created))
        if gen.opts.include_usage:
            yield sse(P.chunk_body(rid, name, 0, None, None, chat, use=gen.usage(), created=created))
        yield sse("[DONE]")
    finally:                        # a client gone mid-stream: its requests stop generating
        gen.cancel()
        if live is not None:
            live.discard(gen)


@_releasing
async def completions(request: Request):
    return await _generate(request, chat=False)


@_releasing
async def chat_completions(request: Request):
    return await _generate(request, chat=True)


@_releasing
async def embeddings(request: Request):
    served: Served = request.app.state.served
    body = await _body(request, "embeddings")
    name = body.get("model")
    enc = served.get(name, "encoder")
    if embeds_images(enc):
        return await _embed_images_or_texts(served, name, enc, body)
    if "messages" in body:
        raise P.bad(f"'{name}' embeds texts: give them in 'input' ('messages' carries images, for models "
                    "that embed them)", "messages")
    inputs = P.embedding_inputs(body)
    fmt = P.embedding_format(body)

    def run():
        if name in served.groups:        # embedded by the tensor-parallel ranks
            return served.groups[name].embed(inputs)
        with enc._lock:                  # (last_timings of this call, not another thread's)
            out = enc.embed(inputs)
            return out, int(enc.last_timings.get("tokens", 0))

    try:
        out, tokens = await run_in_threadpool(run)
    except RlxError as e:
        raise served.bad(e, "input") from None
    return await run_in_threadpool(_embeddings_response, name, out, len(inputs), fmt, tokens)


async def _embed_images_or_texts(served: Served, name, model, body: dict):
    """/v1/embeddings on a model that embeds images (runtime.encoder.embeds_images): images as
    base64 data URLs decoded here to their encoded bytes, which the model's own preprocessing
    reads; texts when it has a text tower. L2-normalized, as the text encoders' rows are. No
    tokens are counted for images (usage 0)."""
    kind, items, param = await run_in_threadpool(
        P.vision_embedding_inputs, body, bool(getattr(model, "embeds_texts", False)))
    fmt = P.embedding_format(body)
    try:
        out = await run_in_threadpool(lambda: model.embed(**{kind: items}, normalize=True))
    except RlxError as e:
        raise served.bad(e, param) from None
    return await run_in_threadpool(_embeddings_response, name, out, len(items), fmt, 0)


def _embeddings_response(name, out, n: int, fmt: str, tokens: int) -> JSONResponse:
    data = [{"object": "embedding", "index": i, "embedding": P.embedding_value(row, fmt)}
            for i, row in enumerate(out.reshape(n, -1))]
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def list_models(request: Request):
    served: Served = request.app.state.served
    return JSONResponse({"object": "list", "data": [
        {"id": n, "object": "model", "created": served.created, "owned_by": "rlx"} for n in served.models]})


@_releasing
async def tokenize(request: Request):
    """vLLM's POST /tokenize: {"model", "prompt" | "messages"} -> {"tokens", "count", "max_model_len"}."""
    served: Served = request.app.state.served
    body = await _body(request, "tokenize")
    name = body.get("model")
    model = served.get(name, "any")
    kind, value, add_special = P.tokenize_input(body)
    tok = _tokenizer_of(name, model, "messages" if kind == "messages" else "prompt")

    def encode():
        if kind == "prompt":
            return tok.encode(value, add_special_tokens=add_special)
        if not hasattr(model, "encode_chat"):
            raise P.bad(f"'{name}' is not a chat model: give 'prompt'", "messages")
        return model.encode_chat(value)

    try:
        ids = await run_in_threadpool(encode)
    except RlxError as e:
        raise served.bad(e, kind) from None
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": _context(model)})


@_releasing
async def detokenize(request: Request):
    """vLLM's POST /detokenize: {"model", "tokens"} -> {"prompt"}."""
    served: Served = request.app.state.served
    body = await _body(request, "detokenize")
    name = body.get("model")
    model = served.get(name, "any")
    tok = _tokenizer_of(name, model, "tokens")
    ids = P.detokenize_ids(body, getattr(model, "vocab_size", None) or _vocab(tok))
    return JSONResponse({"prompt": await run_in_threadpool(tok.decode, ids)})


def _tokenizer_of(name, model, param: str):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise P.bad(f"'{name}' has no tokenizer", param)
    return tok


def _vocab(tok) -> int | None:
    size = getattr(getattr(tok, "backend", None), "get_vocab_size", None)
    return int(size()) if callable(size) else None


def _context(model) -> int | None:
    n = getattr(model, "max_positions", None)
    return int(n) if n is not None else None


async def step_log(request: Request):
    """GET /debug/steps?model=NAME&since=T: a causal model's last runs (Scheduler.step_log:
    each decode step, mixed step and prefill piece with its end on the shared monotonic
    clock, its seconds, rows and piece tokens, and whether its runner was specialized for
    it), those ended after `since`; `model` may be left out where one causal model is
    served. For benchmarks: which of the streams' gaps were long, and why."""
    served: Served = request.app.state.served
    q = request.query_params
    name = q.get("model")
    if name is None and len(served.schedulers) == 1:
        name = next(iter(served.schedulers))
    served.get(name, "causal")
    try:
        since = float(q.get("since", "0"))
    except ValueError:
        raise P.bad(f"'since' must be a number of seconds (time.monotonic()), got {q.get('since')!r}",
                    "since") from None
    records = served.schedulers[name].step_log(since)
    return JSONResponse({"model": name, "clock": "monotonic",
                         "steps": [asdict(r) for r in records]})


async def health(request: Request):
    """200 {"status": "ok"} once every model is warm; 503 while loading, after a failed
    warm-up (with its error) and while shutting down."""
    ops: Ops = request.app.state.ops
    if ops.status == "ok":
        return JSONResponse({"status": "ok"})
    body = {"status": ops.status, **({"error": ops.error} if ops.error else {})}
    return JSONResponse(body, status_code=503)


async def metrics(request: Request):
    """Prometheus text (rlx_core.serve.ops.Metrics), through ops.metrics_merge when set."""
    ops: Ops = request.app.state.ops
    text = await run_in_threadpool(ops.metrics.text)
    if ops.metrics_merge is not None:
        text = await ops.metrics_merge(text)
    return Response(text, media_type=METRICS_TYPE)


async def _warm(served: Served, ops: Ops) -> None:
    try:
        await run_in_threadpool(served.warm)
    except Exception as e:               # noqa: BLE001  (reported by /health; the server stays up)
        ops.status, ops.error = "failed", served.public(f"warming the models failed: {type(e).__name__}: {e}")
        log.error("%s", ops.error)
        return
    if ops.status == "loading":
        ops.status = "ok"


async def _api_error(request, exc: ApiError):
    return error_response(exc)


async def _http_error(request, exc):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                   f"{exc.detail}", code=code))


async def _client_gone(request, exc):
    return error_response(ApiError(400, "the client disconnected"))       # (read by no one)


async def _server_error(request, exc):
    return error_response(ApiError(500, request.app.state.served.public(f"{type(exc).__name__}: {exc}")))


def create_app(models: dict, max_batch: int = 8, default_max_tokens: int | None = None,
               groups: dict | None = None, max_body_mb: float = MAX_BODY_MB,
               body_idle_s: float = BODY_IDLE_S, max_queue: int | None = None,
               request_timeout: float | None = None, scheduler_options: dict | None = None,
               api_key: str | None = None, cors_origins=(), metrics_merge=None,
               warm: bool = True) -> Starlette:
    """The app serving `models` (name -> CausalLM or Encoder; `groups`, `max_body_mb`,
    `body_idle_s`, `max_queue`, `request_timeout`, `scheduler_options`: see Served);
    `api_key`: the bearer key /v1/*, /tokenize, /detokenize and /metrics need (ops.PROTECTED);
    `cors_origins`: origins a browser may call it from; `metrics_merge`: see ops.Ops. When
    the app starts (its lifespan) its models warm off the event loop (`warm`; /health says
    "loading" until then); its schedulers close when it shuts down (or call
    app.state.served.close())."""
    from contextlib import asynccontextmanager

    from starlette.exceptions import HTTPException

    served = Served(models, max_batch, default_max_tokens, groups, max_body_mb, body_idle_s, max_queue,
                    request_timeout, scheduler_options)

    @asynccontextmanager
    async def lifespan(app):
        warming = asyncio.ensure_future(_warm(served, ops)) if warm else None
        if warming is None:
            ops.status = "ok"
        try:
            yield
        finally:
            if warming is not None:
                warming.cancel()
            served.close()

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/debug/steps", step_log, methods=["GET"]),
        *page_routes(),
    ]
    ops = Ops(served, api_key, metrics_merge, [r.path for r in routes])
    middleware = [Middleware(Gate, ops=ops)]
    if cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                        allow_methods=["GET", "POST", "OPTIONS"],
                                        allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={ApiError: _api_error, ClientGone: _client_gone,
                                        HTTPException: _http_error, Exception: _server_error},
                    lifespan=lifespan)
    app.state.served, app.state.ops = served, ops
    return app


__all__ = ["create_app", "Served", "read_body", "MAX_BODY_MB", "BODY_IDLE_S", "error_response"]
