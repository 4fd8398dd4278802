"""Tool calls (rlx_core.runtime.tools, chat.chat_prompt): tools and tool messages rendered by the
chat template, calls parsed back from Hermes (Qwen) and Llama 3 answers, streamed as OpenAI
tool_calls deltas that reassemble to the same calls, and tool_choice "required" / a named
function forced by a grammar whose every walk parses into calls with valid arguments."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from grammar_walk import SMOLLM2, smollm2_tokenizer, walk  # noqa: E402

from rlx_core.ir.errors import ModelError  # noqa: E402
from rlx_core.runtime.chat import chat_prompt  # noqa: E402
from rlx_core.runtime.grammar import GrammarError  # noqa: E402
from rlx_core.runtime.tools import (  # noqa: E402
    ToolCallStream,
    as_openai,
    check_tool_choice,
    check_tools,
    parse_tool_calls,
    template_messages,
    tool_constraint,
    tool_prompt_style,
)
from rlx_core.weights.tokenizer import Tokenizer  # noqa: E402

# Small templates in the two call syntaxes (written for these tests, shaped like the models' own:
# tools shown as JSON, an assistant's calls written back with their arguments as objects).
HERMES = """\
{%- if tools %}<|im_start|>system
You may call functions. Tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """\
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if loop.first and tools %}Respond with {"name": function name, "parameters": dictionary of arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}
{%- else %}{{ m.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"offset_hours": {"type": "integer", "minimum": -12,
                                                                     "maximum": 14}},
                   "required": ["offset_hours"], "additionalProperties": False}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NO_PARAMS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def _tokenizer(template: str, tok=None) -> Tokenizer:
    tok = tok or smollm2_tokenizer()
    return Tokenizer(tok.backend, name="test-template", special_tokens=tok.special_tokens,
                     eos_token_ids=tok.eos_token_ids, chat_template=template)


# ---------------------------------------------------------------------------------------------- templates

@SMOLLM2
def test_style_from_template():
    assert tool_prompt_style(HERMES) == "hermes"
    assert tool_prompt_style(LLAMA3) == "json"
    assert tool_prompt_style(_tokenizer(HERMES)) == "hermes"
    assert tool_prompt_style(smollm2_tokenizer()) is None     # (its template shows no tools)
    assert tool_prompt_style(None) is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@SMOLLM2
@pytest.mark.parametrize("template, call_text", [
    (HERMES, '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
def test_chat_prompt_renders_tools_calls_and_answers(template, call_text):
    tok = _tokenizer(template)
    text = chat_prompt(tok, CONVERSATION, tools=TOOLS)
    assert json.dumps(WEATHER, ensure_ascii=False) in text        # the tools, as the template shows them
    assert call_text in text                                      # arguments as an object, not a string
    assert "18 C, sunny" in text
    offered_none = chat_prompt(tok, CONVERSATION, tools=TOOLS, tool_choice="none")
    assert "get_time" not in offered_none and call_text in offered_none


@SMOLLM2
def test_chat_prompt_bad_input_is_named():
    tok = _tokenizer(HERMES)
    with pytest.raises(ModelError, match=r"messages\[2\]\.tool_call_id 'call_9'"):
        chat_prompt(tok, CONVERSATION[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}])
    with pytest.raises(ModelError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        template_messages([CONVERSATION[0], {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ModelError, match="tools: this model's chat template does not offer tools"):
        chat_prompt(smollm2_tokenizer(), CONVERSATION[:1], tools=TOOLS)
    with pytest.raises(ModelError, match=r"tools\[1\]\.function\.name"):
        check_tools([WEATHER, {"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(ModelError, match="given twice"):
        check_tools([WEATHER, WEATHER])
    with pytest.raises(ModelError, match=r"tools\[0\]\.function\.parameters"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": "object"}}])
    with pytest.raises(ModelError, match="'nope' is not among the tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ModelError, match="needs tools"):
        check_tool_choice("required", None)


# ---------------------------------------------------------------------------------------------- parsing

def _calls(calls):
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


PARSED = [
    ("hermes", 'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
               '{"offset_hours": 2}}\n</tool_call>',
     "Let me look.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"offset_hours": 2})]),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None, [("ping", {})]),
    ("hermes", "The answer is 42 <tool_ (not a call).", "The answer is 42 <tool_ (not a call).", []),
    ("hermes", 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', "Sure",
     [("get_weather", {"city": "Rome"})]),                                  # unclosed at the end
    ("hermes", 'x <tool_call>{broken</tool_call>', "x<tool_call>{broken</tool_call>", []),   # kept, not lost
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', None,
     [("f", {"a": [1, 2]})]),
    ("json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("json", '<|python_tag|>{"name": "get_time", "parameters": {"offset_hours": -3}}; '
               '{"name": "ping", "arguments": {}}', None, [("get_time", {"offset_hours": -3}), ("ping", {})]),
    ("json", '  {"name": "ping", "parameters": {}}\n', None, [("ping", {})]),
    ("json", 'Use {"name": ...} to call.', 'Use {"name": ...} to call.', []),
    ("json", '{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize("style, text, content, calls", PARSED)
def test_parse_tool_calls(style, text, content, calls):
    got_content, got = parse_tool_calls(text, style)
    assert got_content == content and _calls(got) == calls
    assert all(c["id"].startswith("call_") for c in got) and len({c["id"] for c in got}) == len(got)
    assert [o["function"]["name"] for o in as_openai(got)] == [c[0] for c in calls]


@pytest.mark.parametrize("style, text, content, calls", PARSED)
def test_stream_reassembles_to_the_parse(style, text, content, calls):
    rng = np.random.default_rng(len(text))
    for chunking in range(6):
        cuts = sorted(rng.choice(len(text), size=min(len(text) - 1, 3 + 4 * chunking), replace=False)) \
            if chunking else list(range(1, len(text)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, sent, deltas = ToolCallStream(style), "", []
        for piece in pieces:
            c, d = stream.feed(piece)
            sent, deltas = sent + c, deltas + d
        c, d = stream.finish()
        sent, deltas = sent + c, deltas + d
        assert (sent or None) == content
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert all(d["type"] == "function" and d["id"].startswith("call_") for d in deltas)
        assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == calls


# ---------------------------------------------------------------------------------------------- constraint

@SMOLLM2
@pytest.mark.parametrize("style", ["hermes", "json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_call_is_forced_and_valid(style, choice):
    tok = smollm2_tokenizer()
    factory = tool_constraint(tok, TOOLS, choice, style)
    rng = np.random.default_rng(11)
    names = set()
    for _ in range(12):
        text, _ = walk(factory, tok, rng, free_steps=30)
        content, calls = parse_tool_calls(text, style)
        assert calls and content is None, text
        for call in calls:
            names.add(call["name"])
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert names == {"get_time"} if isinstance(choice, dict) else names <= set(SCHEMAS)


@SMOLLM2
def test_required_call_with_special_tag_tokens():
    """Where <tool_call> is a special token of the tokenizer, the grammar emits that token."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Tk

    base = smollm2_tokenizer()
    tk = Tk.from_str(base.backend.to_str())
    tk.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    tok = _tokenizer(HERMES, Tokenizer(tk, name="special-tags", eos_token_ids=base.eos_token_ids))
    factory = tool_constraint(tok, TOOLS, "required", "hermes")
    text, ids = walk(factory, tok, np.random.default_rng(2), skip_special=False)
    assert tok.token_to_id("<tool_call>") in ids
    _, calls = parse_tool_calls(text, "hermes")
    assert calls and all(c["name"] in SCHEMAS for c in calls)


@SMOLLM2
def test_tool_constraint_choices_and_errors():
    tok = smollm2_tokenizer()
    assert tool_constraint(tok, TOOLS, "auto", "hermes") is None
    assert tool_constraint(tok, TOOLS, "none", None) is None
    assert tool_constraint(tok, TOOLS, None, "hermes") is None         # (OpenAI's default with tools: auto)
    with pytest.raises(ModelError, match="no tool-call syntax known here"):
        tool_constraint(tok, TOOLS, "required", None)
    bad = {"type": "function", "function": {"name": "odd", "parameters": {"type": "integer", "minimum": 3,
                                                                         "maximum": 1}}}
    with pytest.raises(GrammarError, match=r"tools\[1\]\.function\.parameters: .*minimum"):
        tool_constraint(tok, [WEATHER, bad], "required", "hermes")
