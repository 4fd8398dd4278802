"""Which package provides a model type: rlx_core.plugins.provider_of / provider_hint (the
providers.toml table and the registry), and the error for a checkpoint whose family's plugin
is blocked or absent."""
from __future__ import annotations

import json

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError, PluginError, RlxError
from rlx_core.plugins import hookimpl, manager, provider_hint, provider_of, temporary_plugin
from rlx_core.plugins.providers import known_providers


pytestmark = pytest.mark.usefixtures("plugins_env")   # rlx_core.testing: plugins afresh


def hf_folder(tmp_path, model_type: str):
    """A tiny HF folder: a config naming `model_type` and one tensor."""
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_the_table_maps_names_to_distributions():
    tables = known_providers()
    assert set(tables) == {"model_types", "packaged_models"}
    assert all(d.startswith("rlx-") for rows in tables.values() for d in rows.values())
    assert provider_of("no-such-type") == "" and provider_hint("no-such-type") == ""
    with pytest.raises(PluginError, match="no table of providers 'nope'"):
        provider_of("gemma3", "nope")


def test_a_registered_name_is_answered_by_its_plugins_distribution():
    class Recipe:
        model_types = ["toy_provided"]
        name = "toy"

        def build(self, ckpt, **kw):
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def rlx_register_recipes(self, register):
            register(Recipe())

    assert provider_of("toy_provided") == ""
    with temporary_plugin(Plugin(), "toy-provider"):
        info = next(i for i in manager.plugin_infos() if i.name == "toy-provider")
        info.package = "rlx-toy"
        assert provider_of("toy_provided") == "rlx-toy"


@pytest.mark.parametrize("dist,model_type", [(known_providers()["model_types"][t], t)
                                             for t in ("gemma3_text", "bert")])
def test_blocked_family_names_model_type_and_package(tmp_path, monkeypatch, dist, model_type):
    folder = hf_folder(tmp_path, model_type)
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", dist)
    manager.reset()
    with pytest.raises(ModelError) as e:
        rlx_core.load(folder, progress=False)
    msg = str(e.value)
    assert f"unknown architecture {model_type!r} in {folder}" in msg
    assert f"{dist} provides it but is not loaded: blocked by RLX_DISABLE_PLUGINS" in msg


def tiny_gguf(path, architecture: str) -> str:
    """A GGUF file of `architecture`: one layer's worth of keys, two tensors."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    for name, shape in [("token_embd.weight", (8, 64)), ("blk.0.attn_norm.weight", (64,))]:
        w.add_tensor(name, np.ones(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_blocked_family_gguf_names_the_package(tmp_path, monkeypatch):
    """A GGUF file fails like an HF folder: naming what it is and the package that provides it
    (whether the GGUF loader or the recipe lookup says so)."""
    path = tiny_gguf(tmp_path / "t.gguf", "gemma3")
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "rlx-blocks-gemma")
    manager.reset()
    with pytest.raises(RlxError, match=r"'gemma3(_text)?'.*rlx-blocks-gemma provides it but is not loaded: "
                                       r"blocked by RLX_DISABLE_PLUGINS"):
        rlx_core.load(path, progress=False)


def test_absent_family_says_what_to_install(tmp_path, monkeypatch):
    """An absent plugin: every plugin filtered out, none of the family's plugin infos left."""
    folder = hf_folder(tmp_path, "gemma3_text")
    monkeypatch.setattr(manager, "_entry_points", lambda: [])
    manager.reset()
    with pytest.raises(ModelError, match=r"unknown architecture 'gemma3_text'.*rlx-blocks-gemma provides "
                                         r"it: pip install rlx-blocks-gemma"):
        rlx_core.load(folder, progress=False)


def test_unknown_family_names_no_package(tmp_path):
    folder = hf_folder(tmp_path, "no_such_family")
    with pytest.raises(ModelError) as e:
        rlx_core.load(folder, progress=False)
    assert "unknown architecture 'no_such_family'" in str(e.value) and "provides" not in str(e.value)
