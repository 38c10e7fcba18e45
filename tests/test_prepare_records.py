"""prepare's records inputs (jaxtrain/prepare_records.py): JSON Lines, plain, gzip or zstd, and Parquet files give a
document a record; each format's refusals name the file and where in it. The expected tokens are computed here, from
the documents as written (tiktoken's encode_ordinary and <|endoftext|> after each for gpt2, their UTF-8 for bytes)."""

import gzip
import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxtrain import data, gpt2_bpe, prepare, prepare_records

DOCS = ["Hello world", "naïve café\r\nsecond line\n", "<|endoftext|> written in a document", "", "  spaces ",
        "日本語のテキスト", "x" * 3000, "tab\tand \"quotes\" and \\ backslash", "emoji 😀 after"]


def _jsonl_lines(docs: list, field: str = "text") -> bytes:
    return b"".join(json.dumps({"id": i, field: doc}).encode() + b"\n" for i, doc in enumerate(docs))


def _write(path: pathlib.Path, docs: list, field: str = "text", kind=pa.large_string()) -> pathlib.Path:
    """`docs` as records of `path`'s format: a gzip file of two members, a zstd file of two frames, a Parquet file
    of two row groups (its column of type `kind`), as the tools that write them in pieces do."""
    half = len(docs) // 2
    first, second = _jsonl_lines(docs[:half], field), _jsonl_lines(docs[half:], field)
    name = path.name.lower()
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(first) + gzip.compress(second))
    elif name.endswith(".zst"):
        compressor = zstandard.ZstdCompressor()
        path.write_bytes(compressor.compress(first) + compressor.compress(second))
    elif name.endswith(".parquet"):
        column = pa.array(docs, pa.string()).cast(kind) if docs else pa.array([], kind)
        pq.write_table(pa.table({"id": list(range(len(docs))), field: column}), path, row_group_size=max(half, 1))
    else:
        path.write_bytes(first + second)
    return path


def _tokens(out: pathlib.Path) -> np.ndarray:
    return np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])


def _expected(parts: list, tokenizer: str) -> np.ndarray:
    """The tokens of `parts` (each a document's text) written out: GPT-2's of each then <|endoftext|>, or UTF-8."""
    if tokenizer == "bytes":
        return np.frombuffer("".join(parts).encode(), np.uint8).astype(np.uint16)
    enc = gpt2_bpe.encoding()
    return np.array([t for part in parts for t in enc.encode_ordinary(part) + [enc.eot_token]], np.uint16)


def _prepare_cli(capsys, *args: str) -> tuple[int, str]:
    try:
        data.main(["prepare", *args, "--tokenizer", "bytes"])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_every_format_gives_a_document_a_record_in_the_folders_order(tmp_path, monkeypatch, tokenizer):
    """A folder of the four formats and a text file, read in small chunks, batches and pieces (so that lines, frames
    and documents are cut across them): the tokens of each file's documents, in the folder's sorted order, the
    text file's as one document; split into train and val as text is."""
    folder = tmp_path / "in"
    folder.mkdir()
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
    for name, docs in zip(names, [DOCS, DOCS[::-1], DOCS[2:], DOCS[:5]]):
        _write(folder / name, docs)
    (folder / "e.txt").write_text("a text file\nbeside them\n", encoding="utf-8")
    for module, name, value in [(prepare_records, "CHUNK_BYTES", 37), (prepare_records, "BATCH_CHARS", 50),
                                (prepare_records, "PARQUET_BATCH_ROWS", 2), (prepare, "PIECE_BYTES", 100)]:
        monkeypatch.setattr(module, name, value)
    prepare.prepare([str(folder)], str(tmp_path / "out"), tokenizer, 0.1, workers=2)
    expected = _expected(DOCS + DOCS[::-1] + DOCS[2:] + DOCS[:5] + ["a text file\nbeside them\n"], tokenizer)
    n_val = int(len(expected) * 0.1)
    assert np.fromfile(tmp_path / "out" / "train.bin", np.uint16).tolist() == expected[:-n_val].tolist()
    assert np.fromfile(tmp_path / "out" / "val.bin", np.uint16).tolist() == expected[-n_val:].tolist()


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "A.JSONL", "c4.json.gz",
                                  "b.ndjson.zst", "b.ndjson"])
def test_the_bytes_read_add_up_to_each_files_size(tmp_path, monkeypatch, name):
    """The progress bar's bytes: every batch's, compressed where the file is, adding up to the file's size (the bar's
    total)."""
    monkeypatch.setattr(prepare_records, "BATCH_CHARS", 100)
    monkeypatch.setattr(prepare_records, "PARQUET_BATCH_ROWS", 3)
    path = _write(tmp_path / name, DOCS * 3)
    batches = list(prepare_records.batches(path, "text"))
    assert len(batches) > 3 and sum(n for _, n in batches) == path.stat().st_size
    assert [text for texts, _ in batches for text in texts] == DOCS * 3


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.parquet"])
def test_a_file_of_no_records_gives_no_text_and_its_whole_size(tmp_path, name):
    path = _write(tmp_path / name, [])
    assert path.stat().st_size > 0 and list(prepare_records.batches(path, "text")) == [([], path.stat().st_size)]


@pytest.mark.parametrize("name", ["a.jsonl", "a.parquet"])
def test_text_field_names_the_field_and_null_records_are_left_out_with_a_count(tmp_path, capsys, name):
    path = _write(tmp_path / name, ["first", None, "second", None], field="content")
    code, err = _prepare_cli(capsys, "--input", str(path), "--out", str(tmp_path / "out"), "--text-field", "content",
                             "--val-fraction", "0.5")
    assert code == 0, err
    assert bytes(_tokens(tmp_path / "out").astype(np.uint8)) == b"firstsecond"
    assert f"{path}: 2 record(s) whose 'content' is null, left out" in err
    assert "1 of them JSON Lines or Parquet: a document a record, its 'content' field" in err


def test_blank_lines_are_skipped_and_escapes_decode_with_a_lone_surrogate_as_gpt2_reads_bad_bytes(tmp_path, capsys):
    """JSON's \\u escapes: a pair is its one character; a lone surrogate, which UTF-8 cannot hold, is U+FFFD."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\n{"text": "a\\ud800b"}\r\n  \n{"text": "\\ud83d\\ude00 \\u00e9"}\n\n')
    code, err = _prepare_cli(capsys, "--input", str(path), "--out", str(tmp_path / "out"), "--val-fraction", "0.5")
    assert code == 0, err
    assert bytes(_tokens(tmp_path / "out").astype(np.uint8)).decode() == "a\ufffdb😀 é"


def _damaged_gz(path: pathlib.Path) -> None:
    path.write_bytes(gzip.compress(_jsonl_lines(DOCS * 20))[:-40])


def _damaged_zst(path: pathlib.Path) -> None:
    """Cut inside its second frame: zstandard's stream_reader read such a file as its first frame alone, or empty."""
    compressor = zstandard.ZstdCompressor()
    whole = compressor.compress(_jsonl_lines(DOCS)) + compressor.compress(_jsonl_lines(DOCS * 20))
    path.write_bytes(whole[:-30])


BAD_FILES = {  # name: (writes it, what the one line says)
    "not-json": ("a.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n{"text": "b"\n'),
                 "a.jsonl line 2 is not JSON (Expecting ',' delimiter"),
    "array": ("a.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n\n[1, 2]\n'),
              "a.jsonl line 3 is a JSON array, not an object"),
    "no-field": ("a.jsonl", lambda p: p.write_bytes(b'{"body": "a", "url": "u"}\n'),
                 "a.jsonl line 1 has no field 'text' (its fields: 'body', 'url'); name the one holding the text with "
                 "--text-field"),
    "number": ("a.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n{"text": 3}\n'),
               "a.jsonl line 2: its 'text' is a JSON number, not text"),
    "not-utf8": ("a.jsonl", lambda p: p.write_bytes(b'{"text": "caf\xe9"}\n'), "a.jsonl line 1 is not JSON ("),
    "gz-cut": ("a.jsonl.gz", _damaged_gz, "a.jsonl.gz cannot be decompressed after line"),
    "gz-not": ("a.jsonl.gz", lambda p: p.write_bytes(_jsonl_lines(DOCS)), "a.jsonl.gz cannot be decompressed ("),
    "zst-cut": ("a.jsonl.zst", _damaged_zst, "a.jsonl.zst cannot be decompressed after line 9 (it ends inside a "
                                             "compressed frame): it is damaged or cut short"),
    "parquet-not": ("a.parquet", lambda p: p.write_bytes(_jsonl_lines(DOCS)),
                    "a.parquet cannot be read as Parquet ("),
    "parquet-column": ("a.parquet", lambda p: pq.write_table(pa.table({"body": ["a"], "url": ["u"]}), p),
                       "a.parquet has no column 'text' (its columns: 'body', 'url')"),
    "parquet-int": ("a.parquet", lambda p: pq.write_table(pa.table({"text": [1, 2]}), p),
                    "a.parquet: its column 'text' holds int64, not text"),
    "parquet-not-utf8": ("a.parquet", lambda p: pq.write_table(pa.table({"text": pa.array(
        [b"ok", b"caf\xe9"], pa.binary()).view(pa.string())}), p),
        "a.parquet: a row of its 'text' among rows 1 to 2 is not UTF-8 (unexpected end of data)"),
    "deep": ("a.jsonl", lambda p: p.write_bytes(b'{"text": "a", "n": ' + b"[" * 10**5 + b"]" * 10**5 + b"}\n"),
             "a.jsonl line 1 is not JSON (maximum recursion depth exceeded"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_records_file_is_refused_in_one_line_naming_where_and_the_old_data_stays(tmp_path, capsys, case):
    name, write, says = BAD_FILES[case]
    write(tmp_path / name)
    out = tmp_path / "out"
    prepare.write_token_dir(str(out), np.arange(10), np.arange(4), 256, "bytes")
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    code, err = _prepare_cli(capsys, "--input", str(tmp_path / name), "--out", str(out), "--overwrite")
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: --input ") and "Traceback" not in err, err
    assert says in lines[-1]
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


@pytest.mark.parametrize("library, name", [("pyarrow", "a.parquet"), ("zstandard", "a.jsonl.zst")])
def test_a_missing_library_names_the_extra_that_installs_it(tmp_path, capsys, monkeypatch, library, name):
    path = _write(tmp_path / name, DOCS)
    for module in [library, f"{library}.parquet"]:  # each import then raises ImportError
        monkeypatch.setitem(sys.modules, module, None)
    code, err = _prepare_cli(capsys, "--input", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and f"reading {name[1:]} files needs {library}" in err
    assert "pip install 'jaxtrain[data]'" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string(), pa.string_view(),
                                  pa.dictionary(pa.int32(), pa.string())], ids=str)
def test_every_kind_of_parquet_text_column_is_read(tmp_path, kind):
    path = _write(tmp_path / "a.parquet", DOCS, kind=kind)
    assert pq.ParquetFile(path).schema_arrow.field("text").type == kind
    assert [text for texts, _ in prepare_records.batches(path, "text") for text in texts] == DOCS


def test_zstd_long_windows_and_gzip_padding_are_read_as_their_tools_read_them(tmp_path):
    """`zstd --long=30` writes frames whose window zstandard refuses by default; `gzip -d` skips NULs after a
    member (tape-block padding)."""
    lines = _jsonl_lines(DOCS)
    params = zstandard.ZstdCompressionParameters(window_log=30, enable_ldm=True)
    # Streamed, as the zstd tool writes: no content size in the header to shrink the window to
    with open(tmp_path / "a.jsonl.zst", "wb") as f:
        with zstandard.ZstdCompressor(compression_params=params).stream_writer(f) as writer:
            writer.write(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines) + b"\0" * 700 + gzip.compress(lines) + b"\0" * 9)
    assert gzip.decompress((tmp_path / "b.jsonl.gz").read_bytes()) == lines + lines  # Python's own reader agrees
    for name, want in [("a.jsonl.zst", DOCS), ("b.jsonl.gz", DOCS + DOCS)]:
        assert [t for texts, _ in prepare_records.batches(tmp_path / name, "text") for t in texts] == want, name


def test_raw_surrogates_and_huge_numbers_in_other_fields_read_without_a_traceback(tmp_path, capsys):
    """A lone surrogate as raw bytes (ED A0 80, which json.loads reads with surrogatepass) is U+FFFD, as its escape
    is; an integer of 5,000 digits in another field is past Python's int parsing limit, and valid JSON."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "a\xed\xa0\x80b", "n": ' + b"7" * 5000 + b'}\n{"text": "c"}\n')
    code, err = _prepare_cli(capsys, "--input", str(path), "--out", str(tmp_path / "out"), "--val-fraction", "0.5")
    assert code == 0, err
    assert bytes(_tokens(tmp_path / "out").astype(np.uint8)).decode() == "a\ufffdbc"


def test_a_json_file_stays_text_with_a_warning_where_it_looks_like_json_lines(tmp_path, capsys):
    (tmp_path / "lines.json").write_bytes(_jsonl_lines(DOCS[:2]))
    (tmp_path / "config.json").write_text('{\n  "text": "a config, not a record"\n}\n')
    code, err = _prepare_cli(capsys, "--input", str(tmp_path), "--out", str(tmp_path / "out"))
    assert code == 0, err
    expected = (tmp_path / "config.json").read_bytes() + (tmp_path / "lines.json").read_bytes()  # sorted: c, l
    assert bytes(_tokens(tmp_path / "out").astype(np.uint8)) == expected
    assert f"prepare: warning: {tmp_path / 'lines.json'} is read as text, JSON and all, though its first line is a " \
           f"JSON object with a 'text' field: to read it as JSON Lines, a document a record, name it .jsonl" in err
    assert "config.json" not in err and "JSON Lines or Parquet" not in err


def _unpaired(text: str) -> str:
    """`text` with each surrogate, which no UTF-8 holds, as U+FFFD."""
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


_TEXTS = st.lists(st.text(st.characters(codec=None), max_size=40) | st.none(), max_size=12)


@settings(deadline=None, derandomize=True, database=None, max_examples=40)
@given(docs=_TEXTS, ascii_only=st.booleans(), chunk=st.integers(1, 64), batch=st.integers(1, 64),
       name=st.sampled_from(["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet"]))
def test_any_documents_come_back_as_written_whatever_the_format_and_chunks(docs, ascii_only, chunk, batch, name):
    """Records of any texts (newlines, quotes, control characters, astral characters, surrogates; in JSON escaped
    or as UTF-8, surrogates then as their raw bytes), read in chunks, batches and Parquet row batches of any size:
    the texts in order, nulls left out, a surrogate that is no character's half U+FFFD; the bytes read adding up to
    the file's size."""
    if name.endswith(".parquet"):  # pyarrow's strings are UTF-8: no surrogates
        docs = [None if doc is None else _unpaired(doc) for doc in docs]
    lines = b"".join(json.dumps({"text": doc}, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass") + b"\n"
                     for doc in docs)
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / name
        if name.endswith(".parquet"):
            _write(path, docs)
        else:
            path.write_bytes({"l": lines, "z": gzip.compress(lines),
                              "t": zstandard.ZstdCompressor().compress(lines)}[name[-1]])
        sizes = {"CHUNK_BYTES": chunk, "BATCH_CHARS": batch, "PARQUET_BATCH_ROWS": chunk}
        saved = {key: getattr(prepare_records, key) for key in sizes}
        vars(prepare_records).update(sizes)
        try:
            batches = list(prepare_records.batches(path, "text"))
        finally:
            vars(prepare_records).update(saved)
        size = path.stat().st_size
    # Escaped, a high half followed by a low one is the character they make (json's reading); as raw bytes, each
    # is a byte sequence UTF-8 refuses, U+FFFD each
    want = [json.loads(json.dumps(doc)) if ascii_only else doc for doc in docs if doc is not None]
    assert [text for texts, _ in batches for text in texts] == [_unpaired(text) for text in want]
    assert sum(n for _, n in batches) == size
