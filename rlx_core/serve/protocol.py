"""OpenAI's HTTP API as plain Python: checking request bodies into scheduler arguments and
shaping responses, chunks and errors. No web framework here (rlx_core.serve.app has it), so
it is tested and imported without the `serve` extra."""
from __future__ import annotations

import base64
import json
import math
import time
import uuid
from dataclasses import dataclass

import numpy as np

from ..ir.errors import ModelError
from ..runtime.sampling import MAX_LOGPROBS, MAX_STOP_STRINGS as MAX_STOP
from ..runtime.tools import check_tool_choice, check_tools, template_messages
from ..weights.safetensors_io import json_depth


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers             # extra response headers (Retry-After of a 429)
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
              dict: "an object"}


def field(body: dict, name: str, kinds: tuple, default=None, lo=None, hi=None, open_lo: bool = False):
    """body[name] checked: one of `kinds` (bool is not a number), in [lo, hi] ((lo, hi]
    when open_lo)."""
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if ok and isinstance(v, (int, float)) and not isinstance(v, bool):
        ok = math.isfinite(v) and (lo is None or v > lo or (v == lo and not open_lo)) and (
            hi is None or v <= hi)
    if not ok:
        want = "a number" if float in kinds else " or ".join(KIND_NAMES[k] for k in kinds)
        rng = f" in {'(' if open_lo else '['}{lo}, {hi}]" if lo is not None and hi is not None else (
            f" {'>' if open_lo else '>='} {lo}" if lo is not None else "")
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


MAX_N = 128                  # choices a request may ask for (OpenAI's limit)
_SAMPLING = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "typical_p",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop",
             "min_tokens", "ignore_eos", "stream", "stream_options", "user", "logprobs", "response_format",
             "guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs", "grammar"}
KEYS = {"chat": _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                             "parallel_tool_calls"},
        "completions": _SAMPLING | {"prompt", "echo", "best_of", "suffix"},
        "embeddings": {"model", "input", "messages", "encoding_format", "dimensions", "user"},
        "tokenize": {"model", "prompt", "messages", "add_special_tokens"},
        "detokenize": {"model", "tokens"}}


def check_keys(body: dict, endpoint: str) -> None:
    """A 400 naming the first key that `endpoint` (a KEYS name) does not take (never
    silently ignored)."""
    for k in body:
        if k not in KEYS[endpoint]:
            raise bad(f"unknown field {k[:100]!r}; this endpoint takes {sorted(KEYS[endpoint])}", k[:100])


@dataclass
class Options:
    """What a chat or completions body asks, checked: `sampling` holds the runtime's
    keywords (rlx_core.runtime.sampling's names) except max_new_tokens, which depends on the
    prompt (see max_new_tokens); `grammar` is (field, constraint_factory keywords) of a
    structured output; `tools` the functions offered (tool_choice "none": not offered)."""
    sampling: dict
    n: int = 1
    logprobs: int | None = None          # top logprobs a token (0: the chosen one's only); None: none
    echo: bool = False
    grammar: tuple | None = None
    tools: list | None = None
    tool_choice: object = "auto"
    parallel_tool_calls: bool = True
    stream: bool = False
    include_usage: bool = False


def options(body: dict, chat: bool, vocab: int) -> Options:
    """The Options of a chat (`chat`) or completions body; a 400 naming the field and its
    range when a value is bad."""
    for name, allowed in (("best_of", (None, field(body, "n", (int,), 1))), ("suffix", (None, ""))):
        if name in body and body[name] not in allowed:
            raise bad(f"'{name}' is not supported by this server (only {allowed[1]!r})", name)
    n = field(body, "n", (int,), 1, lo=1, hi=MAX_N)
    temperature = field(body, "temperature", (int, float), 1.0, lo=0, hi=2)
    top_k = field(body, "top_k", (int,), None, lo=-1)                   # -1 or 0: no top-k (vLLM)
    s = {"do_sample": temperature > 0, "temperature": float(temperature) if temperature > 0 else 1.0,
         "top_k": top_k if top_k and top_k > 0 else None,
         "top_p": field(body, "top_p", (int, float), 1.0, lo=0, hi=1, open_lo=True),
         "min_p": field(body, "min_p", (int, float), 0.0, lo=0, hi=1) or None,             # 0: off
         "typical_p": _off_at(field(body, "typical_p", (int, float), 1.0, lo=0, hi=1, open_lo=True), 1),
         "repetition_penalty": field(body, "repetition_penalty", (int, float), 1.0, lo=0, open_lo=True),
         "presence_penalty": field(body, "presence_penalty", (int, float), 0.0, lo=-2, hi=2),
         "frequency_penalty": field(body, "frequency_penalty", (int, float), 0.0, lo=-2, hi=2),
         "logit_bias": logit_bias(body, vocab),
         "seed": field(body, "seed", (int,), None, lo=0, hi=2**63 - 1),   # as the runtime: >= 0
         "stop": stop_strings(body),
         "min_new_tokens": field(body, "min_tokens", (int,), 0, lo=0),
         "ignore_eos": field(body, "ignore_eos", (bool,), False)}
    top = logprobs_count(body, chat)
    echo = False if chat else field(body, "echo", (bool,), False)
    s["logprobs"] = top
    s["prompt_logprobs"] = top if echo and top is not None else None
    stream, include_usage = stream_flags(body)
    tools, choice, parallel = tool_options(body) if chat else (None, "auto", True)
    grammar = structured_output(body)
    if grammar is not None and tools is not None and choice != "auto":
        raise bad(f"'{grammar[0]}' and a tool_choice that forces a call cannot both constrain the output",
                  grammar[0])
    return Options(s, n, top, echo, grammar, tools, choice, parallel, stream, include_usage)


def _off_at(value, off):
    """None (the runtime's "off") when `value` is the setting that changes nothing."""
    return None if value == off else value


def logit_bias(body: dict, vocab: int) -> dict:
    """{token id: bias} of OpenAI's logit_bias (ids as JSON's string keys, biases in [-100, 100])."""
    raw = field(body, "logit_bias", (dict,), {})
    out = {}
    for k, v in raw.items():
        if not (k.isascii() and k.strip().isdigit() and int(k) < vocab):
            raise bad(f"'logit_bias' keys must be token ids in [0, {vocab - 1}], got {k[:40]!r}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {v!r} for token {k}"[:300],
                      "logit_bias")
        out[int(k)] = float(v)
    return out


def stop_strings(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return stop


def logprobs_count(body: dict, chat: bool) -> int | None:
    """How many top logprobs each token reports (0: the chosen token's only); None: none.
    Chat: logprobs (bool) and top_logprobs; completions: logprobs (the count)."""
    if not chat:
        return field(body, "logprobs", (int,), None, lo=0, hi=MAX_LOGPROBS)
    on = field(body, "logprobs", (bool,), False)
    top = field(body, "top_logprobs", (int,), None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise bad("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    return (top or 0) if on else None


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object"}


def structured_output(body: dict) -> tuple | None:
    """(field, constraint_factory keywords) of the one structured output a body asks for:
    response_format (json_object, json_schema), vLLM's guided_* and structured_outputs, or
    llama-server's GBNF `grammar`; None when it asks none. Two at once: a 400 naming the second."""
    found = []
    rf = field(body, "response_format", (dict,), None)
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise bad("'response_format.json_schema' must be an object with the JSON schema in 'schema'",
                          "response_format")
            field(js, "strict", (bool,), None)
            found.append(("response_format", {"json_schema": js.get("schema", {})}))
        elif kind != "text":
            raise bad(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}"[:200],
                      "response_format")
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: guided_value(name, kind, body[name])}))
    for name in ("guided_grammar", "grammar"):
        if body.get(name) is not None:
            found.append((name, grammar_kind(name, body[name])))
    so = field(body, "structured_outputs", (dict,), None)
    if so is not None:
        given = [k for k, v in so.items() if v is not None]
        if len(given) != 1 or given[0] not in STRUCTURED:
            raise bad(f"'structured_outputs' must give exactly one of {sorted(STRUCTURED)}, got {sorted(so)}",
                      "structured_outputs")
        key, value = given[0], so[given[0]]
        if key == "grammar":
            found.append(("structured_outputs", grammar_kind("structured_outputs.grammar", value)))
        elif key == "json_object":
            found.append(("structured_outputs", {"json_object": True}))
        else:
            found.append(("structured_outputs", {STRUCTURED[key]: guided_value(f"structured_outputs.{key}",
                                                                               STRUCTURED[key], value)}))
    if len(found) > 1:
        raise bad(f"'{found[1][0]}' and '{found[0][0]}' each constrain the output; give one", found[1][0])
    return found[0] if found else None


def guided_value(name: str, kind: str, value):
    """A JSON schema (an object, or its JSON text), a regex (a string) or choices (strings)."""
    param = name.split(".")[0]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(f"'{name}' is not valid JSON: {e}"[:300], param) from None
        if not isinstance(value, dict):
            raise bad(f"'{name}' must be a JSON schema (an object)", param)
    elif kind == "regex" and not (isinstance(value, str) and value):
        raise bad(f"'{name}' must be a non-empty regular expression", param)
    elif kind == "choice" and not (isinstance(value, list) and value
                                   and all(isinstance(c, str) and c for c in value)):
        raise bad(f"'{name}' must be a non-empty array of non-empty strings", param)
    return value


def grammar_kind(name: str, text) -> dict:
    """A grammar's constraint keywords: GBNF when it has '::=' rules (llama.cpp's), else Lark."""
    if not isinstance(text, str) or not text.strip():
        raise bad(f"'{name}' must be a non-empty grammar (GBNF or Lark)", name.split(".")[0])
    return {"gbnf": text} if "::=" in text else {"lark": text}


def tool_options(body: dict) -> tuple:
    """(tools offered or None, tool_choice, parallel_tool_calls) of a chat body (checked by
    runtime.tools); tool_choice "none": the tools are not offered."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = field(body, "parallel_tool_calls", (bool,), True)
    try:
        if tools is not None:
            check_tools(tools)
    except ModelError as e:
        raise bad(str(e)[:300], "tools") from None
    try:
        named = check_tool_choice(choice, tools)
    except ModelError as e:
        raise bad(str(e)[:300], "tool_choice") from None
    return (None if named == "none" else tools), (named if choice is None else choice), parallel


def max_new_tokens(body: dict, n: int, prompt_tokens: int, context: int, default_max: int | None) -> int:
    """max_tokens (or max_completion_tokens) checked against the context: the prompt and n
    choices of max_tokens each must fit it; unset: what fits, at most default_max."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = field(body, name, (int,), None, lo=1)
    room = context - prompt_tokens
    if prompt_tokens > context or room < n:
        raise bad(f"This model's maximum context length is {context} tokens; the prompt has "
                  f"{prompt_tokens} tokens, leaving no room for a completion"
                  + (f" for each of n={n} choices" if n > 1 else ""),
                  "messages" if "messages" in body else "prompt")
    if max_tokens is None:
        max_tokens = room // n if default_max is None else min(default_max, room // n)
    elif prompt_tokens + n * max_tokens > context:
        raise bad(f"This model's maximum context length is {context} tokens; you requested "
                  f"{prompt_tokens + n * max_tokens} tokens ({prompt_tokens} in the prompt, n={n} x "
                  f"{name}={max_tokens} for the completions)", name)
    minimum = field(body, "min_tokens", (int,), 0, lo=0)
    if minimum > max_tokens:
        raise bad(f"'min_tokens' ({minimum}) is more than {name} ({max_tokens})", "min_tokens")
    return max_tokens


def stream_flags(body: dict) -> tuple:
    """(stream, include_usage)."""
    stream = field(body, "stream", (bool,), False)
    opts = field(body, "stream_options", (dict,), None)
    if opts is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    usage = bool(field(opts or {}, "include_usage", (bool,), False))
    return stream, usage


def message_text(m, i: int) -> dict:
    """One chat message as {"role", "content": str} (content parts of type text joined), with
    an assistant's tool_calls and a tool message's tool_call_id."""
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad(f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r}"[:200],
                  "messages")
    c = m.get("content")
    if isinstance(c, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in c):
            raise bad(f"messages[{i}].content: only text parts are supported", "messages")
        c = "".join(p["text"] for p in c)
    calls = m.get("tool_calls") if role == "assistant" else None
    if c is None and role == "assistant":
        c = ""
    if not isinstance(c, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    out = {"role": "system" if role == "developer" else role, "content": c}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def chat_messages(body: dict) -> list:
    """The messages of a chat body as chat templates take them (runtime.tools.template_messages:
    an assistant's tool_calls with their arguments as objects); a tool message must answer a
    call an assistant message before it made (its tool_call_id), else a 400 naming it."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    try:
        return template_messages([message_text(m, i) for i, m in enumerate(msgs)])
    except ModelError as e:
        raise bad(str(e)[:300], "messages") from None


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


def tokenize_input(body: dict) -> tuple:
    """(kind, value, add_special_tokens) of a /tokenize body (vLLM's): kind "prompt" with
    the text, or "messages" with the chat (in the model's chat template)."""
    if ("prompt" in body) == ("messages" in body):
        raise bad("give 'prompt' (a string) or 'messages' (a chat), not both or neither", "prompt")
    add = field(body, "add_special_tokens", (bool,), True)
    if "messages" in body:
        if "add_special_tokens" in body:
            raise bad("'add_special_tokens' goes with 'prompt' (the chat template places a chat's special "
                      "tokens)", "add_special_tokens")
        return "messages", chat_messages(body), add
    if not isinstance(body["prompt"], str):
        raise bad("'prompt' must be a string", "prompt")
    return "prompt", body["prompt"], add


def detokenize_ids(body: dict, vocab: int | None) -> list:
    """The token ids of a /detokenize body, each in [0, vocab)."""
    ids = body.get("tokens")
    if not (isinstance(ids, list) and all(type(t) is int and 0 <= t and (vocab is None or t < vocab)
                                          for t in ids)):
        within = f" in [0, {vocab - 1}]" if vocab else " (whole numbers >= 0)"
        raise bad(f"'tokens' must be an array of token ids{within}", "tokens")
    return ids


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


@dataclass
class Choice:
    """One choice of a response: its text, finish reason, the tokens' logprobs (the runtime's
    TokenLogprob per token, or None) and the tool calls parsed from it (chat)."""
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: list | None = None
    tool_calls: list | None = None


def tool_call_json(call: dict, index: int | None = None) -> dict:
    """A parsed call ({"id", "name", "arguments"}) as OpenAI's tool_calls entry (arguments as JSON text)."""
    args = call["arguments"]
    out = {"id": call["id"], "type": "function", "function": {
        "name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}
    return out if index is None else {"index": index, **out}


def chat_logprobs(tokens: list, piece) -> dict:
    """OpenAI's chat logprobs {content: [{token, logprob, bytes, top_logprobs}]} of `tokens`
    (TokenLogprob), `piece(id)` the text of a token."""
    def entry(tok, lp):
        text = piece(tok)
        return {"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8"))}
    return {"content": [dict(entry(t.token, t.logprob), top_logprobs=[entry(i, lp) for i, lp in t.top])
                        for t in tokens]}


def completion_logprobs(tokens: list, piece, text: str, start: int = 0) -> tuple:
    """(OpenAI's completions logprobs {tokens, token_logprobs, top_logprobs, text_offset} of
    `tokens` (TokenLogprob, or an entry with logprob None for the prompt's first token), the
    position after the last token): text_offset is where each token's text starts in `text`,
    searched from `start` past whitespace only (a decoder may add spaces between tokens); a
    token whose text is not there yet (held back, or changed by decoding) gets the position
    reached."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = start
    for t in tokens:
        p = piece(t.token)
        i = text.find(p, at) if p else -1
        if i >= 0 and not text[at:i].strip():
            at = i
        out["tokens"].append(p)
        out["token_logprobs"].append(None if t.logprob is None else float(t.logprob))
        out["top_logprobs"].append(None if t.logprob is None else {piece(j): float(lp) for j, lp in t.top})
        out["text_offset"].append(at)
        if i >= 0 and i == at:
            at += len(p)
    return out, at


def completion_body(rid: str, model: str, choices: list, use: dict, chat: bool, piece=None) -> dict:
    """The response of `choices` (Choice); `piece(id)`: a token's text, for logprobs."""
    out = []
    for c in choices:
        if chat:
            msg = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                msg["content"] = c.text or None
                msg["tool_calls"] = [tool_call_json(t) for t in c.tool_calls]
            lp = None if c.logprobs is None else chat_logprobs(c.logprobs, piece)
            out.append({"index": c.index, "message": msg, "finish_reason": c.finish_reason, "logprobs": lp})
        else:
            lp = None if c.logprobs is None else completion_logprobs(c.logprobs, piece, c.text)[0]
            out.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": out, "usage": use,
            "system_fingerprint": None}


def chunk_body(rid: str, model: str, index: int, text: str | None, finish: str | None, chat: bool,
               role: bool = False, use: dict | None = None, created: int | None = None,
               logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
    """One streamed chunk (no choices, only usage, when `use` is given); `logprobs` already
    in the endpoint's shape; `tool_calls`: OpenAI's tool_calls deltas."""
    choices: list = []              # (none in the usage chunk)
    if use is None and chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    elif use is None:
        choices = [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}]
    out: dict = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created or int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def finish_reason(reason: str, tool_calls: bool = False) -> str:
    """OpenAI's finish reasons: stop, length or tool_calls; "abort" (vLLM's) for a request the
    server cancelled (its timeout, a shutdown's grace ended) that still answers."""
    if reason == "cancelled":
        return "abort"
    return "length" if reason == "length" else ("tool_calls" if tool_calls else "stop")


__all__ = ["ApiError", "bad", "field", "parse_body", "check_text", "check_keys", "MAX_JSON_DEPTH",
           "Options", "options", "max_new_tokens", "structured_output", "tool_options", "logit_bias",
           "Choice", "chat_logprobs", "completion_logprobs", "tool_call_json", "stream_flags", "chat_messages", "completion_prompts",
           "embedding_inputs", "embedding_format", "tokenize_input", "detokenize_ids",
           "vision_embedding_inputs", "image_bytes", "IMAGE_URL",
           "embedding_value", "new_id", "usage",
           "completion_body", "chunk_body", "finish_reason"]
