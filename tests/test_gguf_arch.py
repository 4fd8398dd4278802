"""GGUF architectures come from plugins (rlx_register_gguf_architectures): a third-party mapping
loads and writes GGUF files of its own architecture through core's generic reader and writer;
an architecture nobody registered, or one a blocked plugin provides, is a WeightError saying so;
a plugin registering an architecture another plugin owns is refused whole."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rlx_core.ir.errors import PluginError, WeightError
from rlx_core.plugins import RlxPluginWarning, hookimpl, register_plugin, registry, reset, temporary_plugin
from rlx_core.weights import load_checkpoint
from rlx_core.weights.checkpoint import Checkpoint
from rlx_core.weights.gguf_arch import GGUFArchitecture, write_rope_scaling

gguf = pytest.importorskip("gguf")


class ToyGGUF(GGUFArchitecture):
    """A family of its own: a `mix_scale` stored halved, a `toy.factor` key, a mask token."""

    def from_gguf(self, gguf_name, w, config, path):
        return w * np.float32(2.0) if gguf_name.endswith("mix_scale.weight") else w

    def to_gguf(self, gguf_name, w, config, hf):
        return w / np.float32(2.0) if gguf_name.endswith("mix_scale.weight") else w

    def config(self, meta, cfg, held):
        cfg["toy_factor"] = meta.real("toy.factor", 1.0, to="toy_factor")

    def write_metadata(self, writer, cfg, head_dim):
        write_rope_scaling(writer, cfg)
        writer.add_float32(f"{writer.arch}.toy.factor", float(cfg["toy_factor"]))

    def sentencepiece_special_tokens(self):
        return {"mask_token": "<m>"}


TOY = ToyGGUF("toy_lm", "ToyForCausalLM", {"attn_q": "attn.q_proj", "mix_scale": "mix.scale"},
              dropped=frozenset({"scratch.weight"}))


class ToyPlugin:
    @hookimpl
    def rlx_register_gguf_architectures(self, register):
        register("toylm", TOY)


# a sentencepiece vocabulary ('llama' is the GGUF format's name for one)
TOKENS = ["<unk>", "<s>", "</s>", "\u2581a", "a", "b"]


def _toy_gguf(path, arch="toylm", factor=3.0):
    rng = np.random.default_rng(0)
    arrays = {"token_embd.weight": rng.standard_normal((6, 32)), "blk.0.attn_q.weight":
              rng.standard_normal((32, 32)), "blk.0.mix_scale.weight": rng.standard_normal(32),
              "output_norm.weight": rng.standard_normal(32), "scratch.weight": np.zeros(4)}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_float32(f"{arch}.toy.factor", factor)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0])
    w.add_token_types([2, 3, 3, 1, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, a in arrays.items():
        w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path), {k: v.astype(np.float32) for k, v in arrays.items()}


def test_third_party_architecture_loads_its_gguf(tmp_path):
    path, arrays = _toy_gguf(tmp_path / "toy.gguf")
    unknown = r"toy\.gguf: GGUF architecture 'toylm' is not supported.*registered: .*llama"
    with pytest.raises(WeightError, match=unknown):
        load_checkpoint(path)
    with temporary_plugin(ToyPlugin(), "test-toy-gguf"):
        ck = load_checkpoint(path)
        tok = ck.tokenizer
        ids = tok.encode("a b")
    assert ck.config["model_type"] == "toy_lm" and ck.config["architectures"] == ["ToyForCausalLM"]
    assert ck.config["toy_factor"] == 3.0 and "hidden_act" not in ck.config   # no family's defaults
    assert sorted(ck.tensors) == ["model.embed_tokens.weight", "model.layers.0.attn.q_proj.weight",
                                  "model.layers.0.mix.scale.weight", "model.norm.weight"]  # scratch dropped
    np.testing.assert_array_equal(ck.tensors["model.layers.0.mix.scale.weight"],
                                  2 * arrays["blk.0.mix_scale.weight"])
    np.testing.assert_array_equal(ck.tensors["model.layers.0.attn.q_proj.weight"],
                                  arrays["blk.0.attn_q.weight"])
    assert tok.special_tokens["mask_token"] == "<m>" and tok.special_tokens["bos_token"] == "<s>"
    assert ids and all(0 <= i < len(TOKENS) + 1 for i in ids)


def test_third_party_architecture_is_written_by_quantize(tmp_path):
    path, arrays = _toy_gguf(tmp_path / "toy.gguf")
    src = tmp_path / "src"
    src.mkdir()
    with temporary_plugin(ToyPlugin(), "test-toy-gguf"):
        from rlx_core.weights.gguf_write import write_gguf

        ck = load_checkpoint(path)
        hf = Checkpoint(str(src), "safetensors", dict(ck.config), dict(ck.tensors), None)
        dst = tmp_path / "out.gguf"
        write_gguf(hf, dst, "q8_0", echo=lambda *a: None)
        back = load_checkpoint(dst)
        header = gguf.GGUFReader(str(dst))
    assert header.fields["toylm.toy.factor"].parts[-1][0] == 3.0
    assert "blk.0.mix_scale.weight" in {t.name for t in header.tensors}
    np.testing.assert_array_equal(back.tensors["model.layers.0.mix.scale.weight"],
                                  ck.tensors["model.layers.0.mix.scale.weight"])   # halved, doubled back
    np.testing.assert_allclose(back.tensors["model.layers.0.attn.q_proj.weight"],
                               ck.tensors["model.layers.0.attn.q_proj.weight"], atol=0.05)
    assert back.config["model_type"] == "toy_lm" and back.config["toy_factor"] == 3.0


def test_quantize_of_a_model_type_no_plugin_maps(tmp_path):
    from rlx_core.weights.gguf_write import write_gguf

    cfg = {"model_type": "toy_lm", "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1,
           "intermediate_size": 64, "vocab_size": 6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ck = Checkpoint(str(tmp_path), "safetensors", cfg, {}, None)
    with pytest.raises(WeightError, match=r"model_type 'toy_lm' cannot be written to GGUF; "
                                          r"supported: .*'llama'"):
        write_gguf(ck, tmp_path / "out.gguf", "q8_0")


def test_an_architecture_another_plugin_owns_is_refused_whole(tmp_path):
    class Thief:
        @hookimpl
        def rlx_register_gguf_architectures(self, register):
            register("toylm", TOY)
            register("llama", TOY)

    taken = "gguf architecture 'llama' is registered by both 'llama' and 'thief'"
    with pytest.warns(RlxPluginWarning, match="thief"), pytest.raises(PluginError, match=taken):
        register_plugin(Thief(), "thief")
    reg = registry()
    assert "toylm" not in reg.gguf_architectures                          # nothing of it stays
    assert reg.owner[("gguf architecture", "llama")] == "llama"
    assert reg.gguf_architectures["llama"].model_type == "llama"         # the owner keeps working
    with temporary_plugin(ToyPlugin(), "test-toy-gguf"):                 # and so do the others
        assert load_checkpoint(_toy_gguf(tmp_path / "toy.gguf")[0]).config["model_type"] == "toy_lm"


def test_a_mapping_that_is_not_a_gguf_architecture(tmp_path):
    class Wrong:
        @hookimpl
        def rlx_register_gguf_architectures(self, register):
            register("toylm", {"model_type": "toy_lm"})

    path, _ = _toy_gguf(tmp_path / "toy.gguf")
    with temporary_plugin(Wrong(), "test-wrong-gguf"), pytest.raises(
            PluginError, match=r"plugin 'test-wrong-gguf' registered GGUF architecture 'toylm' as dict; "
                               r"expected a rlx_core.weights.gguf_arch.GGUFArchitecture"):
        load_checkpoint(path)


def test_blocked_family_gguf_names_its_package(tmp_path, plugins_env):
    path, _ = _toy_gguf(tmp_path / "g.gguf", arch="gemma3")
    plugins_env.setenv("RLX_DISABLE_PLUGINS", "gemma")
    reset()
    with pytest.raises(WeightError, match=r"g\.gguf: GGUF architecture 'gemma3' is not supported.*"
                                          r"rlx-blocks-gemma provides it but is not loaded"):
        load_checkpoint(path)
