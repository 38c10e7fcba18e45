"""The embedded corpus: without data.path, a run trains on the Python standard library's own source, byte-tokenized
and prepared once into a cache folder (data.cache_dir, default ~/.cache/jaxtrain): a real corpus that needs no
download. Each file goes whole to train or val, by a hash of its path.

No jax nor torch, as jaxtrain.data, which loads it (torchref imports that): numpy, the standard library, and
jaxtrain's own path helpers (runfolder: fsspec, etils).
"""

import hashlib
import os
import pathlib
import sys
import sysconfig
import zlib

from jaxtrain import prepare as prepare_lib
from jaxtrain import runfolder, staging
from jaxtrain.errors import UserError

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
VAL_FRACTION = 0.1  # of the files, held out whole


def folder(cache_dir: str | None) -> str:
    """The folder of the byte-tokenized stdlib corpus, prepared on first use.

    The folder name carries the Python version and a hash of the file list and sizes, so another interpreter
    prepares its own corpus instead of reading a stale one.
    """
    if cache_dir is not None and runfolder.is_url(cache_dir):  # else prepared into a local folder named gs:
        raise UserError(f"data.cache_dir={cache_dir!r} is a URL, and the embedded corpus is prepared into a local "
                        f"folder (~30 MB, once): give a local data.cache_dir, or leave it out (~/.cache/jaxtrain)")
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_sources(root)
    listing = "".join(f"{rel} {os.path.getsize(os.path.join(root, rel))}\n" for rel in files)
    key = hashlib.sha1(listing.encode()).hexdigest()[:12]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = os.path.join(os.path.expanduser(cache_dir or "~/.cache/jaxtrain"), f"stdlib-py{version}-{key}")
    if not os.path.isdir(out):
        prepare(root, files, out)
    return out


def stdlib_sources(root: str) -> list[str]:
    """Relative posix paths of the stdlib's *.py files outside test and package folders, sorted."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        rels += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(rels)


def is_val(rel: str) -> bool:
    """A file's split, from a hash of its path alone: stable as files come and go."""
    return zlib.crc32(rel.encode()) < VAL_FRACTION * 2**32


def prepare(root: str, files: list[str], out: str) -> None:
    """Writes into a temp folder renamed into place at the end: a killed prepare or two processes preparing at
    once never leave a half-written corpus (the loser of a race drops its identical copy)."""
    print(f"preparing embedded corpus: {len(files)} Python stdlib files from {root} into {out} (one time)", flush=True)
    splits = {False: [], True: []}
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            splits[is_val(rel)].append(f.read())
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = staging.make(parent, refuse_live=False)
    except OSError as e:
        raise UserError(f"cannot write the embedded corpus to {parent} ({e}); "
                        f"set data.cache_dir to a writable folder") from None
    try:
        train, val = prepare_lib.byte_tokens(splits[False]), prepare_lib.byte_tokens(splits[True])
        prepare_lib.write_token_dir(tmp, train, val, 256, "bytes")
        os.rename(tmp, out)
    except OSError as e:
        if not os.path.isdir(out):
            raise UserError(f"cannot write the embedded corpus to {out} ({e}); set data.cache_dir to a writable "
                            f"folder with ~30 MB free") from None
    finally:
        staging.release(tmp)
