"""The documents of the files datasets ship in, for prepare: JSON Lines (the Pile's .jsonl.zst, C4's .json.gz,
OpenWebText2, `datasets`' to_json; plain, gzip or zstd) and Parquet (the Hugging Face Hub's dataset shards: FineWeb,
OpenWebText), a document a record, its text in one field (prepare's --text-field; "text" by default, as Levanter's
text_key and the field nanoGPT's openwebtext prepare reads).

The standard library and tqdm (pyarrow for Parquet, zstandard for .zst, imported only for such a file): torchref
imports jaxtrain.data, which imports prepare, which imports this.
"""

import functools
import importlib
import json
import os
import pathlib
import re
import sys
import zlib

from tqdm import tqdm

from jaxtrain.errors import UserError

# A .json file may hold any JSON (a code corpus's configs): it stays text, with a warning where it looks like JSON
# Lines (looks_like_records). Compressed, it was refused as not text: .json.gz is C4's name for JSON Lines.
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst", ".json.gz",
                  ".json.zst")
PARQUET_SUFFIX = ".parquet"
DEFAULT_FIELD = "text"
BATCH_CHARS = 2**20  # a JSON Lines file's texts are handed on in batches of about this many characters
CHUNK_BYTES = 2**20  # a JSON Lines file is read this many bytes at a time
PARQUET_BATCH_ROWS = 1024  # rows read at a time: ~4 MB of FineWeb's ~3-4 kB documents
# What a JSON "\ud800" escape without its pair decodes to, or the bytes ED A0 80 (json.loads reads with surrogatepass)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
ZSTD_MAX_WINDOW = 2**31  # zstd --long=31's: zstandard refuses frames past 128 MiB windows by default
_EXTRA = "pip install 'jaxtrain[data]'"


def is_records(path: pathlib.Path) -> bool:
    """Whether prepare reads `path` as records (by its name: a .json file, which may be any JSON, stays text)."""
    return path.name.lower().endswith(JSONL_SUFFIXES + (PARQUET_SUFFIX,))


def looks_like_records(path: pathlib.Path, field: str) -> bool:
    """Whether a .json file, read as text, starts with a line that is a JSON object holding `field`: JSON Lines
    under the name `datasets`' to_json examples give them."""
    if not path.name.lower().endswith(".json"):
        return False
    with open(path, "rb") as f:
        first = f.readline(BATCH_CHARS)
    try:
        record = json.loads(first, parse_int=float)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and field in record


def batches(path: pathlib.Path, field: str):
    """(texts, input bytes read for them) over `path`'s records in order, the bytes adding up to its size: each
    record's `field`, a null one left out (a warning at the end counts them). Refused in one line, naming the file
    and where in it: a record that is not a JSON object, a field missing or holding no text, a damaged file."""
    read = _parquet if path.name.lower().endswith(PARQUET_SUFFIX) else _jsonl
    nulls = 0
    for texts, n_bytes in read(path, field):
        kept = [text for text in texts if text is not None]
        nulls += len(texts) - len(kept)
        yield kept, n_bytes
    if nulls:
        tqdm.write(f"prepare: warning: {path}: {nulls:,} record(s) whose {field!r} is null, left out",
                   file=sys.stderr)


def _jsonl(path: pathlib.Path, field: str):
    size, counted, number = os.path.getsize(path), 0, 0
    texts, chars = [], 0
    with open(path, "rb") as raw:
        try:
            for number, line in enumerate(_lines(_chunks(raw, path)), 1):
                if line.strip():
                    texts.append(_text_of(line, field, f"--input {path} line {number}"))
                    chars += len(texts[-1] or "")
                if chars >= BATCH_CHARS:
                    yield texts, raw.tell() - counted
                    texts, chars, counted = [], 0, raw.tell()
        except _decompression_errors() as e:
            after = f" after line {number}" if number else ""
            raise UserError(f"--input {path} cannot be decompressed{after} ({e}): it is damaged or cut short; fetch "
                            f"it again, or leave it out") from None
    yield texts, size - counted


def _chunks(raw, path: pathlib.Path):
    """`raw`'s bytes as read, decompressed as its name says."""
    chunks = iter(functools.partial(raw.read, CHUNK_BYTES), b"")
    name = path.name.lower()
    if name.endswith(".gz"):
        return _frames(chunks, lambda: zlib.decompressobj(wbits=31))  # 31: a gzip member
    if name.endswith(".zst"):
        zstandard = _library("zstandard", ".jsonl.zst", path)
        return _frames(chunks, lambda: zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompressobj())
    return chunks


def _frames(chunks, decompressor):
    """The bytes of every compressed frame in `chunks` in turn (gzip members, zstd frames: `decompressor()` makes
    one's); EOFError where the last is cut short (zstandard's stream_reader ended such a file without a word). NULs
    between frames are padding, as Python's gzip and `gzip -d` take them (no frame of either starts with one)."""
    frame = None
    for chunk in chunks:
        while chunk:
            if frame is None and not (chunk := chunk.lstrip(b"\0")):
                break
            frame = frame or decompressor()
            yield frame.decompress(chunk)
            chunk, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise EOFError("it ends inside a compressed frame")


def _lines(chunks):
    """The lines of the bytes in `chunks`, without their newlines."""
    pending = []
    for chunk in chunks:
        *lines, last = chunk.split(b"\n")
        if lines:
            lines[0] = b"".join(pending) + lines[0]
            pending = []
            yield from lines
        pending.append(last)
    if tail := b"".join(pending):
        yield tail


def _decompression_errors() -> tuple:
    """What a damaged .gz or .zst raises as it is read (EOFError: one cut short, _frames)."""
    zstandard = sys.modules.get("zstandard")  # None where it is not installed
    return (EOFError, zlib.error) + ((zstandard.ZstdError,) if zstandard else ())


def _text_of(line: bytes, field: str, where: str) -> str | None:
    """The text of one JSON Lines record's `field`; None where it is null."""
    try:  # parse_int=float: an integer of over 4,300 digits, in any field, is no error (Python's int limit)
        record = json.loads(line, parse_int=float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError (JSON Lines are UTF-8), nesting
        raise UserError(f"{where} is not JSON ({str(e) or type(e).__name__}); a JSON Lines file holds one JSON "
                        f"object a line") from None
    if not isinstance(record, dict):
        raise UserError(f"{where} is a JSON {_json_type(record)}, not an object; a JSON Lines file holds one JSON "
                        f"object a line, its text in a field")
    if field not in record:
        keys = ", ".join(repr(key) for key in list(record)[:10]) or "none"
        raise UserError(f"{where} has no field {field!r} (its fields: {keys}); name the one holding the text with "
                        f"--text-field")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise UserError(f"{where}: its {field!r} is a JSON {_json_type(text)}, not text; name the field holding the "
                        f"text with --text-field")
    if text and _LONE_SURROGATE.search(text):  # no UTF-8 holds it: U+FFFD, as gpt2 reads an undecodable byte
        text = _LONE_SURROGATE.sub("\ufffd", text)
    return text


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}[type(value)]


def _parquet(path: pathlib.Path, field: str):
    parquet = _library("pyarrow.parquet", ".parquet", path)
    import pyarrow  # there, with its parquet module
    try:
        # pre_buffer=False: with it, iter_batches' peak grew with the file (766 MB of RSS for a 277 MB file, 412 MB
        # for 18 MB), without it 516 MB and 409 MB, as fast
        file = parquet.ParquetFile(path, pre_buffer=False)
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"--input {path} cannot be read as Parquet ({e}): it is damaged or not Parquet; fetch it "
                        f"again, or leave it out") from None
    with file:
        _check_column(pyarrow, file.schema_arrow, field, path)
        size, rows, done, counted = os.path.getsize(path), file.metadata.num_rows, 0, 0
        try:
            for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
                texts = batch.column(0).to_pylist()
                done += batch.num_rows
                yield texts, size * done // rows - counted
                counted = size * done // rows
        except UnicodeDecodeError as e:
            rows_read = f"rows {done + 1:,} to {done + batch.num_rows:,}"
            raise UserError(f"--input {path}: a row of its {field!r} among {rows_read} is not UTF-8 ({e.reason}), "
                            f"which Parquet's strings are; fix the file or leave it out") from None
        except MemoryError as e:  # pyarrow's ArrowMemoryError among them: a row group larger than this machine holds
            raise UserError(f"--input {path}: reading it needs more memory than this machine has ({e}): its row "
                            f"groups are read whole; prepare it on a larger one") from None
        except (pyarrow.ArrowException, OSError) as e:
            raise UserError(f"--input {path} cannot be read after row {done:,} ({e}): it is damaged or cut short; "
                            f"fetch it again, or leave it out") from None
    yield [], size - counted


def _check_column(pyarrow, schema, field: str, path: pathlib.Path) -> None:
    """Refuses a Parquet file whose `field` column is missing or holds no text."""
    if field not in schema.names:
        columns = ", ".join(repr(name) for name in schema.names[:10])
        raise UserError(f"--input {path} has no column {field!r} (its columns: {columns}); name the one holding the "
                        f"text with --text-field")
    kind = schema.field(field).type
    if not _is_text(pyarrow, kind):
        raise UserError(f"--input {path}: its column {field!r} holds {kind}, not text; name the column holding the "
                        f"text with --text-field")


def _is_text(pyarrow, kind) -> bool:
    if pyarrow.types.is_dictionary(kind):
        kind = kind.value_type
    return pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind) or pyarrow.types.is_string_view(kind)


def _library(name: str, suffix: str, path: pathlib.Path):
    """The module `name` (an extra's), or a UserError naming the install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UserError(f"--input {path}: reading {suffix} files needs {name.partition('.')[0]}, which is not "
                        f"installed here: "
                        f"{_EXTRA}") from None
