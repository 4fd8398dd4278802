"""Tool (function) calls, OpenAI's way, for models whose chat template offers tools.

The chat template decides how a model sees the tools and how it answers with a call; its
"style" is read from the template (`tool_prompt_style`):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call
  (Hermes and the templates that copy it);
- "json": the whole answer is `{"name": ..., "parameters": {...}}` (the JSON
  tool calling; calls may be joined by ";", a leading <|python_tag|> is dropped).

Requests come in OpenAI's form: `tools` = [{"type": "function", "function": {"name",
"description", "parameters": JSON schema}}], `tool_choice` = "auto" | "none" | "required" |
{"type": "function", "function": {"name"}}, messages with an assistant's `tool_calls` and
`tool` messages answering them by `tool_call_id`. `template_messages` turns those messages
into what HF chat templates expect (arguments as objects), `parse_tool_calls` /
`ToolCallStream` turn the model's text back into calls, and `tool_constraint` makes the
grammar that forces a call when `tool_choice` requires one.
"""
from __future__ import annotations

import json
import re
import uuid

from ..ir.errors import ModelError
from .grammar import JSON_OPTIONS, ConstraintFactory, GrammarError, _llg, constraint_factory

STYLES = ("hermes", "json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")       # OpenAI's function names (and a dot, as vLLM allows)


def tool_prompt_style(source) -> str | None:
    """The tool-call syntax of a chat template (`source`: a Tokenizer, or the template text):
    "hermes", "json", or None when the template offers no tools in a syntax known here."""
    template = getattr(source, "chat_template", source)
    if not isinstance(template, str) or "tools" not in template:
        return None
    if _HERMES_OPEN in template:
        return "hermes"
    if '"parameters"' in template:
        return "json"
    return None


def _style(style: str) -> str:
    if style not in STYLES:
        raise ModelError(f"tool-call style {style!r} is not one of {', '.join(STYLES)}")
    return style


# ---------------------------------------------------------------------------------------------- requests


def check_tools(tools) -> list[dict]:
    """OpenAI `tools`, checked: a list of {"type": "function", "function": {"name", ...}} with
    names as OpenAI allows them (unique) and `parameters` a JSON object when given."""
    if not isinstance(tools, list) or not tools:
        raise ModelError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise ModelError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": ...}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ModelError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', "
                             f"got {name!r}")
        if name in names:
            raise ModelError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ModelError(f"{where}.function.parameters must be a JSON schema object")
    return tools


def check_tool_choice(tool_choice, tools) -> str:
    """"auto", "none", "required", or the name of the function the request forces.
    Without tools only "none" (or no choice) makes sense."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice != "none" and not tools:
            raise ModelError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        known = [t["function"]["name"] for t in tools or ()]
        if name not in known:
            raise ModelError(f"tool_choice.function.name {name!r} is not among the tools "
                             f"({', '.join(known)})")
        return name
    raise ModelError("tool_choice must be \"auto\", \"none\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as HF chat templates take them: an assistant's tool_calls with
    their `arguments` as objects (OpenAI sends JSON text; templates write them with tojson),
    and each `tool` message checked to answer a call made before it (by tool_call_id)."""
    out: list[dict] = []
    called: dict[str, str] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ModelError(f"messages[{i}] must be an object with a role")
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]", called)
                                     for j, call in enumerate(message["tool_calls"])]
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in called:
                raise ModelError(f"messages[{i}].tool_call_id {call_id!r} answers no earlier assistant "
                                 f"tool call (ids so far: {', '.join(map(repr, called)) or 'none'})")
            message.setdefault("name", called[call_id])
        out.append(message)
    return out


def _template_call(call, where: str, called: dict) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ModelError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                         "\"arguments\"}}}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ModelError(f"{where}.function.arguments is not valid JSON ({e})") from None
    if call.get("id") is not None:
        called[call["id"]] = fn["name"]
    return {**call, "function": {**fn, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------- answers


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name, arguments) -> dict | None:
    """A parsed call as {"id", "name", "arguments": JSON text}, or None when malformed."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):          # (some models write the arguments as JSON text)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _hermes_body(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return _call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))


def _json_calls(text: str) -> list[dict] | None:
    """The calls when the whole of `text` is one or more JSON calls (joined by ";"), else None."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) \
            else None
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(text) - len(rest)
    return calls or None


def parse_tool_calls(text: str, style: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's answer: calls as [{"id", "name", "arguments" (JSON text)}].
    hermes: content is the text before the first <tool_call> (trailing whitespace dropped; None
    when blank), followed by any block that is not a well-formed call, kept verbatim (never lost);
    an unclosed last block counts when it parses. json: calls when the whole answer is calls,
    else the answer is content."""
    if _style(style) == "json":
        calls = _json_calls(text)
        return (None, calls) if calls else ((text or None), [])
    stream = ToolCallStream(style)
    content = stream.feed(text)[0] + stream.finish()[0]
    return (content or None), stream.calls


def as_openai(calls: list[dict]) -> list[dict]:
    """Calls in the form of OpenAI's assistant message (`tool_calls`)."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


class ToolCallStream:
    """A model's answer, fed as text deltas, split into content deltas and OpenAI tool_calls
    deltas: `feed(delta)` and, at the end, `finish()` each return (content_text, [tool_call
    delta, ...]). A call is sent whole when its text is complete (its first delta carries id,
    type, name and all the arguments); the deltas reassemble into `parse_tool_calls`' result.
    """

    def __init__(self, style: str):
        self.style = _style(style)
        self.calls: list[dict] = []
        self._buf = ""            # text not yet sent (held back: it may start a call)
        self._in_call = False     # hermes: inside <tool_call>...
        self._started = False     # hermes: a <tool_call> was seen (content after it is no longer sent)
        self._sent = False        # json: content was sent (so the answer is not a call)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self._buf += delta
        return self._hermes() if self.style == "hermes" else self._json_answer()

    def finish(self) -> tuple[str, list[dict]]:
        """The rest at the end of the answer (an unclosed hermes block counts when it parses)."""
        if self.style == "json":
            text, self._buf = self._buf, ""
            calls = None if self._sent else _json_calls(text)
            return ("", self._emit(calls)) if calls else (text, [])
        content, deltas = self._hermes()
        rest, self._buf = self._buf, ""
        if self._in_call:
            call = _hermes_body(rest)
            if call is not None:
                return content, deltas + self._emit([call])
            return content + _HERMES_OPEN + rest, deltas
        if not self._started:
            content += rest.rstrip()
        return content, deltas

    def _emit(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            out.append({"index": len(self.calls), "id": c["id"], "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]}})
            self.calls.append(c)
        return out

    def _hermes(self) -> tuple[str, list[dict]]:
        content, deltas = "", []  # type: tuple[str, list[dict]]
        while True:
            if self._in_call:
                end = self._buf.find(_HERMES_CLOSE)
                if end < 0:
                    return content, deltas
                body, self._buf = self._buf[:end], self._buf[end + len(_HERMES_CLOSE):]
                self._in_call = False
                call = _hermes_body(body)
                if call is None:
                    content += _HERMES_OPEN + body + _HERMES_CLOSE
                else:
                    deltas += self._emit([call])
                continue
            start = self._buf.find(_HERMES_OPEN)
            if start >= 0:
                if not self._started:
                    content += self._buf[:start].rstrip()
                self._buf = self._buf[start + len(_HERMES_OPEN):]
                self._in_call = self._started = True
                continue
            if self._started:           # (text between or after calls is not content)
                keep = _partial_suffix(self._buf, _HERMES_OPEN)
                self._buf = self._buf[len(self._buf) - keep:]
                return content, deltas
            # send all but trailing whitespace and what may begin a <tool_call>
            keep = _partial_suffix(self._buf, _HERMES_OPEN)
            head = self._buf[:len(self._buf) - keep]
            sendable = head.rstrip()
            content += sendable
            self._buf = self._buf[len(sendable):]
            return content, deltas

    def _json_answer(self) -> tuple[str, list[dict]]:
        if self._sent:
            text, self._buf = self._buf, ""
            return text, []
        lead = self._buf.lstrip()
        if not lead or lead.startswith("{") or _PYTHON_TAG.startswith(lead[:len(_PYTHON_TAG)]):
            return "", []               # (maybe a call: held until the answer ends)
        self._sent = True
        text, self._buf = self._buf, ""
        return text, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---------------------------------------------------------------------------------------------- constraint


def tool_constraint(tokenizer, tools, tool_choice, style: str | None,
                    vocab_size: int | None = None) -> ConstraintFactory | None:
    """The grammar that makes the model call a tool when `tool_choice` requires it: "required"
    (one call or more, hermes; one, json) or a function's name (that function, once), in the
    style's syntax with arguments valid for the function's JSON schema. "auto" and "none": None
    (the model answers freely; with "none" the caller does not offer the tools at all)."""
    choice = check_tool_choice(tool_choice, tools)
    if choice in ("auto", "none"):
        return None
    check_tools(tools)
    if style is None:
        raise ModelError(f"tool_choice {tool_choice!r}: this model's chat template has no tool-call "
                         f"syntax known here ({', '.join(STYLES)})")
    style = _style(style)
    picked = [(i, t["function"]) for i, t in enumerate(tools)
              if choice in ("required", t["function"]["name"])]
    for i, fn in picked:
        _check_parameters(tokenizer, fn, f"tools[{i}].function.parameters", vocab_size)
    fns = [fn for _, fn in picked]
    rules = [f"call_{i}: {_call_rule(tokenizer, fn, style, i)}" for i, fn in enumerate(fns)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))
    many = style == "hermes" and choice == "required"
    start = 'start: call ("\\n" call)*' if many else "start: call"
    lark = "\n".join([start, call, *rules,
                      *(f"args_{i}: %json {json.dumps(_arguments_schema(fn))}" for i, fn in enumerate(fns))])
    grammar = _llg().LLMatcher.grammar_from_lark(lark)
    return ConstraintFactory(tokenizer, "tool_choice", grammar, vocab_size)


def _call_rule(tokenizer, fn: dict, style: str, i: int) -> str:
    """One function's call in the style's syntax, its arguments the rule args_<i>."""
    name = json.dumps(fn["name"])
    if style == "json":
        head = '{"name": ' + name + ', "parameters": '
        return f"{_lit(head)} args_{i} {_lit('}')}"
    head, tail = '\n{"name": ' + name + ', "arguments": ', "}\n"
    opening, closing = _tag(tokenizer, _HERMES_OPEN), _tag(tokenizer, _HERMES_CLOSE)
    return f"{opening} {_lit(head)} args_{i} {_lit(tail)} {closing}"


def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _tag(tokenizer, tag: str) -> str:
    """`tag` in the grammar: its text, or its token when the tokenizer has it as a special token
    (whose text the grammar's byte matching would not produce)."""
    tid = tokenizer.token_to_id(tag)
    if tid is not None and tokenizer.decode([tid], skip_special_tokens=True) == "":
        return f"<[{tid}]>"
    return _lit(tag)


def _arguments_schema(fn: dict) -> dict:
    """The function's parameters schema (none: any object), JSON whitespace bounded as in grammar.py."""
    schema = fn.get("parameters") or {"type": "object"}
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def _check_parameters(tokenizer, fn: dict, where: str, vocab_size) -> None:
    """A function's parameters schema compiles on its own (its error names the tool)."""
    try:
        constraint_factory(tokenizer, json_schema=_arguments_schema(fn), vocab_size=vocab_size)
    except GrammarError as e:
        raise GrammarError(f"{where}: {str(e).removeprefix('json_schema: ')}") from None


__all__ = ["STYLES", "tool_prompt_style", "check_tools", "check_tool_choice", "template_messages",
           "parse_tool_calls", "ToolCallStream", "tool_constraint", "as_openai", "new_call_id"]
