"""`rlx serve` and mixed steps (issue 48): `--no-mixed` reaches the model's Scheduler
(mixed=False), and the server's warm-up (Served.warm, before /health says ready) builds the
mixed graphs of a scheduler that mixes, and none of one that does not."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("starlette")
pytest.importorskip("rlx_blocks_llama")

from rlx_core.cli import main  # noqa: E402
from rlx_core.runtime.model import CausalLM, find_recipe  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    recipe = find_recipe("llama")
    cfg = dict(recipe.tiny_config(), max_position_embeddings=256)
    return CausalLM.from_tensors(cfg, recipe.tiny_tensors(cfg, np.random.default_rng(4)), backend="numpy",
                                 recipe=recipe)


def served_by_cli(monkeypatch, model, *flags):
    """The Served app `rlx serve tiny FLAGS` would run (loading and the HTTP server stubbed)."""
    import rlx_core.serve as serve
    from rlx_core.serve.app import Served

    got: dict = {}
    monkeypatch.setattr(serve, "require", lambda: None)
    monkeypatch.setattr(serve, "load_models", lambda *a, **k: ({"tiny": model}, {}))
    monkeypatch.setattr(serve, "run", lambda models, *a, **k: got.update(k, models=models))
    r = CliRunner().invoke(main, ["serve", "tiny", "--max-batch", "2", *flags])
    assert r.exit_code == 0, r.output
    return Served(got["models"], max_batch=2, scheduler_options=got["scheduler_options"])


@pytest.mark.parametrize("flags, mixed", [((), True), (("--no-mixed",), False)])
def test_no_mixed_reaches_the_scheduler_and_its_warm_up(monkeypatch, llama, flags, mixed):
    served = served_by_cli(monkeypatch, llama, "--prefill-chunk", "8", *flags)
    try:
        s = served.schedulers["tiny"]
        assert s.mixed is mixed and s.prefill_chunk == 8
        served.warm()
        assert sorted(s._mixed) == ([(r, p) for r in (1, 2) for p in (1, 2, 4, 8)] if mixed else [])
    finally:
        served.close()
