"""The Gemma plugin is a separate distribution: disabling it (RLX_DISABLE_PLUGINS) makes a
Gemma checkpoint an error naming `rlx-blocks-gemma`; and installed into a fresh virtual
environment with only the core (no LLaMA plugin), it runs a Gemma model there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError
from rlx_core.plugins import registry, reset

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PLUGIN_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
REPO = os.path.abspath(os.path.join(PLUGIN_DIR, "..", ".."))


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    cfg = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=16, sliding_window=4, sliding_window_pattern=2,
                                        max_position_embeddings=64, query_pre_attn_scalar=16,
                                        tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    model.eval()
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(path)
    ids = np.arange(3, 14)[None]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    return str(path), ids, ref


def test_disabled_plugin_names_the_package(tiny_gemma, plugins_env):
    path, ids, ref = tiny_gemma
    plugins_env.setenv("RLX_DISABLE_PLUGINS", "gemma")
    reset()
    assert "gemma3_text" not in registry().recipes
    with pytest.raises(ModelError, match="rlx-blocks-gemma"):
        rlx_core.load(path, backend="numpy", progress=False)
    plugins_env.delenv("RLX_DISABLE_PLUGINS")
    reset()
    m = rlx_core.load(path, backend="numpy", progress=False)
    assert np.abs(m.logits(ids) - ref).max() <= 1e-4


def test_disabled_by_distribution_name(tiny_gemma, plugins_env):
    plugins_env.setenv("RLX_DISABLE_PLUGINS", "rlx-blocks-gemma")
    reset()
    with pytest.raises(ModelError, match="rlx-blocks-gemma"):
        rlx_core.load(tiny_gemma[0], backend="numpy", progress=False)


# ------------------------------------------------------------------------------- fresh venv
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import importlib.metadata as md, importlib.util
    import rlx_core
    from rlx_core.plugins import registry
    path = sys.argv[1]
    ids = np.array(json.loads(sys.argv[2]))
    m = rlx_core.load(path, backend="numpy", progress=False)
    print("RESULT " + json.dumps({
        "logits": m.logits(ids).tolist(),
        "generated": m.generate(ids, max_new_tokens=8, min_new_tokens=8).tolist(),
        "recipes": sorted(registry().recipes),
        "dists": sorted(d.metadata["Name"] for d in md.distributions()
                        if d.metadata["Name"].startswith("rlx")),
        "llama_importable": importlib.util.find_spec("rlx_blocks_llama") is not None,
        "rlx_core_file": rlx_core.__file__,
    }))
""")


def _site_packages_farm(dest: str) -> str:
    """A folder of links to this environment's third-party packages, every rlx
    distribution (core, plugins, their editable finders) left out."""
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    os.makedirs(dest)
    for name in os.listdir(site):
        low = name.lower()
        if low.startswith(("rlx", "__editable__")) or low.endswith((".pth", ".egg-link")) or \
                low in ("__pycache__",):
            continue
        os.symlink(os.path.join(site, name), os.path.join(dest, name))
    return dest


def test_fresh_venv_with_core_and_gemma_only(tiny_gemma, tmp_path):
    """`python -m venv --without-pip` (no network: the third-party packages, pip and
    setuptools included, come from this environment through a .pth file to a folder of
    links that leaves every rlx distribution out), then
    `pip install --no-deps --no-build-isolation --no-index -e <core> -e <gemma plugin>`."""
    path, ids, ref = tiny_gemma
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                       capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        pytest.skip(f"cannot create a virtual environment here: {e}")
    py = venv / "bin" / "python"
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    site = out.stdout.strip()
    farm = _site_packages_farm(str(tmp_path / "deps"))
    with open(os.path.join(site, "zz_rlx_test_deps.pth"), "w") as f:
        f.write(farm + "\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RLX_PLUGINS", "RLX_DISABLE_PLUGINS")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "-e", REPO, "-e", PLUGIN_DIR], capture_output=True, text=True, env=env, timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    run = subprocess.run([str(py), "-c", CHILD, path, json.dumps(ids.tolist())], capture_output=True,
                         text=True, env=env, timeout=600, cwd=str(tmp_path))
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and line, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(line[0][7:])
    assert res["dists"] == ["rlx-blocks-gemma", "rlx-core"]
    assert not res["llama_importable"]
    assert "llama" not in res["recipes"] and "qwen3" not in res["recipes"]
    assert {"gemma2", "gemma3", "gemma3_text"} <= set(res["recipes"])
    assert res["rlx_core_file"].startswith(REPO)
    assert np.abs(np.array(res["logits"]) - ref).max() <= 1e-4
    assert len(res["generated"][0]) == ids.shape[1] + 8
