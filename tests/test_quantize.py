"""`rlx quantize`'s destination (issue 41, 2.2 and 2.8): never a file of the source model,
written whole or not at all, and a path it cannot write is the project's error naming it, told
before the load where the path alone says so; then hypothesis over its arguments (schemes,
sources, destinations): each run writes a GGUF or exits with `error: ...`, never a traceback,
and the source is never changed."""
from __future__ import annotations

import hashlib
import os
import pathlib

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx_core.cli import main
from rlx_core.weights import load_checkpoint

from tiny_models import tiny_llama_folder

gguf = pytest.importorskip("gguf")
IN_CI = bool(os.environ.get("CI"))      # as test_fuzz_loaders: CI replays a fixed set


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> pathlib.Path:
    return pathlib.Path(tiny_llama_folder(tmp_path_factory.mktemp("q") / "src"))


def _quantize(*args):
    return CliRunner().invoke(main, ["quantize", *map(str, args)])


def _digests(folder: pathlib.Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


def _refused(r, *words) -> None:
    """Exit 2 with one `error:` line naming `words`: the project's error, no traceback."""
    assert r.exit_code == 2 and r.output.startswith("error: "), (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and all(str(w) in r.output for w in words), r.output


def _no_partial(folder: pathlib.Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".part")]


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_file_of_the_source_is_never_the_destination(src, tmp_path, name):
    before = _digests(src)
    link, hard = tmp_path / "link.gguf", tmp_path / "hard.gguf"
    link.symlink_to(src / name)
    os.link(src / name, hard)
    for dst in (src / name, src / ".." / src.name / name, link, hard):
        _refused(_quantize(src, dst), dst, name, "a file of the source model")
    _refused(_quantize(src / "model.safetensors", src / name), name, "a file of the source model")
    assert _digests(src) == before
    assert link.is_symlink() and hard.read_bytes() == (src / name).read_bytes()


def test_a_gguf_beside_the_source_is_written_and_rewritten(src):
    """The source folder's GGUF files are not its inputs: a second run replaces the first's."""
    before = _digests(src)
    dst = src / "m.q8_0.gguf"
    try:
        for _ in range(2):
            r = _quantize(src, dst)
            assert r.exit_code == 0, r.output
            assert load_checkpoint(dst).format == "gguf"
    finally:
        dst.unlink(missing_ok=True)
    assert _digests(src) == before


def _bad_destinations(src: pathlib.Path, tmp: pathlib.Path) -> dict:
    """dst -> what the error says, for paths wrong before anything is loaded."""
    (tmp / "d").mkdir()
    return {tmp / "missing" / "m.gguf": "does not exist", src / "config.json" / "m.gguf": "not a folder",
            tmp / "d": "is a folder", f"{tmp / 'new'}{os.sep}": "is a folder", "": "is empty"}


def test_a_bad_destination_is_named_before_the_load(src, tmp_path, monkeypatch):
    import rlx_core.weights

    def no_load(*a, **k):
        raise AssertionError("the destination must be checked before the source is loaded")

    monkeypatch.setattr(rlx_core.weights, "load_checkpoint", no_load)
    for dst, why in _bad_destinations(src, tmp_path).items():
        _refused(_quantize(src, dst), repr(str(dst)) if why == "is a folder" else dst, why)
        assert not os.path.isfile(dst) if dst else True


def test_a_device_is_not_replaced(src):
    """Renaming a finished file over /dev/null would replace the device (tests run as root)."""
    import stat

    _refused(_quantize(src, os.devnull), os.devnull, "is not a regular file")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("dst", ["/proc", "/proc/m.gguf"])
def test_proc_is_refused(src, dst):
    """/proc takes no new file, even for root (tests run as root: a chmod'ed folder would not fail)."""
    _refused(_quantize(src, dst), dst, "is a folder" if dst == "/proc" else "cannot write a file in /proc")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: /proc covers it")
def test_a_read_only_folder_is_refused(src, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    _refused(_quantize(src, ro / "m.gguf"), ro / "m.gguf", "cannot write a file in")
    assert list(ro.iterdir()) == []


def test_a_failed_run_leaves_the_old_file_and_no_partial(src, tmp_path, monkeypatch):
    dst = tmp_path / "m.gguf"
    dst.write_bytes(b"the old file")
    real = gguf.GGUFWriter.write_tensors_to_file

    def full_disk(self, *a, **k):
        self.fout[0].write(b"\0" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    _refused(_quantize(src, dst), dst, "cannot write (No space left on device)")
    assert dst.read_bytes() == b"the old file"
    _no_partial(tmp_path)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", real)
    assert _quantize(src, dst).exit_code == 0 and load_checkpoint(dst).format == "gguf"
    _no_partial(tmp_path)


def test_a_tensor_gguf_cannot_name_leaves_no_partial(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = pathlib.Path(tiny_llama_folder(tmp_path / "src"))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, "model.extra.weight": tensors["model.norm.weight"]}, str(src / "model.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    _refused(_quantize(src, out / "m.gguf"), "model.extra.weight")
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------------------------------------- fuzzing

SCHEMES = st.one_of(
    st.sampled_from(["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8", "int4",
                     "int8_b64", "INT4_B16", "Q8_0", "int8_b0", "int4_b7", "int8_b999999999999", "q9_0",
                     "", "f32", "q8_0 "]),
    st.text(max_size=8))
SOURCES = ["folder", "folder/", "weights file", "config file", "missing", "empty folder", "gguf", "text"]
DESTS = ["new", "in source", "source weights", "source config", "link to source", "folder", "missing folder",
         "under a file", "proc", "device", "empty", "slash", "existing", "text"]


def _fuzz_paths(tmp: pathlib.Path, src: pathlib.Path, source: str, dest: str, text: str):
    tmp.mkdir()
    (tmp / "empty").mkdir()
    (tmp / "existing.gguf").write_bytes(b"old")
    gguf_file = tmp / "other.gguf"
    w = gguf.GGUFWriter(str(gguf_file), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp / "link.gguf").symlink_to(src / "model.safetensors")
    s = {"folder": src, "folder/": f"{src}{os.sep}", "weights file": src / "model.safetensors",
         "config file": src / "config.json", "missing": tmp / "nope", "empty folder": tmp / "empty",
         "gguf": gguf_file, "text": tmp / text}[source]
    d = {"new": tmp / "new.gguf", "in source": src / "fuzz.gguf", "source weights": src / "model.safetensors",
         "source config": src / "config.json", "link to source": tmp / "link.gguf", "folder": tmp,
         "missing folder": tmp / "no" / "m.gguf", "under a file": src / "config.json" / "m.gguf",
         "proc": "/proc/m.gguf", "device": os.devnull, "empty": "", "slash": f"{tmp / 'x'}{os.sep}",
         "existing": tmp / "existing.gguf",
         "text": tmp / text}[dest]
    return s, d


FUZZ = settings(max_examples=60, deadline=None, derandomize=IN_CI,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0/"),
                min_size=1, max_size=6)


@FUZZ
@given(SCHEMES, st.sampled_from(SOURCES), st.sampled_from(DESTS), NAMES)
def test_quantize_arguments(src, tmp_path_factory, scheme, source, dest, text):
    tmp = tmp_path_factory.mktemp("fuzz") / "t"
    s, d = _fuzz_paths(tmp, src, source, dest, text)
    before = _digests(src)
    r = CliRunner().invoke(main, ["quantize", str(s), str(d), "--scheme", scheme])
    try:
        assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exception)
        assert "Traceback" not in r.output and (r.exit_code == 0 or r.output.startswith("error: ")), r.output
        if r.exit_code == 0:
            assert load_checkpoint(d).format == "gguf"
    finally:
        (src / "fuzz.gguf").unlink(missing_ok=True)       # the one file a run may add to the source
    assert _digests(src) == before
    _no_partial(tmp)
    _no_partial(src)


# what write_gguf reads from a config, set to values of every JSON type
CONFIG_KEYS = ["model_type", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
               "intermediate_size", "num_hidden_layers", "vocab_size", "max_position_embeddings",
               "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "bos_token_id",
               "eos_token_id", "pad_token_id", "sliding_window", "layer_types", "query_pre_attn_scalar"]
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.sampled_from([2**31, 2**64, -(2**63)]), st.floats(),
    st.text(max_size=4), st.sampled_from(["llama", "gemma3_text", "gemma2", "qwen3", "bert", "linear"]),
    st.lists(st.integers(-1, 3), max_size=3), st.fixed_dictionaries({"rope_type": st.sampled_from(
        ["linear", "default", "yarn", 3]), "factor": st.one_of(st.floats(), st.text(max_size=2))}))


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, min_size=1, max_size=3),
       st.sampled_from(["q8_0", "int8_b16", "q4_k"]))
def test_quantize_sources(src, tmp_path_factory, changes, scheme):
    """The source's config changed: a GGUF whose config RLX reads back, or the project's error."""
    import json
    import shutil

    tmp = tmp_path_factory.mktemp("src")
    bad = tmp / "src"
    shutil.copytree(src, bad)
    cfg = {**json.loads((src / "config.json").read_text()), **changes}
    (bad / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["quantize", str(bad), str(tmp / "m.gguf"), "--scheme", scheme])
    assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and (r.exit_code == 0 or r.output.startswith("error: ")), r.output
    if r.exit_code == 0:
        assert load_checkpoint(tmp / "m.gguf").format == "gguf"
    _no_partial(tmp)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_float_files_hold_each_matmul_weight_rounded_once(src, tmp_path, kind):
    """`-s f16` / `-s bf16` write llama.cpp's F16 / BF16 files: every matmul weight in that type,
    each value the source's rounded to nearest even (ml_dtypes here, not the writer's path), norms
    in f32, and the file runs like its source."""
    import ml_dtypes
    import numpy as np

    import rlx_core

    dst = tmp_path / f"m.{kind}.gguf"
    r = _quantize(src, dst, "-s", kind)
    assert r.exit_code == 0 and f"weights in {kind}," in r.output, r.output
    gtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}[kind]
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[kind]
    reader = gguf.GGUFReader(dst)
    assert int(reader.fields["general.file_type"].parts[-1][0]) == ftype
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {gtype}
    assert {t.tensor_type for t in reader.tensors if t.name.endswith("norm.weight")} == {gguf.GGMLQuantizationType.F32}

    dtype = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}[kind]
    source, written = load_checkpoint(src), load_checkpoint(dst)
    matrices = [n for n, t in source.tensors.items() if np.asarray(t).ndim == 2]
    assert matrices
    for name in matrices:
        want = np.asarray(source.tensors[name], np.float32).astype(dtype).astype(np.float32)
        assert np.array_equal(np.asarray(written.tensors[name], np.float32), want), name

    ids = np.array([[1, 5, 9, 2, 7]])
    ref = rlx_core.load(str(src), backend="numpy", progress=False).logits(ids)
    got = rlx_core.load(str(dst), backend="numpy", progress=False).logits(ids)
    tol = {"f16": 2e-3, "bf16": 2e-2}[kind]
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
