"""Which files a prepare reads (`input_files`: folders walked, hidden names, data folders and repeats left out) and
whether each is text (`TextCheck`). Pure Python, as prepare.py: torchref imports jaxtrain.data, which imports
these."""

import collections
import codecs
import os
import pathlib
import re
import sys

from tqdm import tqdm

from jaxtrain import runfolder
from jaxtrain.errors import UserError

_HIDDEN = 'hidden (a name starting with ".")'
DATA_FILES = ("train.bin", "val.bin", "meta.json")  # what a prepare writes into --out
_DATA_FOLDER = "jaxtrain data folder(s) (meta.json and train.bin: an earlier prepare's tokens)"
_UNDER_OUT = "under --out (the data this prepare replaces)"
_REPEAT = "repeat(s) (an input given twice, or a folder reached again through a symlink)"
_NOT_FILE = "neither file nor folder (a broken symlink, a socket or a pipe)"


def input_files(inputs: list[str], out: str) -> list[pathlib.Path]:
    """Files in the order given, each once (the first time: a file read twice could land in both train and val); a
    folder contributes its files, recursively, sorted by path (_folder_files). A file named on the command line is
    read whatever its name and wherever it lies (nanoGPT keeps input.txt beside the .bin files), but for the data
    this prepare replaces (_replaced). Says on stderr how many files are read and what was skipped, and why."""
    files, seen_folders, out_real = [], set(), os.path.realpath(out)
    skipped = collections.defaultdict(list)  # reason -> paths
    for item in inputs:
        path = pathlib.Path(item)
        if path.is_dir():
            files += _folder_files(item, out_real, seen_folders, skipped)
        elif path.is_file():
            files.append(path)
        elif runfolder.is_url(item):
            example = f" (`gcloud storage cp -r {item} .`)" if item.startswith("gs://") else ""
            raise UserError(f"--input {item!r} is a URL, and prepare reads local files: copy it here first{example} "
                            f"and pass that")
        else:
            raise UserError(f"--input {item!r} is neither a file nor a folder; pass text files or folders of them")
    files = _first_of_each(files, out_real, skipped)
    print(f"prepare: reading {len(files):,} file(s)" + _skipped_summary(skipped), file=sys.stderr)
    if not files:
        raise UserError(f"no files to read under --input {' '.join(inputs)} (see what was skipped above); "
                        f"pass folders that contain text files")
    unreadable = [str(p) for p in files if not os.access(p, os.R_OK)]
    if unreadable:
        raise UserError(f"--input {unreadable[0]} cannot be read by this user ({len(unreadable)} such file(s)); "
                        f"fix its permissions or leave it out")
    if not any(p.stat().st_size for p in files):
        raise UserError(f"--input {' '.join(inputs)} holds no text ({len(files)} empty file(s)); pass files with "
                        f"the text to train on")
    return files


def _folder_files(folder: str, out_real: str, seen: set[str], skipped: dict) -> list[pathlib.Path]:
    """The files under `folder`, sorted by path, through symlinked folders too (each real folder once, which also
    ends a symlink loop; Path.rglob skipped them without a word), leaving out what is no corpus text: hidden names
    (.git, .DS_Store), jaxtrain data folders (an earlier prepare's train.bin), --out, and folders seen before."""
    if _folder_skip(folder, out_real, seen, skipped):
        return []
    files, unreadable = [], []
    for root, dirs, names in os.walk(folder, followlinks=True, onerror=unreadable.append):
        dirs[:] = [d for d in sorted(dirs) if not (_hidden(os.path.join(root, d), skipped)
                                                   or _folder_skip(os.path.join(root, d), out_real, seen, skipped))]
        for name in sorted(names):  # the first skipped of a kind, named on stderr, is the same every time
            path = os.path.join(root, name)
            if _hidden(path, skipped):
                continue
            if os.path.isfile(path):
                files.append(pathlib.Path(path))
            else:
                skipped[_NOT_FILE].append(path)
    if unreadable:  # os.walk leaves such a folder out without a word, as its files would be if read
        raise UserError(f"--input folder {unreadable[0].filename} cannot be read by this user ({len(unreadable)} "
                        f"such folder(s)); fix its permissions or leave it out")
    return sorted(files)


def _hidden(path: str, skipped: dict) -> bool:
    """Whether `path`'s name is hidden (.git, .env, .DS_Store: no corpus text), noted in `skipped` if so."""
    hidden = os.path.basename(path).startswith(".")
    if hidden:
        skipped[_HIDDEN].append(path)
    return hidden


def _folder_skip(folder: str, out_real: str, seen: set[str], skipped: dict) -> bool:
    """Whether to leave out `folder` (noted in `skipped`), else note it as seen."""
    real = os.path.realpath(folder)
    if real == out_real or real.startswith(out_real + os.sep):
        reason = _UNDER_OUT
    elif real in seen:
        reason = _REPEAT
    elif all(os.path.isfile(os.path.join(folder, name)) for name in ("meta.json", "train.bin")):  # val.bin aside
        reason = _DATA_FOLDER
    else:
        seen.add(real)
        return False
    skipped[reason].append(folder)
    return True


def _first_of_each(files: list[pathlib.Path], out_real: str, skipped: dict) -> list[pathlib.Path]:
    """`files` less the data this prepare replaces and the repeats of a real file (the first stays, where it was)."""
    kept, seen = [], set()
    for path in files:
        real = os.path.realpath(path)
        if _replaced(real, out_real):
            skipped[_UNDER_OUT].append(str(path))
        elif real in seen:
            skipped[_REPEAT].append(str(path))
        else:
            seen.add(real)
            kept.append(path)
    return kept


def _replaced(real: str, out_real: str) -> bool:
    """Whether the file at real path `real` is what a prepare into `out_real` replaces: its data files, or a file
    in a hidden folder there (a staging folder, .prepare-*). A folder's files under --out are left out as the walk
    meets --out (_folder_skip)."""
    if not real.startswith(out_real + os.sep):
        return False
    parts = os.path.relpath(real, out_real).split(os.sep)
    return parts == [parts[0]] and parts[0] in DATA_FILES or parts[0].startswith(".")


def _skipped_summary(skipped: dict) -> str:
    """"; skipped 3: 2 hidden (...) such as a/.git; 1 ..." (the first path skipped for each reason), or ""."""
    if not skipped:
        return ""
    reasons = "; ".join(f"{len(paths):,} {reason} such as {paths[0]}" for reason, paths in skipped.items())
    return f"; skipped {sum(map(len, skipped.values())):,}: {reasons}"


# The share of a file's bytes that may be undecodable as UTF-8 or NUL before it is refused as not text. UTF-8 text
# has none; Latin-1 or cp1252 text in a Western European language a few percent (its accented letters: warned,
# and kept); compressed or binary files about half (a .gz 55%, random bytes 43%), UTF-16 text about half (NULs).
NOT_TEXT_SHARE = 0.1
_ESCAPED = re.compile(r"[\udc80-\udcff]+")  # the bytes that UTF-8 decoding with surrogateescape could not decode


class TextCheck:
    """Counts, over one file read in chunks, its bytes that are not UTF-8 text: undecodable ones (gpt2 reads each
    run of them as U+FFFD; before, silently) and NULs (which no text has). Refuses the file as soon as they are
    more than NOT_TEXT_SHARE of its size (so a large binary file is refused early, yet exactly when its whole count
    would be), and warns at its end about those it has."""

    def __init__(self, path: pathlib.Path, size: int):
        self.path, self.size, self.undecodable, self.nul = path, size, 0, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")  # one escape per byte

    def add(self, chunk: bytes, final: bool = False) -> None:
        self.undecodable += sum(m.end() - m.start() for m in _ESCAPED.finditer(self._decoder.decode(chunk, final)))
        self.nul += chunk.count(b"\0")
        if self.undecodable + self.nul > NOT_TEXT_SHARE * self.size:
            raise UserError(f"--input {self.path} is not text: {self._counts()} among its {self.size:,} bytes, over "
                            f"{NOT_TEXT_SHARE:.0%} (a compressed, binary or UTF-16 file?); leave it out, or convert "
                            f"it to UTF-8 text (e.g. with iconv)")

    def finish(self, tokenizer: str) -> None:
        self.add(b"", final=True)  # an incomplete character at the end
        if self.undecodable + self.nul:
            kept = "gpt2 reads each run of undecodable bytes as U+FFFD" if tokenizer == "gpt2" else "kept as bytes"
            tqdm.write(f"prepare: warning: {self.path} has {self._counts()} among its {self.size:,} bytes ({kept}); "
                       f"convert it to UTF-8 if it is in another encoding", file=sys.stderr)

    def _counts(self) -> str:
        return f"{self.undecodable:,} undecodable (as UTF-8) and {self.nul:,} NUL bytes"
