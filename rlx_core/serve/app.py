"""The OpenAI-compatible ASGI app (Starlette): GET /v1/models, POST /v1/completions,
/v1/chat/completions (through each causal model's Scheduler, so concurrent requests share
its decode batch; streamed as server-sent events) and /v1/embeddings (encoder models)."""
from __future__ import annotations

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..ir.errors import RlxError
from ..runtime.scheduler import Scheduler
from . import protocol as P
from .protocol import ApiError


class Served:
    """The models of one server by name: causal LMs with their schedulers, and encoders.
    `groups` (name -> rlx_core.runtime.tp.TensorParallel): those models run on the group's
    rank processes (the model given here serves its tokenizer and config); `close` stops them."""

    def __init__(self, models: dict, max_batch: int = 8, default_max_tokens: int | None = None,
                 groups: dict | None = None):
        from ..runtime.model import CausalLM
        from ..runtime.tp import GroupScheduler

        self.models, self.created = dict(models), int(time.time())
        self.groups = groups = dict(groups or {})
        self.schedulers = {n: GroupScheduler(groups[n], m, max_batch) if n in groups
                           else Scheduler(m, max_batch)
                           for n, m in self.models.items() if isinstance(m, CausalLM)}
        self.default_max_tokens = default_max_tokens

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

    def close(self) -> None:
        """Stop the schedulers, then the tensor-parallel groups' rank processes."""
        for s in self.schedulers.values():
            s.close()
        for g in self.groups.values():
            g.close()


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise P.bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise P.bad("the request body must be a JSON object")
    return body


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()


def _submit_all(served: Served, name: str, prompts: list, body: dict, loop, queue) -> list:
    """Tokenize, check and submit every prompt (all checked before any is submitted)."""
    model, sched = served.get(name, "causal"), served.schedulers[name]
    jobs = []
    for p in prompts:
        try:
            ids = model.encode_chat(p) if isinstance(p, list) and p and isinstance(p[0], dict) else (
                model.encode_prompt(p) if isinstance(p, str) else p)
        except RlxError as e:
            raise P.bad(str(e), "prompt") from None
        params = P.sampling(body, len(ids), model.max_positions, served.default_max_tokens
                            if "messages" in body else 16)
        jobs.append((ids, params))
    reqs = []
    for i, (ids, params) in enumerate(jobs):
        cb = (lambda ev, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, ev)))
        try:
            reqs.append(sched.submit(ids, params, on_event=cb))
        except RlxError as e:
            for r in reqs:
                r.cancel()
            raise P.bad(str(e)) from None
    return reqs


async def _generate(request: Request, chat: bool):
    served: Served = request.app.state.served
    body = await _body(request)
    name = body.get("model")
    served.get(name, "causal")
    prompts = [P.chat_messages(body)] if chat else P.completion_prompts(body)
    stream, include_usage = P.stream_flags(body)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    reqs = _submit_all(served, name, prompts, body, loop, queue)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if stream:
        return StreamingResponse(_stream(rid, name, reqs, queue, chat, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        texts, reasons, left = {}, {}, len(reqs)
        while left:
            i, ev = await queue.get()
            texts[i] = texts.get(i, "") + ev.text
            if ev.finish_reason is not None:
                if ev.error is not None:
                    raise ApiError(500, f"generation failed: {ev.error}")
                reasons[i] = P.finish_reason(ev.finish_reason)
                left -= 1
    finally:
        for r in reqs:
            r.cancel()
    use = P.usage(sum(len(r.prompt_ids) for r in reqs), sum(r.n_new for r in reqs))
    choices = [(i, texts.get(i, ""), reasons[i]) for i in range(len(reqs))]
    return JSONResponse(P.completion_body(rid, name, choices, use, chat))


async def _stream(rid, name, reqs, queue, chat, include_usage):
    created = int(time.time())
    try:
        if chat:
            for i in range(len(reqs)):
                yield sse(P.chunk_body(rid, name, i, None, None, True, role=True, created=created))
        left = len(reqs)
        while left:
            i, ev = await queue.get()
            if ev.finish_reason is not None and ev.error is not None:
                yield sse(ApiError(500, f"generation failed: {ev.error}").body())
                return
            if ev.text:
                yield sse(P.chunk_body(rid, name, i, ev.text, None, chat, created=created))
            if ev.finish_reason is not None:
                left -= 1
                yield sse(P.chunk_body(rid, name, i, None, P.finish_reason(ev.finish_reason), chat,
                                       created=created))
        if include_usage:
            use = P.usage(sum(len(r.prompt_ids) for r in reqs), sum(r.n_new for r in reqs))
            yield sse(P.chunk_body(rid, name, 0, None, None, chat, use=use, created=created))
        yield sse("[DONE]")
    finally:                        # a client gone mid-stream: its requests stop generating
        for r in reqs:
            r.cancel()


async def completions(request: Request):
    return await _generate(request, chat=False)


async def chat_completions(request: Request):
    return await _generate(request, chat=True)


async def embeddings(request: Request):
    served: Served = request.app.state.served
    body = await _body(request)
    name = body.get("model")
    enc = served.get(name, "encoder")
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
        raise P.bad(str(e), "input") from None
    data = [{"object": "embedding", "index": i, "embedding": P.embedding_value(row, fmt)}
            for i, row in enumerate(out.reshape(len(inputs), -1))]
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def list_models(request: Request):
    served: Served = request.app.state.served
    return JSONResponse({"object": "list", "data": [
        {"id": n, "object": "model", "created": served.created, "owned_by": "rlx"} for n in served.models]})


async def _api_error(request, exc: ApiError):
    return error_response(exc)


async def _http_error(request, exc):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                   f"{exc.detail}", code=code))


async def _server_error(request, exc):
    return error_response(ApiError(500, f"{type(exc).__name__}: {exc}"))


def create_app(models: dict, max_batch: int = 8, default_max_tokens: int | None = None,
               groups: dict | None = None) -> Starlette:
    """The app serving `models` (name -> CausalLM or Encoder; `groups`: see Served); its
    schedulers close when the app shuts down (or call app.state.served.close())."""
    from contextlib import asynccontextmanager

    from starlette.exceptions import HTTPException

    served = Served(models, max_batch, default_max_tokens, groups)

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            served.close()

    app = Starlette(routes=[
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ], exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan)
    app.state.served = served
    return app


__all__ = ["create_app", "Served"]
