"""`rlx serve MODEL --tp 2` (issue 19): the server's model runs on two supervised rank
processes (rlx_core.runtime.tp.GroupScheduler replays each Scheduler round on the ranks).
A tiny random LLaMA folder with a word tokenizer is served by the CLI in a subprocess on a
loopback port it picks; the official `openai` client gets the text the unsharded model
generates in this process (one request, three concurrent ones, a stream); a tiny BERT's
/v1/embeddings equal the unsharded encoder's. The test stops the server (SIGINT) and
checks the rank processes are gone. Every request is bounded."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

for mod in ("openai", "starlette", "uvicorn"):
    pytest.importorskip(mod)

from tiny_models import WORDS, tiny_bert_folder, tiny_llama_folder  # noqa: E402

TIMEOUT = 60
PROMPTS = ["w3 w5 w7", "w9 w1", "w20 w21 w22 w23", "w40"]


class Server:
    """`rlx serve FOLDER --tp N` in a subprocess; its stderr read by a thread."""

    def __init__(self, folder: str, tp: int):
        code = "import sys; from rlx_core.cli import main; sys.argv[0] = 'rlx'; main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", folder, "--tp", str(tp), "--backend", "numpy",
             "--port", "0", "--log-level", "info", "--max-batch", "4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, RLX_TP_TIMEOUT=str(TIMEOUT)))
        self.lines: list = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(TIMEOUT) or self.url is None:
            self.stop()
            pytest.fail("the server did not start:\n" + "".join(self.lines))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1) + "/v1"
                self._ready.set()
        self._ready.set()                  # (it exited)

    def rank_pids(self) -> list:
        for line in self.lines:
            m = re.search(r"ranks \(pids ([\d, ]+)\)", line)
            if m:
                return [int(p) for p in m.group(1).split(",")]
        return []

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(TIMEOUT)
        return self.proc.returncode


def test_serve_tp2_gives_the_unsharded_text(tmp_path):
    import openai

    import rlx_core

    folder = tiny_llama_folder(tmp_path / "tiny")
    ref = rlx_core.load(folder, backend="numpy", progress=False)
    want = [ref.generate(p, max_new_tokens=6 + i) for i, p in enumerate(PROMPTS)]
    assert all(want)

    srv = Server(folder, 2)
    try:
        pids = srv.rank_pids()
        assert len(pids) == 2, srv.lines
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=TIMEOUT)
        r = client.completions.create(model=folder, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert r.choices[0].text == want[0] and r.usage.completion_tokens <= 6
        got: dict = {}

        def ask(i):
            got[i] = client.completions.create(model=folder, prompt=PROMPTS[i], max_tokens=6 + i,
                                               temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in (1, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert got == {i: want[i] for i in (1, 2, 3)}
        parts = [c.choices[0].text for c in client.completions.create(
            model=folder, prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True) if c.choices]
        assert "".join(parts) == want[2]
        for extra in ({"n": 2}, {"logprobs": 1}):              # what the ranks' rounds do not carry yet
            with pytest.raises(openai.BadRequestError, match=list(extra)[0]):
                client.completions.create(model=folder, prompt=PROMPTS[0], max_tokens=2, **extra)
    finally:
        code = srv.stop()
    assert code == 0, "".join(srv.lines)
    for pid in pids:                             # the ranks stopped with the server
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_serve_tp2_embeds_like_the_unsharded_encoder(tmp_path, rng):
    """An encoder served at --tp 2 runs sharded on its ranks (not on the server's copy)."""
    import numpy as np
    import openai

    import rlx_core

    folder = tiny_bert_folder(tmp_path / "bert", int(rng.integers(2 ** 31)), num_attention_heads=4)
    ref = rlx_core.load(folder, backend="numpy", progress=False)
    texts = [" ".join(rng.choice(WORDS[5:], n)) for n in (3, 7, 1, 5)]
    want = ref.embed(texts)
    srv = Server(folder, 2)
    try:
        pids = srv.rank_pids()
        assert len(pids) == 2, srv.lines
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=TIMEOUT)
        got: dict = {}

        def ask(i, part):
            got[i] = client.embeddings.create(model=folder, input=part)

        threads = [threading.Thread(target=ask, args=(i, texts[2 * i:2 * i + 2])) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        rows = np.array([d.embedding for i in (0, 1) for d in got[i].data], np.float32)
        np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-5)
        assert got[0].usage.prompt_tokens == 3 + 7 + 2 * 2          # [CLS] and [SEP] each
        ids = client.embeddings.create(model=folder, input=[[2, 9, 11, 3]]).data[0].embedding
        np.testing.assert_allclose(ids, ref.embed([[2, 9, 11, 3]])[0], rtol=1e-5, atol=1e-5)
    finally:
        code = srv.stop()
    assert code == 0, "".join(srv.lines)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_serve_tp_flag_errors():
    from click.testing import CliRunner

    from rlx_core.cli import main

    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0 and "--tp" in r.output
    r = CliRunner().invoke(main, ["serve", "m", "--tp", "0"])
    assert r.exit_code == 2 and "--tp" in r.output
