"""Chatting with a CausalLM: a conversation kept as chat messages (`ChatSession`) and the
read-answer loop of `rlx chat` (`chat_loop`), which takes its input and output as functions
so a terminal, a pipe and a test drive it alike.

Each turn renders the whole conversation with the model's chat template and runs it through
the session's own Scheduler (one row), whose prefix cache keeps the earlier turns' KV (the
last prompt and answer, in whole blocks): a turn computes only what follows the longest
cached prefix, its new message and the template's tokens around it (and the part of the
last block the cache does not hold). A model whose caches cannot be extended prefills the
whole conversation each turn, as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.errors import ModelError, RlxError
from .args import float_arg, text_arg
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .scheduler import Scheduler
from .text_stream import TextStream
from .tools import check_tool_choice, check_tools, template_messages, tool_prompt_style

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system prompt and start "
        "over; /system alone removes it), /help, /exit (or end of input)")


PREFIX_CACHE_MB = 64.0        # a conversation's cache: ~2,000 tokens of SmolLM2-135M per 100 MB


class ChatSession:
    """A conversation with `model`: an optional system prompt and the turns so far.
    `generate_kw` are CausalLM.generate's sampling arguments (max_new_tokens, temperature, ...),
    checked here; `prefix_cache_mb` bounds the cache of earlier turns (0: none). close()
    (or the end of a `with` block) stops the session's scheduler thread."""

    def __init__(self, model, system: str | None = None, prefix_cache_mb: float = PREFIX_CACHE_MB,
                 **generate_kw):
        if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
            raise ModelError(f"{model.source}: chatting needs a chat template and this model has none "
                             "(a base model, not an instruction-tuned one); use `rlx generate` on plain text")
        self.model, self.kw = model, generate_kw
        self.params = SamplingParams.checked(**generate_kw)
        self.prefix_cache_mb = float_arg("prefix_cache_mb", prefix_cache_mb, 0.0)
        self.history: list[dict] = []
        self.system = text_arg("system", system) if system else None
        self._scheduler: Scheduler | None = None

    @property
    def scheduler(self) -> Scheduler:
        """The session's Scheduler (one row; made on the first turn)."""
        if self._scheduler is None:
            from .scheduler import Scheduler

            self._scheduler = Scheduler(self.model, 1, prefix_cache_mb=self.prefix_cache_mb)
        return self._scheduler

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def messages(self, user: str | None = None) -> list:
        """The conversation as chat messages, with `user`'s next message when given."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        out += self.history
        return out + ([{"role": "user", "content": user}] if user is not None else [])

    def reply(self, user: str, stream=None) -> str:
        """The model's answer to `user`'s message (streamed through `stream` as generated);
        the turn joins the history only once answered."""
        user = text_arg("message", user)
        ids = self.model.encode_chat(self.messages(user))
        req = self.scheduler.submit(ids, self.params)
        try:
            for ev in req.events():
                for t in ev.token_ids if stream is not None else ():
                    stream([t])
        except BaseException:                 # (Ctrl-C, a stream that failed: the turn stops)
            req.cancel()
            raise
        eos = set(self.model.eos_ids)
        answer = self.model.tokenizer.decode([t for t in req.result().token_ids if t not in eos])
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return answer

    def reset(self) -> None:
        self.history = []

    def set_system(self, text: str | None) -> None:
        """A new system prompt (None or empty: none) and a new conversation."""
        self.system = text_arg("system", text) if text else None
        self.history = []


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None, tool_choice=None) -> str:
    """The prompt text of an OpenAI-style chat request: `messages` (tool calls and `tool`
    answers included) and `tools` rendered by the model's chat template. tool_choice "none"
    does not offer the tools; offering them to a template that shows no tools (or in a call
    syntax rlx cannot read back) is an error rather than a silently tool-less prompt."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ModelError("this model has no chat template (a base model, not an instruction-tuned one)")
    offered = None
    if tools is not None and check_tool_choice(tool_choice, tools) != "none":
        offered = check_tools(tools)
        if tool_prompt_style(tokenizer) is None:
            raise ModelError("tools: this model's chat template does not offer tools (or not in a call "
                             "syntax rlx reads: <tool_call> blocks or a JSON answer)")
    return tokenizer.apply_chat_template(template_messages(messages), tools=offered)


def chat_loop(session: ChatSession, read, write, note) -> None:
    """Until `read()` gives None (end of input) or /exit: a line starting with "/" is a command
    (HELP), any other non-empty line a message whose answer `write(text)` receives as it
    streams, then a newline. `note(text)` gets messages for the person (stderr). An error of a
    turn (the conversation outgrew the context, ...) is noted and the chat goes on; Ctrl-C
    during an answer stops that answer, which the history then forgets."""
    while True:
        line = read()
        if line is None:
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd in ("/exit", "/quit"):
                return
            if cmd == "/reset":
                session.reset()
                note("[conversation cleared]")
            elif cmd == "/system":
                session.set_system(arg.strip())
                note(f"[system prompt {'set' if session.system else 'removed'}; conversation cleared]")
            elif cmd == "/help":
                note(HELP)
            else:
                note(f"unknown command {cmd}; {HELP}")
            continue
        stream = TextStream(session.model.tokenizer, session.model.eos_ids, write)
        try:
            session.reply(line, stream)
        except (RlxError, KeyboardInterrupt) as e:
            if stream.ids:
                write("\n")
            note("[answer interrupted; this turn is forgotten]" if isinstance(e, KeyboardInterrupt)
                 else f"error: {e} (/reset starts a new conversation)")
            continue
        write("\n")


__all__ = ["ChatSession", "chat_loop", "chat_prompt", "HELP"]
