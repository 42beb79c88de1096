"""Data: tokenizer round trips, prepare-data memmaps (atomic, dtype, errors), the built-in corpus,
the deterministic resumable sampler, and tokens per step independent of the parallel layout."""
import json
import os
import sys

import numpy as np
import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.runtime.data import (
    BPETokenizer,
    ByteTokenizer,
    Sampler,
    TokenDataset,
    builtin_corpus_text,
    ensure_builtin_data,
    prepare_data,
    token_dtype,
    train_bpe,
)
from jaxhybrid.runtime.data import prepare as prepare_mod

SAMPLES = ["In the beginning God created the heaven and the earth.", "  leading spaces\n\nand blank lines\n",
           "ünïcödé — “quotes” 😀 and 中文", ""]


@pytest.fixture(scope="module")
def corpus_head():
    return builtin_corpus_text()[:200_000]


@pytest.fixture(scope="module")
def bpe(corpus_head):
    return train_bpe(corpus_head, 400)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids == list(s.encode("utf-8")) and tok.decode(ids) == s
    assert tok.vocab_size == 256


def test_bpe_round_trip_compresses_and_reloads(bpe, corpus_head, tmp_path):
    assert 256 < bpe.vocab_size <= 400
    for s in SAMPLES + [corpus_head[:5000]]:
        assert bpe.decode(bpe.encode(s)) == s  # byte-level: even unseen characters round-trip
    verse = corpus_head[:2000]
    assert len(bpe.encode(verse)) < 0.7 * len(verse.encode("utf-8"))  # merges learned from the text
    assert bpe.encode_array(verse).tolist() == bpe.encode(verse)  # line-wise fast path is exact here
    bpe.save(tmp_path / "tok.json")
    again = BPETokenizer.load(tmp_path / "tok.json")
    assert again.encode(verse) == bpe.encode(verse) and again.vocab_size == bpe.vocab_size
    assert train_bpe(corpus_head, 400).encode(verse) == bpe.encode(verse)  # training is deterministic
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe("abc", 100)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_prepare_small_file_byte(tmp_path):
    text = ("".join(SAMPLES) + "\n") * 20
    src = _write(tmp_path, "in.txt", text)
    out = prepare_data(tmp_path / "out", [src], "byte", val_fraction=0.1)
    meta = json.loads((out / "meta.json").read_text())
    raw = text.encode("utf-8")
    n_val = int(len(raw) * 0.1)
    assert meta["dtype"] == "uint8" and meta["vocab_size"] == 256 and meta["tokenizer"] == "byte"
    assert meta["n_tokens"] == len(raw) and meta["splits"] == {"train": len(raw) - n_val, "val": n_val}
    assert meta["source"] == [str(src.resolve())]
    train, val = TokenDataset(out, "train"), TokenDataset(out / "meta.json", "val")
    assert train.tokens.dtype == np.uint8 and len(train) + len(val) == len(raw)
    assert (out / "train.bin").stat().st_size == len(train)  # one byte a token
    assert bytes(np.concatenate([train.tokens, val.tokens])) == raw  # val is the tail
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no temp files left


def test_prepare_small_files_bpe(tmp_path, corpus_head):
    a, b = _write(tmp_path, "a.txt", corpus_head[:30_000]), _write(tmp_path, "b.txt", "second file ünï")
    out = prepare_data(tmp_path / "out", [a, b], "bpe", vocab_size=300, val_fraction=0.05)
    ds_t, ds_v = TokenDataset(out, "train"), TokenDataset(out, "val")
    assert ds_t.meta["tokenizer"] == "bpe" and (out / "tokenizer.json").is_file()
    tok = ds_t.tokenizer()
    assert tok.vocab_size == ds_t.vocab_size <= 300
    decoded = tok.decode(np.concatenate([ds_t.tokens, ds_v.tokens]).tolist())
    assert decoded == corpus_head[:30_000] + "\nsecond file ünï\n"  # files joined, each newline-terminated


def test_token_dtype_choice():
    assert token_dtype(1) == np.uint8 and token_dtype(256) == np.uint8  # bytes: ids up to 255 (were uint16)
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16  # ids up to 65535
    assert token_dtype(65537) == np.uint32 and token_dtype(200_000) == np.uint32


def test_byte_data_prepared_as_uint16_still_reads_and_resumes(tmp_path):
    """Byte data prepared before bytes were stored as uint8: its meta.json says uint16, which the reader
    follows, and its fingerprint (held by its checkpoints) is that of the same tokens prepared now, so a
    resume after preparing the data again is not refused."""
    src = _write(tmp_path, "in.txt", "".join(SAMPLES) * 50)
    new = prepare_data(tmp_path / "new", [src], "byte", val_fraction=0.1)
    old = tmp_path / "old"
    old.mkdir()
    meta = json.loads((new / "meta.json").read_text())
    for split in ("train", "val"):
        np.fromfile(new / f"{split}.bin", np.uint8).astype(np.uint16).tofile(old / f"{split}.bin")
    (old / "meta.json").write_text(json.dumps({**meta, "dtype": "uint16"}))
    a, b = TokenDataset(old), TokenDataset(new)
    assert a.tokens.dtype == np.uint16 and np.array_equal(a.tokens, b.tokens)
    assert a.fingerprint() == b.fingerprint()
    saved = Sampler(a, 16, 4, 0).state_dict(step=3)
    assert Sampler(b, 16, 4, 0).mismatches(saved) == [] and np.array_equal(Sampler(a, 16, 4, 0).batch(3),
                                                                             Sampler(b, 16, 4, 0).batch(3))


def test_builtin_corpus_byte_cached(tmp_path):
    text = builtin_corpus_text()
    assert text.startswith("Genesis\nIn the beginning God created the heaven and the earth.\n")
    assert len(text) > 4_000_000 and "bible" not in sys.modules  # read as a data file, never imported
    d = ensure_builtin_data(tmp_path / "cache", "byte")
    ds = TokenDataset(d)
    assert ds.meta["n_tokens"] == len(text.encode("utf-8")) and ds.meta["source"] == [prepare_mod.BUILTIN_SOURCE]
    mtime = (d / "train.bin").stat().st_mtime_ns
    assert ensure_builtin_data(tmp_path / "cache", "byte") == d  # second call reuses the cache
    assert (d / "train.bin").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="tokenizer='words'"):
        ensure_builtin_data(tmp_path / "cache", "words")


@pytest.mark.slow
def test_concurrent_ranks_prepare_the_cache_once(tmp_path):
    # MPI ranks start together and share the cache: they serialise on a lock and agree on one directory.
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(3) as pool:
        dirs = pool.starmap(ensure_builtin_data, [(str(tmp_path), "byte")] * 3)
    assert len(set(dirs)) == 1
    ds = TokenDataset(dirs[0])
    assert ds.meta["n_tokens"] == len(builtin_corpus_text().encode("utf-8"))
    assert not [f for f in os.listdir(dirs[0]) if f.endswith(".tmp")]


def test_missing_input_raises_before_writing(tmp_path):
    ok = _write(tmp_path, "ok.txt", "some text\n")
    missing = tmp_path / "nope" / "missing.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        prepare_data(tmp_path / "out", [ok, missing])
    with pytest.raises(ValueError, match=rf"input {tmp_path} is a folder; give its text files, e.g. --input "
                                         rf"{tmp_path}/\*.txt"):
        prepare_data(tmp_path / "out", [tmp_path])
    assert not (tmp_path / "out").exists()


def test_interrupted_prepare_leaves_no_loadable_dataset(tmp_path, monkeypatch):
    src = _write(tmp_path, "in.txt", "first version of the text\n" * 50)
    out = prepare_data(tmp_path / "out", [src])
    real = os.replace

    def crash_on_val(a, b):
        if str(b).endswith("val.bin"):
            raise OSError("disk full (simulated)")
        return real(a, b)

    monkeypatch.setattr(prepare_mod.os, "replace", crash_on_val)
    with pytest.raises(OSError, match="simulated"):
        prepare_data(out, [_write(tmp_path, "in2.txt", "a longer second version\n" * 80)])
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="meta.json"):  # new train.bin + old meta never mix
        TokenDataset(out)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="/nonexistent/tokens"):
        TokenDataset("/nonexistent/tokens")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TokenDataset(tmp_path / "empty")
    text = _write(tmp_path, "in.txt", "hello world\n" * 10)
    out = prepare_data(tmp_path / "out", [text])
    with pytest.raises(FileNotFoundError, match=rf"data path {text} is a file, not a prepared dataset; tokenize it "
                                                rf"first: `jaxhybrid prepare-data --out DIR --input {text}`"):
        TokenDataset(text)
    ds = TokenDataset(out)
    ds.check_vocab(256)
    with pytest.raises(ValueError, match=r"model.vocab_size=128 .* 256"):
        ds.check_vocab(128)
    with open(out / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="prepare the data again"):
        TokenDataset(out)


@pytest.fixture(scope="module")
def small_ds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small")
    src = tmp / "in.txt"
    src.write_text(builtin_corpus_text()[:20_000], encoding="utf-8")
    return TokenDataset(prepare_data(tmp / "out", [src], val_fraction=0.0))


def test_sampler_is_pure_in_seed_and_step(small_ds):
    a, b = Sampler(small_ds, 32, 8, seed=3), Sampler(small_ds, 32, 8, seed=3)
    for step in (0, 5, 1000, 2):
        x = a.batch(step)
        assert x.shape == (8, 33) and x.dtype == np.int32
        np.testing.assert_array_equal(x, b.batch(step))
        for row, s in zip(x, a.starts(step)):  # each row is a real window of the stream
            np.testing.assert_array_equal(row, small_ds.tokens[s:s + 33])
    assert not np.array_equal(a.batch(0), Sampler(small_ds, 32, 8, seed=4).batch(0))
    assert not np.array_equal(a.batch(0), a.batch(1))


def test_sampler_epochs_cover_every_window_once(small_ds):
    s = Sampler(small_ds, 32, 7, seed=0)
    w = s.n_windows
    steps = -(-3 * w // 7)  # three epochs and a bit
    starts = np.concatenate([s.starts(i) for i in range(steps)])
    assert starts.min() >= 0 and starts.max() + 33 <= len(small_ds)
    for e in range(3):
        ep = starts[e * w:(e + 1) * w]
        offsets = ep % 32
        assert len(set(offsets.tolist())) == 1  # one shift per epoch
        assert sorted(((ep - offsets) // 32).tolist()) == list(range(w))  # a permutation of the windows


def test_sampler_resume(small_ds):
    first = Sampler(small_ds, 16, 4, seed=7)
    for _ in range(11):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    assert state["step"] == 11 and first.state_dict(5)["step"] == 5
    resumed = Sampler(small_ds, 16, 4, seed=7)
    resumed.load_state_dict(state)
    for _ in range(3):
        np.testing.assert_array_equal(resumed.next_batch(), first.next_batch())
    with pytest.raises(ValueError, match="seed: checkpoint 7 != current 8"):
        Sampler(small_ds, 16, 4, seed=8).load_state_dict(state)


def test_sampler_rejects_short_data(small_ds):
    with pytest.raises(ValueError, match="lower data.seq_len"):
        Sampler(small_ds, len(small_ds), 2, seed=0)


@pytest.mark.parametrize("data,microbatches", [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2), (8, 1)])
def test_tokens_per_step_independent_of_layout(small_ds, data, microbatches):
    from jaxhybrid.runtime.engines.base import split_batch

    batch = Sampler(small_ds, 16, 8, seed=1).batch(3)
    parts = [split_batch(batch, r, data, microbatches) for r in range(data)]
    assert all(p.shape == (microbatches, 8 // (data * microbatches), 17) for p in parts)
    # Replicas in order, microbatches in order: exactly the global batch, each row once.
    np.testing.assert_array_equal(np.concatenate([p.reshape(-1, 17) for p in parts]), batch)


def test_cli_prepare_data(tmp_path, capsys):
    src = _write(tmp_path, "in.txt", "hello there\n" * 100)
    assert main(["prepare-data", "--out", str(tmp_path / "out"), "--input", str(src), "--val-fraction", "0.1"]) == 0
    line = capsys.readouterr().out.strip()
    assert len(line.splitlines()) == 1 and "1,200 tokens (train 1,080, val 120)" in line
    rc = main(["prepare-data", "--out", str(tmp_path / "bad"), "--input", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "missing.txt" in err and len(err.splitlines()) == 1 and not (tmp_path / "bad").exists()
    # A prepared dataset is not replaced unless asked (runs trained on it resume from its tokens).
    before = (tmp_path / "out" / "train.bin").read_bytes()
    other = _write(tmp_path, "other.txt", "something else entirely\n" * 50)
    assert main(["prepare-data", "--out", str(tmp_path / "out"), "--input", str(other)]) == 2
    assert capsys.readouterr().err == (f"jaxhybrid prepare-data: error: --out {tmp_path}/out already holds a prepared "
                                       f"dataset (meta.json); choose another --out, or pass --overwrite to replace it\n")
    assert (tmp_path / "out" / "train.bin").read_bytes() == before
    assert main(["prepare-data", "--out", str(tmp_path / "out"), "--input", str(other), "--overwrite"]) == 0
    assert (tmp_path / "out" / "train.bin").read_bytes() != before


def test_cli_prepare_data_out_that_is_a_file(tmp_path, capsys, monkeypatch):
    """--out naming an existing file (or a path under one) is one error line naming it, before the corpus is
    read; it used to be a FileExistsError traceback after the tokenizing."""
    monkeypatch.setattr("jaxhybrid.cli.commands.prepare_data.prepare_data", lambda *a, **k: pytest.fail("prepared anyway"))
    (tmp_path / "c1.yaml").write_text("")
    for out, says in ((tmp_path / "c1.yaml", f"--out {tmp_path}/c1.yaml is a file; give a directory"),
                      (tmp_path / "c1.yaml" / "sub", f"--out {tmp_path}/c1.yaml/sub cannot be written: "
                                                     f"{tmp_path}/c1.yaml is not a directory")):
        assert main(["prepare-data", "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"jaxhybrid prepare-data: error: {says}\n"


def test_repetition_notes_name_a_split_too_small_for_a_batch_or_the_evaluation(tmp_path):
    """A batch wider than the train split, or more evaluation sequences than the val split holds, reads
    windows twice; the trainer's writer prints these notes (commands/train.py), since the loss shows nothing."""
    from jaxhybrid.runtime.config_load import load_config
    from jaxhybrid.runtime.data.splits import repetition_notes

    src = _write(tmp_path, "in.txt", "abcdefghij" * 40)  # 401 bytes (a newline ends it): 201 train, 200 val
    out = prepare_data(tmp_path / "d", [src], "byte", val_fraction=0.5)

    def notes(batch, evals, every=1, steps=1):
        return repetition_notes(load_config(None, [f"data.path={out}", "model.name=gpt-tiny", "data.seq_len=8",
                                                   f"train.global_batch={batch}", f"train.eval_batches={evals}",
                                                   f"train.eval_every={every}", f"train.steps={steps}"]))

    assert notes(8, 2) == [] and notes(8, 2, steps=3) == []  # 24 sequences of the 24 windows: one epoch
    assert notes(8, 2, steps=30) == ["train.steps=30 x train.global_batch=8 = 240 sequences: 10.0 passes over the "
                                     "24 windows of the train split (each window is read more than once)"]
    assert notes(8, 4) == ["train.eval_batches=4 x train.global_batch=8 = 32 sequences, but the val split holds "
                           "23 windows: each evaluation repeats them (eval_batches=3 reads them all)"]
    wide, evals = notes(32, 1)
    assert "holds 201 tokens, 24 windows of data.seq_len + 1 = 9: fewer than train.global_batch=32" in wide
    assert evals.endswith("(fewer than one batch: prepare the data with a larger val_fraction)")
    assert len(notes(32, 1, every=0)) == 1  # no evaluation, no evaluation note
