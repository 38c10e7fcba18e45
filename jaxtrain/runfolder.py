"""The run folder on any storage: run.out_dir is a local path or a URL that etils.epath opens (gs://, s3://, ...).

Orbax writes the checkpoints itself (on gs:// through TensorStore's gcs driver, with a commit_success.txt file
standing in for the atomic rename an object store lacks); the run's other files go through here. An object store
has no append and no atomic rename, but an upload is atomic: a reader sees the old object or the new one, never a
part. So config.yaml is written whole, and metrics.jsonl and TensorBoard's event file, appended a record at a time
on a local disk, are uploaded whole in an object store (GrowingFile).
"""

import contextlib
import os
import re
import sys
import time

import fsspec
from etils import epath

from jaxtrain.errors import UserError

# gcsfs caches directory listings for the life of a process, and misses what TensorStore and other hosts write
# there (a stale listing hid TensorBoard's events in a test). Off, unless the user's fsspec config says otherwise.
fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)

# An object-store GrowingFile uploads the records written since its last upload at most this often (and at each sync),
# and at most UPLOAD_SHARE of the time: each upload is of the whole object, which grows with the run
UPLOAD_EVERY_S = 30.0
UPLOAD_SHARE = 0.05


def is_url(path: str) -> bool:
    """Whether `path` (a run folder, a data folder, an input) is a URL (gs://, s3://, memory://), not a local path."""
    return "://" in path


def parent_and_name(folder: str) -> tuple[str, str]:
    """(the folder holding `folder`, its name): a URL's split at its last slash (os.path.normpath would make gs://b
    gs:/b), a local path's as os.path.split splits it, normalised."""
    if is_url(folder):
        parent, _, name = folder.rstrip("/").rpartition("/")
        return parent, name
    return os.path.split(os.path.normpath(folder))


def path(out_dir: str, *names: str) -> epath.Path:
    """`out_dir`/names: a URL as it is, a local path made absolute (orbax takes absolute paths only)."""
    base = epath.Path(out_dir if is_url(out_dir) else os.path.abspath(out_dir))
    return base.joinpath(*names)


# The stamp of a run.fresh set-aside in progress (set_aside_previous_run).
SET_ASIDE_JOURNAL = ".fresh-in-progress"

# Where a checkpoint that cannot be read is moved, whole (checkpoint.py), out of orbax's sight and never deleted.
CORRUPT_CHECKPOINTS = "checkpoints.corrupt"

# What a run keeps in run.out_dir: a file or a folder already there under one of these names must be of its kind.
_RUN_FOLDER_KINDS = {"": "folder", "checkpoints": "folder", "config.yaml": "file", "metrics.jsonl": "file",
                     "wandb.json": "file", "wandb": "folder", "tb": "folder", ".lock": "file",
                     CORRUPT_CHECKPOINTS: "folder", SET_ASIDE_JOURNAL: "file"}


# What run.fresh moves aside, each whole, to <name>.before-fresh-<time>: an earlier run's checkpoints (left in place,
# their higher steps would make max_to_keep delete the new run's and a resume pick the old run) and the corrupt ones
# it set aside, its config.yaml (copied, as the new run writes its own: the command line that resumes the old run
# once it is moved back), metrics (the new run would overwrite them), TensorBoard events (the new run's first event
# would hide the old curves) and W&B run (the new run would log to it). One rule for both backends.
PREVIOUS_RUN = ("checkpoints", CORRUPT_CHECKPOINTS, "config.yaml", "metrics.jsonl", "tb", "wandb.json", "wandb")


def set_aside_previous_run(out_dir: str) -> list[epath.Path]:
    """Move what an earlier run left in `out_dir` (PREVIOUS_RUN) aside under one time stamp, saying so on stderr,
    and return where to. A stamp some name of which is taken (a fresh start in the same second as the last one)
    gets a count, so that nothing set aside before is overwritten.

    The stamp is written down (SET_ASIDE_JOURNAL) before the first move and deleted after the last: a set-aside cut
    short (a kill between two names; in an object store, between two objects of one folder) is finished under the
    same stamp by the next fresh start, so no name is split between two stamps, and no other start goes on from
    what is left in the meantime (`refuse_unfinished_set_aside`, which also refuses a journal without a stamp before
    this runs on process 0 alone)."""
    found = [path(out_dir, name) for name in PREVIOUS_RUN if path(out_dir, name).exists()]
    journal = path(out_dir, SET_ASIDE_JOURNAL)
    suffix = _unfinished_suffix(journal)
    if suffix is not None:
        print(f"run.fresh: finishing the set-aside to *{suffix} that an earlier start began", file=sys.stderr)
    elif found:
        suffix = _free_suffix(found)
        write_whole(journal, suffix)
    targets = [source.with_name(source.name + suffix) for source in found]
    for source, target in zip(found, targets):
        if source.name == "config.yaml":  # copied: a start stopped before it writes its own leaves one to run with
            write_whole(target, source.read_bytes())
            print(f"run.fresh: copied the previous run's {source.name} to {target}", file=sys.stderr)
            continue
        move(source, target)
        print(f"run.fresh: moved the previous run's {source.name} to {target}", file=sys.stderr)
    if suffix is not None:
        journal.unlink()
    return targets


def holds_set_aside_work(name: str) -> bool:
    """Whether `name` in a run folder is where a start moves earlier work aside (a corrupt checkpoint, a run.fresh
    set-aside): kept as the warning that named it says, even empty (a corrupt step's empty folder)."""
    return name == CORRUPT_CHECKPOINTS or any(name.startswith(f"{kept}.before-fresh-") for kept in PREVIOUS_RUN)


def refuse_unfinished_set_aside(out_dir: str, fresh: bool) -> None:
    """Read the set-aside journal, on every process of every start before anything can block on a collective: one
    that holds no stamp is refused (in a fresh start it would be met by process 0 alone, the others waiting at the
    set-aside's barrier). A start without run.fresh where a set-aside was cut short would resume, or start over,
    from what the set-aside had not moved yet: refused with the two ways on, neither of which loses anything."""
    journal = path(out_dir, SET_ASIDE_JOURNAL)
    suffix = _unfinished_suffix(journal)
    if suffix is not None and not fresh:
        raise UserError(f"a run.fresh start was stopped while it moved the previous run in {out_dir} aside to "
                        f"*{suffix} ({journal} says so): add --run.fresh=true to finish moving it and start over, "
                        f"or, to resume that run, move its *{suffix} files back by hand and delete {journal}")


def _unfinished_suffix(journal: epath.Path) -> str | None:
    """The stamp an unfinished set-aside wrote down, or None; a journal that holds no stamp is refused, as moving
    each name onto itself plus garbage could lose it."""
    if not journal.exists():
        return None
    suffix = journal.read_text()
    if not re.fullmatch(r"\.before-fresh-\d{8}-\d{6}(-\d+)?", suffix):
        raise UserError(f"{journal} should hold the stamp of an unfinished run.fresh set-aside, as "
                        f"'.before-fresh-20261128-093000', but holds {suffix[:80]!r}; check what the folder holds, "
                        f"and delete {journal}")
    return suffix


def _free_suffix(found: list[epath.Path]) -> str:
    stamp = suffix = f".before-fresh-{time.strftime('%Y%m%d-%H%M%S')}"
    count = 0
    while any(source.with_name(source.name + suffix).exists() for source in found):
        count += 1
        suffix = f"{stamp}-{count}"
    return suffix


def note_moved_run(config_file: str | None, out_dir: str) -> None:
    """Warn when `config_file` is a run folder's own config.yaml (its folder holds checkpoints) but run.out_dir, read
    from it, names another folder: the folder was moved or copied since, and the run would start or resume at the
    old place."""
    if config_file is None or is_url(config_file) or os.path.basename(config_file) != "config.yaml":
        return
    folder = os.path.dirname(os.path.abspath(config_file))
    if os.path.isdir(os.path.join(folder, "checkpoints")) and path(out_dir) != path(folder):
        print(f"warning: {config_file} is the config of the run in {folder}, but its run.out_dir is {out_dir}: the "
              f"run goes on there; to resume the run in {folder}, add --run.out_dir={folder}", file=sys.stderr)


def unwritable(folder: str) -> str | None:
    """Why a local folder cannot be created, or written into where it exists (None: it can), as a predicate of
    it: "is a file", "lies under X, which is a file", "is on a read-only file system", "is a folder this user
    cannot write into", "lies in X, where this user cannot write"."""
    folder = ancestor = os.path.abspath(folder)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return "is a file" if ancestor == folder else f"lies under {ancestor}, which is a file"
    if os.access(ancestor, os.W_OK):
        return None
    read_only = os.statvfs(ancestor).f_flag & os.ST_RDONLY
    if ancestor == folder:
        return "is on a read-only file system" if read_only else "is a folder this user cannot write into"
    return f"lies in {ancestor}, " + ("on a read-only file system" if read_only else "where this user cannot write")


def check_writable(folder: str, flag: str) -> None:
    """UserError unless `folder` can be written (unwritable): refused when a tool starts, not when it writes its
    results at the end. `flag` names the setting to change, as "--run.out_dir"."""
    problem = unwritable(folder)
    if problem:
        shown = f"{flag.lstrip('-')}={folder!r}" if "." in flag else f"{flag} {folder!r}"  # config key, tool flag
        raise UserError(f"{shown} {problem}; choose another {flag}")


def check_given(path: str, flag: str, wanted: str) -> None:
    """"" is the current folder to pathlib and os.path (and `if path` takes it for "use the default"): given for a
    path, it is an unset shell variable, most likely, refused with `wanted`, what to pass instead."""
    if not path:
        raise UserError(f"{flag} is an empty path (an unset variable?); pass {wanted}")


def check_not_url(folder: str, flag: str) -> None:
    """prepare and the converter read and write local folders (safetensors and JSON files, numpy's memory maps;
    only a jaxtrain step folder, which Orbax reads, is read from a bucket): a URL is refused with the way round it,
    not taken for a missing folder, nor written to a local folder named after it."""
    if is_url(folder):
        copy = "a local folder" if flag in ("DST", "--out") else "a local copy"
        raise UserError(f"{flag} {folder} is a URL, and this command takes local folders only; give it {copy} and "
                        f"copy between the two with your store's tool (gcloud storage cp -r, aws s3 cp --recursive)")


def check_local(out_dir: str) -> None:
    """run.out_dir can hold a run: otherwise the run would fail at its first write, after the training it could
    not save (a file where a folder goes, or a step number that is a file). Object-store URIs are not local."""
    check_writable(out_dir, "--run.out_dir")
    entries = list(_RUN_FOLDER_KINDS.items())
    checkpoints = os.path.join(out_dir, "checkpoints")
    if os.path.isdir(checkpoints):
        entries += [(os.path.join("checkpoints", n), "folder") for n in os.listdir(checkpoints) if n.isdigit()]
    for name, kind in entries:
        path = os.path.join(out_dir, name)
        if os.path.exists(path) and os.path.isdir(path) != (kind == "folder"):
            raise UserError(f"{path} is a {'folder' if kind == 'file' else 'file'} where the run keeps a {kind} of "
                            f"that name; move it aside, or choose another --run.out_dir")
        problem = unwritable(path) if name and kind == "folder" and os.path.isdir(path) else None
        if problem:  # found at the first save, after the steps before it
            raise UserError(f"{path} {problem}, and the run writes into it; make it writable, or choose another "
                            f"--run.out_dir")


# Object stores a run folder may lie in: each has a TensorStore driver (orbax's arrays), an fsspec file system
# (metrics.jsonl, config.yaml, TensorBoard's events); the package that brings the file system.
RUN_URL_SCHEMES = {"gs": "gcsfs", "s3": "s3fs"}


def check_url(out_dir: str, writes: bool) -> None:
    """A URL run.out_dir names a bucket in a store the run can write, with that store's package installed where
    the run `writes` (a dry run writes nothing)."""
    _store_class(out_dir, f"run.out_dir={out_dir!r}", "this run can write", needed=writes)


def check_readable(url: str, flag: str) -> None:
    """A URL given as `flag` where a run or a step folder of one is read (sample, evaluate, to-torch, to-hf):
    refused in one line where its store is not one jaxtrain reads, its package is not installed, or the store does
    not answer (credentials, the network: gcsfs raises a 403 as an OSError); a path that is not there is the
    caller's to name."""
    store = _store_class(url, f"{flag} {url}", "jaxtrain reads", needed=True)
    try:
        store().info(url)
    except FileNotFoundError:
        return
    except Exception as e:
        raise UserError(f"{flag} {url} cannot be read ({error_text(e)}); check the credentials (for gs://: gcloud "
                        f"auth application-default login) and this machine's network to the store") from None


def _store_class(url: str, named: str, can: str, needed: bool):
    """fsspec's file system class for `url` (None where not `needed`); refused where its scheme is not one of
    RUN_URL_SCHEMES, or names no bucket, or its package is missing."""
    scheme, _, rest = url.partition("://")
    if scheme not in RUN_URL_SCHEMES or not rest.strip("/"):
        raise UserError(f"{named} is not a folder {can}: give a local path, or "
                        f"{' or '.join(f'{s}://bucket/path' for s in RUN_URL_SCHEMES)}")
    if not needed:
        return None
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise UserError(f"{named} needs the {RUN_URL_SCHEMES[scheme]} package: pip install "
                        f"'{RUN_URL_SCHEMES[scheme]}' (for gs://: pip install 'jaxtrain[gcs]')") from None


def error_text(error: Exception) -> str:
    """An exception from a store or a library as a message's parenthesis: its type and its first 300 characters."""
    return f"{type(error).__name__}: {str(error)[:300]}"


def as_open_makes_it(file: str) -> None:
    """Give the local `file` the permissions open() gives a new file (0666 less the umask): safetensors (0.8)
    writes its files 0600, so that the weights in a shared folder were the one file its other users could not
    read. The umask is read from /proc (setting it to read it, as os.umask must, would race the threads that
    write checkpoints meanwhile); where there is no /proc, the file is left as it is."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration):
        return
    os.chmod(file, 0o666 & ~umask)


def write_whole(file: epath.Path, content: str | bytes) -> None:
    """Replace `file` with `content` (text is written as UTF-8) so that no reader, and no kill, meets half of it: a
    local file through a temporary file and a rename; an object in one upload."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    if is_url(os.fspath(file)):
        file.write_bytes(data)
        return
    temporary = file.with_name(file.name + ".tmp")
    temporary.write_bytes(data)
    temporary.replace(file)


def move(source: epath.Path, target: epath.Path) -> None:
    """Move a file or a folder, whole, to `target` (its parent made where needed). In an object store a folder has
    no existence of its own (etils' rename refuses a target whose parent has no object yet), and a move is a copy
    and a delete per object (on GCS the server-side moveTo where the bucket offers it, a folder's atomic rename in
    a hierarchical-namespace bucket): fsspec's mv. A target that exists already is a move cut short (a set-aside
    finished by the next start): fsspec's recursive mv would put the rest into a subfolder of it (`cp -r`'s rule),
    so there each object is given its own target."""
    if is_url(os.fspath(source)):
        file_system, source_key = fsspec.core.url_to_fs(os.fspath(source))
        _, target_key = fsspec.core.url_to_fs(os.fspath(target))
        if not file_system.exists(target_key):
            file_system.mv(source_key, target_key, recursive=True)
            return
        objects = file_system.find(source_key)
        file_system.mv(objects, [target_key + key[len(source_key):] for key in objects])
        if file_system.exists(source_key):  # a hierarchical namespace's folders, now empty
            file_system.rm(source_key, recursive=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    source.rename(target)


def unwritten_checkpoint(directory: str, error: BaseException | str, newest: int | None) -> UserError:
    """A checkpoint save that failed (a full disk, a bucket refusing a write), in both backends' words: the
    storage's error (its end kept where long: the OS's words close it) and the newest complete checkpoint, from
    which the same command resumes."""
    reason = " ".join(str(error).split())
    reason = reason if len(reason) <= 400 else f"{reason[:200]} ... {reason[-190:]}"
    complete = f"the newest complete one is step {newest}" if newest is not None else "none is complete"
    return UserError(f"a checkpoint could not be written into {directory} ({reason}); {complete}: mend what it "
                     f"names (free space, write access, the storage) and run the same command to resume")


def warn_best_released(best: dict | None, steps: list[int], keep_best: bool, max_to_keep: int) -> None:
    """A resume without checkpoint.keep_best of a run that kept its best save (`best`, from the checkpoint's own
    record) older than the newest max_to_keep of `steps`: its next save deletes it, as the flag asks, but a resume
    that merely left the flag out (the base config, not the run's config.yaml) would lose it without a word. Said
    once, in both backends' words, with the way to keep it."""
    if keep_best or best is None or best["step"] not in sorted(steps)[:-max_to_keep]:
        return
    print(f"warning: checkpoint.keep_best is false, so the next save deletes step {best['step']}, the lowest eval "
          f"loss kept so far ({best['eval_loss']:.4f}), older than the newest checkpoint.max_to_keep={max_to_keep}; "
          f"resume with --checkpoint.keep_best=true to keep it", file=sys.stderr)


def read_lines(file: epath.Path) -> list[bytes]:
    """The lines of `file` as bytes, each with its line end (decoding is the reader's: a crash can leave bytes
    that are not text); none when it does not exist."""
    if not file.exists():
        return []
    return file.read_bytes().splitlines(keepends=True)


class GrowingFile:
    """A file that grows by records, starting as `records`: lines of text (metrics.jsonl) or bytes (TensorBoard's
    event records). On a local disk each record is appended and flushed as it is written. An object store has no
    append: there the records are kept, and the whole object uploaded at sync() (the run syncs before each
    checkpoint save, so the file always reaches the newest checkpoint), at close(), and at a write UPLOAD_EVERY_S
    seconds after the last upload, or 1 / UPLOAD_SHARE times that upload's seconds where longer: between the syncs
    the uploads, which grow with the file, then take at most that share of the run, and their bytes grow linearly
    with it (every 30 s they grew with its square: a review counted 260 GB for a 600k-step run's metrics.jsonl and
    events)."""

    def __init__(self, file: epath.Path, records: list[str] | list[bytes], *, binary: bool = False):
        self.file, self.remote, self.empty = file, is_url(os.fspath(file)), b"" if binary else ""
        self.records = list(records)
        write_whole(file, self.empty.join(self.records))
        self.uploaded_at, self.upload_every_s = time.monotonic(), UPLOAD_EVERY_S
        self.local = None if self.remote else open(file, "ab") if binary else open(file, "a", encoding="utf-8")

    def write(self, record: str | bytes) -> None:
        if self.local:
            with self._named():
                self.local.write(record)
                self.local.flush()
            return
        self.records.append(record)
        if time.monotonic() - self.uploaded_at >= self.upload_every_s:
            self.sync()

    def sync(self) -> None:
        if self.remote:
            started = time.monotonic()
            write_whole(self.file, self.empty.join(self.records))
            self.uploaded_at = time.monotonic()
            self.upload_every_s = max(UPLOAD_EVERY_S, (self.uploaded_at - started) / UPLOAD_SHARE)

    def close(self) -> None:
        if self.local:
            with self._named():
                self.local.close()
        else:
            self.sync()

    @contextlib.contextmanager
    def _named(self):
        """A local write's OSError (a full disk) naming the file, which a flush's does not."""
        try:
            yield
        except OSError as e:
            raise OSError(e.errno, e.strerror, os.fspath(self.file)) from None
