"""Issue 48 §3: the chat page at `/` in a real browser. The distribution's Chromium (headless,
driven by Playwright with `executable_path`: no browser is downloaded) against `rlx serve`'s
app under uvicorn on a loopback port, serving tiny numpy LLaMAs (no weights to download).

The page loads with no request to any other host, lists the served models, streams an answer
equal to the greedy answer the API gives for the same messages, stops a long generation (the
server's request ends "cancelled"), keeps the conversation over a reload, clears it on a new
conversation, shows HTML in an answer as text and shows the server's error messages.
Every wait is on the page's DOM state or on the server's request, never a fixed sleep.
Skipped, with the reason, where Playwright or Chromium is missing (scripts/setup.sh --test
installs both where it can)."""
from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

for mod in ("starlette", "uvicorn"):
    pytest.importorskip(mod)
pytest.importorskip("rlx_blocks_llama")
pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright: scripts/setup.sh --test)")


def chromium() -> str | None:
    """The distribution's Chromium: $RLX_CHROMIUM, else `chromium` or `chromium-browser` on PATH."""
    named = os.environ.get("RLX_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)


CHROMIUM = chromium()
if CHROMIUM is None:
    pytest.skip("needs the distribution's Chromium (apt-get install chromium, or set RLX_CHROMIUM): "
                "scripts/setup.sh --test installs it where it can", allow_module_level=True)

from serve_tiny import CHAT_TEMPLATE, Server, request_json  # noqa: E402
from tiny_models import LLAMA, WORDS, llama_tensors  # noqa: E402

TIMEOUT_MS = 30_000
HOLD_S = 30                         # how long a held generation waits for its cancel
HTML = "<img/src=x/onerror=window.pwned=1>"       # an answer's token: markup, were it parsed
USER_HTML = "<i>you</i>"                          # a user's word: markup too (unknown to the vocab)


def word_tokenizer(words: list):
    """A WordLevel tokenizer over `words` split at whitespace only (so `HTML` is one word),
    with the chat template of the server tests."""
    from tokenizers import Tokenizer as Tk
    from tokenizers import models, pre_tokenizers

    from rlx_core.weights.tokenizer import Tokenizer

    tk = Tk(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(tk, name="words", eos_token_ids=(2,))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def chat(text: str) -> list:
    return [{"role": "user", "content": text}]


def html_prompt(model) -> tuple:
    """(a prompt, the first token greedy decoding answers it with): a prompt whose answer
    starts with an ordinary word that the prompt does not hold, so that word can be spelt as
    HTML in a second vocabulary (the same ids: the same answer)."""
    for n in range(1, 40):
        prompt = f"{USER_HTML} w{n} w{n + 1}"
        ids = model.encode_chat(chat(prompt))
        token = int(list(model.generate(ids, max_new_tokens=1))[-1])
        if token >= 5 and token not in ids:
            return prompt, token
    raise AssertionError("no prompt of the tiny model answers with a word it does not hold")


@pytest.fixture(scope="module")
def models():
    """{"tiny": the tiny LLaMA, "html": the same weights with one answer word spelt as HTML}."""
    from rlx_core.runtime.model import CausalLM

    cfg = dict(LLAMA, max_position_embeddings=256)
    tensors = llama_tensors(cfg, np.random.default_rng(5))
    tiny = CausalLM.from_tensors(cfg, tensors, tokenizer=word_tokenizer(WORDS), backend="numpy")
    prompt, token = html_prompt(tiny)
    words = list(WORDS)
    words[token] = HTML
    html = CausalLM.from_tensors(cfg, tensors, tokenizer=word_tokenizer(words), backend="numpy")
    html.html_prompt = prompt
    return {"tiny": tiny, "html": html}


class Spy:
    """The scheduler requests of a served model, recorded as submitted. While `hold` is set,
    a request's scheduler thread waits, after the first event with text, until the request
    is cancelled (HOLD_S at most): Stop then always meets a generation still running, however
    fast the machine decodes. `released` records, per held request, whether a cancel (True)
    or the time limit (False) let it go on."""

    def __init__(self, scheduler):
        self.requests: list = []
        self.released: list = []
        self.hold = False
        self._submit = scheduler.submit
        scheduler.submit = self.submit

    def submit(self, prompt, params=None, on_event=None, **kw):
        cancelled, hold, held = threading.Event(), self.hold, []

        def event(ev):
            on_event(ev)
            if hold and ev.text and ev.finish_reason is None and not held:
                held.append(True)
                self.released.append(cancelled.wait(HOLD_S))

        req = self._submit(prompt, params, on_event=event, **kw)
        cancel = req.cancel

        def cancelling():
            cancel()
            cancelled.set()
        req.cancel = cancelling
        self.requests.append(req)
        return req


@pytest.fixture(scope="module")
def server(models):
    from rlx_core.serve import create_app

    app = create_app(models, max_batch=4)
    srv = Server(app)
    srv.spy = Spy(app.state.served.schedulers["tiny"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
    yield b
    b.close()
    pw.stop()


class Page:
    """A fresh browser context (its own localStorage) on the server's page, recording every
    request the page makes."""

    def __init__(self, browser, server, ready: bool = True):
        self.origin = f"http://127.0.0.1:{server.port}"
        self.context = browser.new_context()
        self.requests: list = []
        self.context.on("request", lambda r: self.requests.append(r))
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.errors: list = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.response = self.page.goto(self.origin + "/")
        if ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the page listed the models."""
        self.page.wait_for_function("() => document.querySelectorAll('#model option').length > 0")

    def reload(self) -> None:
        self.page.reload()
        self.wait_ready()

    def settings(self, **fields) -> None:
        """Fill settings fields by id (system, temperature, max_tokens)."""
        if not self.page.eval_on_selector("details", "d => d.open"):
            self.page.click("summary")
        for name, value in fields.items():
            self.page.fill("#" + name.replace("_", "-"), str(value))

    def send(self, text: str, wait: bool = True) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")
        if wait:
            self.wait_idle()

    def wait_idle(self) -> None:
        self.page.wait_for_function("() => document.body.dataset.state === 'idle'")

    def messages(self) -> list:
        """(role, text) of every message shown."""
        return self.page.eval_on_selector_all(
            "#log .msg", "ms => ms.map(m => [m.classList[1], m.querySelector('.text').textContent])")

    def chat_requests(self) -> list:
        return [r for r in self.requests if r.url.endswith("/v1/chat/completions")]

    def error(self) -> str:
        return self.page.eval_on_selector("#error", "e => e.hidden ? '' : e.textContent")


@pytest.fixture
def page(browser, server):
    p = Page(browser, server)
    yield p
    p.context.close()


def api_answer(server, body: dict) -> str:
    """The API's answer to the page's request `body`, asked without streaming."""
    code, out = request_json(f"http://127.0.0.1:{server.port}/v1/chat/completions", dict(body, stream=False))
    assert code == 200, out
    return out["choices"][0]["message"]["content"]


def test_the_page_loads_from_this_server_alone_and_lists_the_models(page):
    assert page.response.status == 200
    policy = page.response.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert page.page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == ["tiny", "html"]
    assert page.requests, "no request was recorded"
    elsewhere = [r.url for r in page.requests if not r.url.startswith(page.origin + "/")]
    assert elsewhere == []
    assert {r.url[len(page.origin):] for r in page.requests} == {"/", "/v1/models"}
    assert page.errors == []                       # the script ran under the page's own policy
    assert page.messages() == [] and page.error() == ""


def test_an_answer_streams_and_equals_the_greedy_answer_of_the_api(page, server):
    page.settings(system="w9 w8", temperature=0, max_tokens=12)
    page.send("w1 w2 w3")
    first = page.chat_requests()[-1]
    body = first.post_data_json
    assert body["stream"] is True and body["model"] == "tiny"
    assert body["messages"] == [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w1 w2 w3"}]
    assert (body["temperature"], body["max_tokens"]) == (0, 12)
    assert first.response().headers["content-type"].startswith("text/event-stream")
    answer = api_answer(server, body)
    assert answer and page.messages() == [["user", "w1 w2 w3"], ["assistant", answer]]
    # a second turn sends the whole conversation
    page.send("w4 w5")
    body = page.chat_requests()[-1].post_data_json
    assert body["messages"][1:] == [{"role": "user", "content": "w1 w2 w3"},
                                    {"role": "assistant", "content": answer},
                                    {"role": "user", "content": "w4 w5"}]
    assert page.messages()[-1] == ["assistant", api_answer(server, body)]
    assert page.error() == "" and page.errors == []
    assert all(r.url.startswith(page.origin + "/") for r in page.requests)


def test_a_reload_keeps_the_conversation_and_a_new_one_clears_it(page):
    page.settings(system="w7", temperature=0, max_tokens=5)
    page.page.select_option("#model", "html")
    page.send("w3 w1")
    shown = page.messages()
    assert [role for role, _ in shown] == ["user", "assistant"] and shown[1][1]
    page.reload()
    assert page.messages() == shown
    assert page.page.input_value("#model") == "html"
    assert (page.page.input_value("#system"), page.page.input_value("#temperature"),
            page.page.input_value("#max-tokens")) == ("w7", "0", "5")
    page.page.click("#new")
    assert page.messages() == []
    page.reload()
    assert page.messages() == []
    assert page.page.input_value("#system") == "w7"             # the settings stay


def test_stop_ends_a_long_generation_early(page, server):
    spy = server.spy
    page.settings(temperature=0, max_tokens=200)
    spy.hold = True
    try:
        page.send("w2 w3 w4", wait=False)
        page.page.wait_for_function(
            "() => (document.querySelector('#log .msg.assistant .text') || {}).textContent")
        page.page.wait_for_selector("#stop", state="visible")
        page.page.click("#stop")
        page.wait_idle()
    finally:
        spy.hold = False
    req = spy.requests[-1]
    done = req.result(HOLD_S)
    assert spy.released[-1] is True, "the request went on by the time limit, not by a cancel"
    assert done.finish_reason == "cancelled" and done.completion_tokens < 200, done
    (role, text), = page.messages()[1:]
    assert role == "assistant" and text and req.text.startswith(text)
    assert page.page.text_content("#log .msg.assistant .note") == "stopped"
    assert page.page.is_visible("#send") and not page.page.is_visible("#stop")
    assert page.error() == ""


def test_html_in_messages_shows_as_text(page, models, server):
    prompt = models["html"].html_prompt
    page.page.select_option("#model", "html")
    page.settings(temperature=0, max_tokens=4)
    page.send(prompt)
    (_, said), (_, answer) = page.messages()
    assert said == prompt and answer.startswith(HTML)
    assert answer == api_answer(server, page.chat_requests()[-1].post_data_json)
    assert page.page.locator("#log .text *").count() == 0           # no element made of the text
    assert page.page.evaluate("window.pwned") is None
    page.reload()                                   # (and when shown again from storage)
    assert page.messages()[1][1] == answer
    assert page.page.locator("#log .text *").count() == 0


def test_the_servers_errors_are_shown(page, server):
    page.settings(temperature=5)
    page.send("w1 w2")
    message = page.error()
    assert "temperature" in message and "[0, 2]" in message, message
    # nothing came back: the turn is taken back, its text in the message box again
    assert page.messages() == [] and page.page.input_value("#input") == "w1 w2"
    page.settings(temperature=0, max_tokens=3)
    page.page.click("#send")
    page.wait_idle()
    assert page.error() == "" and len(page.messages()) == 2
    # a model the server does not have (say, unloaded since the page listed it)
    page.page.eval_on_selector("#model", "s => s.add(new Option('gone', 'gone'))")
    page.page.select_option("#model", "gone")
    page.send("w1")
    assert "'gone' does not exist" in page.error()


def test_an_api_key_is_asked_for_and_sent_as_a_bearer_token(browser, models):
    from rlx_core.serve import create_app

    srv = Server(create_app({"tiny": models["tiny"]}, max_batch=2, api_key="sesame"))
    p = Page(browser, srv, ready=False)
    try:
        assert p.response.status == 200                          # the page itself is public
        p.page.wait_for_function("() => !document.querySelector('#error').hidden")
        assert p.error().startswith("Could not list the models: a valid API key is required"), p.error()
        assert p.messages() == []
        p.page.fill("#key", "sesame")
        p.page.press("#key", "Tab")                               # (a change event)
        p.wait_ready()
        assert p.error() == ""
        p.settings(temperature=0, max_tokens=3)
        p.send("w1 w2")
        assert p.error() == "" and len(p.messages()) == 2
        assert p.chat_requests()[-1].all_headers()["authorization"] == "Bearer sesame"
        p.reload()                                                # the key is kept
        assert p.page.input_value("#key") == "sesame" and len(p.messages()) == 2
    finally:
        p.context.close()
        srv.stop()
