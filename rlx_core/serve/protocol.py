"""OpenAI's HTTP API as plain Python: checking request bodies into scheduler arguments and
shaping responses, chunks and errors. No web framework here (rlx_core.serve.app has it), so
it is tested and imported without the `serve` extra."""
from __future__ import annotations

import base64
import json
import math
import time
import uuid

import numpy as np

from ..ir.errors import RlxError
from ..runtime.scheduler import SamplingParams
from ..weights.safetensors_io import json_depth


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
              dict: "an object"}


def field(body: dict, name: str, kinds: tuple, default=None, lo=None, hi=None):
    """body[name] checked: one of `kinds` (bool is not a number), in [lo, hi]."""
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if ok and isinstance(v, (int, float)) and not isinstance(v, bool):
        ok = math.isfinite(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        want = "a number" if float in kinds else " or ".join(KIND_NAMES[k] for k in kinds)
        rng = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (
            f" >= {lo}" if lo is not None else "")
        raise bad(f"'{name}' must be {want}{rng}, got {v!r}"[:300], name)
    return v


MAX_JSON_DEPTH = 64          # nesting of arrays and objects in a request body


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object: valid UTF-8, nested at most MAX_JSON_DEPTH deep,
    every string valid Unicode (no lone surrogate escapes); else a 400 saying which."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise bad(f"the request body nests arrays/objects {depth} deep; at most {MAX_JSON_DEPTH} "
                  "are allowed")
    try:
        body = json.loads(text)
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}"[:300]) from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_text(body)
    return body


def check_text(value, where: str = "the body", param: str | None = None) -> None:
    """A 400 naming the field (e.g. messages[0].content) of the first string in `value`
    that is not valid Unicode (a lone surrogate, which JSON's \\u escapes allow)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"{where} is not valid Unicode text: a lone surrogate {value[e.start]!r} at "
                          f"character {e.start}", param) from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]", param)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, f"a key of {where}", param)
            check_text(v, k if param is None else f"{where}.{k}", param or k)


UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None,), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"})}
NOT_YET = ("min_p", "typical_p", "repetition_penalty", "grammar", "guided_json")   # a later issue's
_GENERATE = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
             "stream_options", "user", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty"}
KEYS = {"chat": _GENERATE | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                             "response_format"},
        "completions": _GENERATE | {"prompt", "echo", "best_of", "suffix"},
        "embeddings": {"model", "input", "messages", "encoding_format", "dimensions", "user"}}


def check_keys(body: dict, endpoint: str) -> None:
    """A 400 naming the first key that `endpoint` (a KEYS name) does not take: a sampler
    knob this server does not have yet, or a key it does not know (never silently ignored)."""
    for k in body:
        if k in NOT_YET:
            raise bad(f"'{k}' is not supported by this server yet", k)
        if k not in KEYS[endpoint]:
            raise bad(f"unknown field {k[:100]!r}; this endpoint takes {sorted(KEYS[endpoint])}", k[:100])


def sampling(body: dict, prompt_tokens: int, context: int, default_max: int | None) -> SamplingParams:
    """SamplingParams from a completions or chat body; a 400 naming the field when bad, and
    when the prompt and max_tokens do not fit the model's context."""
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise bad(f"'{name}' is not supported by this server", name)
    if field(body, "n", (int,), 1, lo=1) != 1:
        raise bad("only n=1 is supported", "n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = field(body, name, (int,), None, lo=1)
    room = context - prompt_tokens
    if prompt_tokens > context or room < 1:
        raise bad(f"This model's maximum context length is {context} tokens; the prompt has "
                  f"{prompt_tokens} tokens, leaving no room for a completion", "messages"
                  if "messages" in body else "prompt")
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif prompt_tokens + max_tokens > context:
        raise bad(f"This model's maximum context length is {context} tokens; you requested "
                  f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} "
                  f"for the completion)", name)
    temperature = field(body, "temperature", (int, float), 1.0, lo=0, hi=2)
    top_p = field(body, "top_p", (int, float), 1.0, lo=0, hi=1)
    if top_p == 0:
        raise bad("'top_p' must be > 0", "top_p")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    seed = field(body, "seed", (int,), None, lo=0, hi=2**63 - 1)        # as the runtime: >= 0
    top_k = field(body, "top_k", (int,), None, lo=0)                    # 0 or none: no top-k
    try:
        return SamplingParams.checked(max_tokens=max_tokens, do_sample=temperature > 0,
                                      temperature=temperature if temperature > 0 else 1.0,
                                      top_k=top_k or None, top_p=top_p, seed=seed, stop=stop)
    except RlxError as e:
        raise bad(str(e)) from None


def stream_flags(body: dict) -> tuple:
    """(stream, include_usage)."""
    stream = field(body, "stream", (bool,), False)
    opts = field(body, "stream_options", (dict,), None)
    if opts is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    usage = bool(field(opts or {}, "include_usage", (bool,), False))
    return stream, usage


def message_text(m, i: int) -> dict:
    """One chat message as {"role", "content": str} (content parts of type text joined)."""
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise bad(f"messages[{i}].role must be system, user or assistant, got {role!r}", "messages")
    c = m.get("content")
    if isinstance(c, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in c):
            raise bad(f"messages[{i}].content: only text parts are supported", "messages")
        c = "".join(p["text"] for p in c)
    if c is None and role == "assistant":
        c = ""
    if not isinstance(c, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": "system" if role == "developer" else role, "content": c}


def chat_messages(body: dict) -> list:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    return [message_text(m, i) for i, m in enumerate(msgs)]


def _texts_or_ids(body: dict, key: str, what: str) -> list:
    """body[key] as a list of prompts: a string or token ids, or a non-empty array of them."""
    x = body.get(key)

    def ids(v):
        return isinstance(v, list) and v and all(type(t) is int for t in v)
    if isinstance(x, str) or ids(x):
        return [x]
    if isinstance(x, list) and x and all(isinstance(t, str) or ids(t) for t in x):
        return list(x)
    raise bad(f"'{key}' must be {what}", key)


def completion_prompts(body: dict) -> list:
    """The prompts of a completions body: strings or token-id lists (one or several)."""
    return _texts_or_ids(body, "prompt", "a string, an array of strings, or token ids")


def embedding_inputs(body: dict) -> list:
    inputs = _texts_or_ids(body, "input", "a non-empty string, array of strings, or token ids")
    for i, x in enumerate(inputs):
        if isinstance(x, str) and not x:
            raise bad(f"'input[{i}]' is an empty string; every input must be non-empty"
                      if isinstance(body["input"], list) else "'input' must be a non-empty string", "input")
    return inputs


IMAGE_URL = "data:image/"        # an input string that starts so is an image (models that embed images)


def image_bytes(url, where: str, param: str) -> bytes:
    """The encoded image in a base64 data URL 'data:image/<type>;base64,<data>', as vLLM's
    multimodal embeddings take images; a 400 naming `where` otherwise. No other URL is
    fetched: a server that fetches what a client names can be made to reach its own network."""
    if not isinstance(url, str) or not url.startswith(IMAGE_URL):
        got = url[:40] + "..." if isinstance(url, str) and len(url) > 40 else url
        raise bad(f"{where} must be an image as a data URL 'data:image/<type>;base64,<data>' (this server "
                  f"fetches no URL), got {got!r}", param)
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise bad(f"{where}: a data URL of an image must be base64 ('data:image/<type>;base64,<data>')", param)
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:                                  # binascii.Error: bad characters or padding
        raise bad(f"{where}: the data URL's base64 data is malformed", param) from None


def _message_parts(body: dict) -> list:
    """Every content part of a `messages` body (vLLM's chat-style embeddings request) as
    ("text", str) or ("image", data URL)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    parts: list[tuple[str, object]] = []
    for i, m in enumerate(msgs):
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(("text", c))
            continue
        if not isinstance(c, list):
            raise bad(f"messages[{i}].content must be a string or an array of parts", "messages")
        for j, p in enumerate(c):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append(("text", p["text"]))
            elif kind == "image_url":
                url = p.get("image_url")
                parts.append(("image", url.get("url") if isinstance(url, dict) else url))
            else:
                raise bad(f"messages[{i}].content[{j}] must be a text part or an image_url part", "messages")
    return parts


def vision_embedding_inputs(body: dict, embeds_texts: bool) -> tuple:
    """(kind, items, param) of an embeddings request to a model that embeds images: kind
    "images" with encoded images (bytes) or "texts" with strings (a model with a text tower).
    Images come as data URLs, in `input` (a string or an array of them) or as the one
    image_url part of `messages` (vLLM's form); a request holds images or texts, not both (the
    towers embed them apart, as vLLM serves such models)."""
    if ("messages" in body) == ("input" in body):
        raise bad("give 'input' (texts or image data URLs) or 'messages' (one image_url or text part), "
                  "not both or neither", "input")
    if "messages" in body:
        parts = _message_parts(body)
        if len(parts) != 1:
            raise bad(f"'messages' holds {len(parts)} parts; this model embeds one image or one text per "
                      "messages request (send more in 'input')", "messages")
        kind, value = parts[0]
        if kind == "text" and not value:
            raise bad("the text part of 'messages' is empty; it must be non-empty", "messages")
        items, param, where = [value], "messages", ["the image_url part of 'messages'"]
    else:
        items, param = embedding_inputs(body), "input"
        if not all(isinstance(x, str) for x in items):
            raise bad("this model takes texts or image data URLs in 'input', not token ids", "input")
        images = [isinstance(x, str) and x.startswith(IMAGE_URL) for x in items]
        if any(images) and not all(images):
            raise bad("'input' mixes image data URLs and texts; embed them in separate requests", "input")
        kind = "image" if any(images) else "text"
        where = [f"input[{i}]" if isinstance(body["input"], list) else "input" for i in range(len(items))]
    if kind == "text":
        if not embeds_texts:
            raise bad("this model embeds images only: give images as data URLs "
                      "'data:image/<type>;base64,<data>'", param)
        return "texts", items, param
    return "images", [image_bytes(u, w, param) for u, w in zip(items, where)], param


def embedding_format(body: dict) -> str:
    fmt = field(body, "encoding_format", (str,), "float")
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions") is not None:
        raise bad("'dimensions' is not supported by this server", "dimensions")
    return fmt


def embedding_value(row: np.ndarray, fmt: str):
    row = np.asarray(row, np.float32)
    if fmt == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, choices: list, use: dict, chat: bool) -> dict:
    """choices: (index, text, finish_reason)."""
    if chat:
        out = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f,
                "logprobs": None} for i, t, f in choices]
    else:
        out = [{"index": i, "text": t, "finish_reason": f, "logprobs": None} for i, t, f in choices]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": out, "usage": use,
            "system_fingerprint": None}


def chunk_body(rid: str, model: str, index: int, text: str | None, finish: str | None, chat: bool,
               role: bool = False, use: dict | None = None, created: int | None = None) -> dict:
    """One streamed chunk (no choices, only usage, when `use` is given)."""
    if use is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choices = [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        choices = [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}]
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created or int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def finish_reason(reason: str) -> str:
    """OpenAI's finish reasons: stop or length (a cancelled request never answers)."""
    return "length" if reason == "length" else "stop"


__all__ = ["ApiError", "bad", "field", "parse_body", "check_text", "check_keys", "MAX_JSON_DEPTH",
           "sampling", "stream_flags", "chat_messages", "completion_prompts",
           "embedding_inputs", "embedding_format", "vision_embedding_inputs", "image_bytes", "IMAGE_URL",
           "embedding_value", "new_id", "usage",
           "completion_body", "chunk_body", "finish_reason"]
