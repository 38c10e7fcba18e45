"""Where a tool will write is checked when it starts: a folder that is a file, lies under one or is not writable,
and a tool's own flags (a count of 0, a --json file in no folder), end in one line with exit code 2 before any
work, and nothing is written."""

import importlib
import math
import os
import re
import subprocess
import sys

import argparse

import fsspec
import pytest
from hypothesis import given, strategies as st

from processes import finish, start_processes
from test_run import files_but_the_lock, small_args
from jaxtrain import cmdline, config, runfolder
from jaxtrain.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


def test_unwritable_says_why_in_each_case(tmp_path, a_file, monkeypatch):
    assert runfolder.unwritable(str(tmp_path / "new" / "deeper")) is None  # creatable
    assert runfolder.unwritable(str(tmp_path)) is None  # an existing folder
    assert runfolder.unwritable(str(a_file)) == "is a file"
    assert runfolder.unwritable(str(a_file / "x" / "y")) == f"lies under {a_file}, which is a file"
    # This machine's tests run as root, which may write anywhere: os.access is what a user without the right sees.
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path))
    assert runfolder.unwritable(str(tmp_path / "new")) == f"lies in {tmp_path}, where this user cannot write"
    assert runfolder.unwritable(str(tmp_path)) == "is a folder this user cannot write into"  # not "lies in" itself
    read_only = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: type("ReadOnly", (), {"f_flag": read_only.f_flag | os.ST_RDONLY}))
    assert runfolder.unwritable(str(tmp_path)) == "is on a read-only file system"  # not this user's doing
    assert runfolder.unwritable(str(tmp_path / "new")) == f"lies in {tmp_path}, on a read-only file system"


def test_a_run_folder_whose_checkpoints_cannot_be_written_is_refused_at_the_start(tmp_path, monkeypatch):
    """A checkpoints/ folder the user cannot write into (or immutable, or on a read-only mount) was found at the
    first save, after the steps before it, and jaxtrain then waited 300 s on orbax's threads before it exited."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(checkpoints))
    with pytest.raises(UserError) as refused:
        runfolder.check_local(str(tmp_path / "run"))
    assert str(refused.value) == (f"{checkpoints} is a folder this user cannot write into, and the run writes into "
                                  f"it; make it writable, or choose another --run.out_dir")


def test_fresh_starts_in_one_second_keep_every_previous_run(tmp_path, monkeypatch, capsys):
    """run.fresh moves checkpoints, the corrupt ones set aside, config.yaml, metrics, TensorBoard events and the W&B
    run aside, and nothing else (a file of the user's stays); a second fresh start in the same second (the stamp
    frozen here) moves the next run's aside under a counted name, overwriting nothing (a file renamed onto an
    existing name would replace it). config.yaml stayed, and the new run overwrote the old run's; it is copied, so
    that a start stopped before it writes its own still has one to run with."""
    monkeypatch.setattr(runfolder.time, "strftime", lambda fmt: "20261125-010203")
    (tmp_path / "notes.txt").write_text("the user's")

    def lay_out_a_run(label):
        (tmp_path / "checkpoints" / "4").mkdir(parents=True)
        (tmp_path / "checkpoints.corrupt" / "2-20261125-000000").mkdir(parents=True)
        (tmp_path / "tb").mkdir()
        for name in ("metrics.jsonl", "wandb.json", "config.yaml", "tb/events"):
            (tmp_path / name).write_text(label)

    lay_out_a_run("first")
    runfolder.set_aside_previous_run(str(tmp_path))
    lay_out_a_run("second")
    runfolder.set_aside_previous_run(str(tmp_path))
    moved = ("checkpoints", "checkpoints.corrupt", "config.yaml", "metrics.jsonl", "tb", "wandb.json")
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", "config.yaml"] + [
        f"{name}.before-fresh-20261125-010203{count}" for name in moved for count in ("", "-1")])
    assert (tmp_path / "config.yaml").read_text() == "second"  # copied: until the new run writes its own
    for count, label in (("", "first"), ("-1", "second")):
        for name in ("metrics.jsonl", "config.yaml", "tb/events"):
            top, _, below = name.partition("/")
            assert (tmp_path / f"{top}.before-fresh-20261125-010203{count}" / below).read_text() == label
        corrupt = tmp_path / f"checkpoints.corrupt.before-fresh-20261125-010203{count}"
        assert os.listdir(corrupt) == ["2-20261125-000000"]
    assert f"run.fresh: moved the previous run's tb to {tmp_path}/tb.before-fresh-20261125-010203-1" in \
        capsys.readouterr().err


# A run.fresh set-aside in a subprocess killed with -9 part way: after the first name (checkpoints) on a local
# disk, where each name moves in one rename; after the second object of the checkpoints folder in a bucket, where
# each object moves on its own. The stamp frozen, as the uninterrupted set-aside it is compared with takes it.
SET_ASIDE_KILLED = """
import os, signal, sys
from jaxtrain import runfolder
runfolder.time.strftime = lambda fmt: "20261128-093000"
moves = 0

def die_after(count):
    global moves
    moves += 1
    if moves == count:
        os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[1].startswith("gs://"):
    import fsspec, gcsfs
    fsspec.config.conf["nofiles_gather_batch_size"] = 1  # one object at a time, so that the kill falls between two
    real = gcsfs.GCSFileSystem._mv_file

    async def mv_file(self, *args, **kwargs):
        await real(self, *args, **kwargs)
        die_after(2)
    gcsfs.GCSFileSystem._mv_file = mv_file
else:
    real = runfolder.move

    def move(*args):
        real(*args)
        die_after(1)
    runfolder.move = move
runfolder.set_aside_previous_run(sys.argv[1])
"""


def files_under(folder: str) -> dict[str, bytes]:
    """Every file under `folder`, a local path or a URL, by its path below it."""
    file_system, key = fsspec.core.url_to_fs(folder)
    return {name[len(key):]: file_system.cat_file(name) for name in file_system.find(key)}


def check_a_killed_set_aside_is_finished_under_its_stamp(base: str, monkeypatch) -> dict[str, bytes]:
    """Kill a set-aside part way (SET_ASIDE_KILLED), see a start without run.fresh refused, start fresh a minute
    later: the folder ends as one uninterrupted set-aside leaves it, every name under the killed start's stamp.
    Returns what the kill left."""
    killed, whole = f"{base}/killed", f"{base}/whole"
    for folder in (killed, whole):
        for name in ("checkpoints/4/a", "checkpoints/4/b", "checkpoints/8/a", "checkpoints/8/b", "metrics.jsonl",
                     "tb/events", "config.yaml"):
            (runfolder.path(folder, name)).parent.mkdir(parents=True, exist_ok=True)
            runfolder.path(folder, name).write_text(f"{name} of the previous run")
    proc = subprocess.run([sys.executable, "-c", SET_ASIDE_KILLED, killed], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = files_under(killed)
    assert left["/.fresh-in-progress"] == b".before-fresh-20261128-093000"
    with pytest.raises(UserError, match=r"^a run.fresh start was stopped while it moved the previous run in .* "
                                        r"aside to \*.before-fresh-20261128-093000 .*add --run.fresh=true"):
        runfolder.refuse_unfinished_set_aside(killed, fresh=False)
    runfolder.refuse_unfinished_set_aside(killed, fresh=True)  # the start that finishes it goes on
    monkeypatch.setattr(runfolder.time, "strftime", lambda fmt: "20261128-093100")
    runfolder.set_aside_previous_run(killed)
    monkeypatch.setattr(runfolder.time, "strftime", lambda fmt: "20261128-093000")
    runfolder.set_aside_previous_run(whole)
    assert files_under(killed) == files_under(whole)
    runfolder.refuse_unfinished_set_aside(killed, fresh=False)  # nothing left to finish
    return left


def test_a_set_aside_killed_between_two_names_is_finished_under_its_stamp(tmp_path, monkeypatch):
    left = check_a_killed_set_aside_is_finished_under_its_stamp(str(tmp_path), monkeypatch)
    assert "/checkpoints.before-fresh-20261128-093000/4/a" in left and "/metrics.jsonl" in left  # cut in between


@pytest.mark.parametrize("tool", ["jaxtrain.run", "torchref.run"])
def test_a_start_without_fresh_is_refused_where_a_set_aside_was_cut_short(tmp_path, tool):
    """Neither resumed from the steps the set-aside had not moved, nor started over beside the moved ones."""
    (tmp_path / "checkpoints.before-fresh-20261128-093000" / "8").mkdir(parents=True)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / ".fresh-in-progress").write_text(".before-fresh-20261128-093000")
    before = files_but_the_lock(tmp_path)
    _one_error_line(_cli(tool, "--config", "configs/tiny.yaml", f"--run.out_dir={tmp_path}"),
                    f"stopped while it moved the previous run in {tmp_path} aside", "--run.fresh=true",
                    f"delete {tmp_path}/.fresh-in-progress")
    assert files_but_the_lock(tmp_path) == before and sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]


@pytest.mark.parametrize("tool", ["jaxtrain.run", "torchref.run"])
def test_a_fresh_start_over_a_journal_without_a_stamp_is_refused_before_it_moves_anything(tmp_path, tool):
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / ".fresh-in-progress").write_text("garbage")
    _one_error_line(_cli(tool, "--config", "configs/tiny.yaml", f"--run.out_dir={tmp_path}", "--run.fresh=true"),
                    f"{tmp_path}/.fresh-in-progress should hold the stamp", "holds 'garbage'")
    assert sorted(os.listdir(tmp_path)) == [".fresh-in-progress", "checkpoints"]  # as it was: no lock left


def test_two_processes_refuse_a_journal_without_a_stamp_each_in_one_line(tmp_path, cache_dir):
    """A fresh start of two processes: the set-aside runs on process 0 alone, after the compile, while process 1
    waits at its barrier; had process 0 alone met the journal there, process 1 would wait until the barrier's
    timeout. Each reads it at the start and refuses."""
    (tmp_path / ".fresh-in-progress").write_text("garbage")
    cmd = [sys.executable, "-m", "jaxtrain.run", *small_args(str(tmp_path), cache_dir), "--mesh.fsdp=2",
           "--run.fresh=true"]
    procs = start_processes([cmd] * 2, 2, cwd=REPO, stderr=subprocess.PIPE, text=True)
    errs = [err for *_, err in finish(procs, 120)]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert all(err.strip().splitlines()[-1].startswith(f"error: {tmp_path}/.fresh-in-progress should hold the stamp")
               for err in errs), errs


@pytest.mark.parametrize("fresh", [False, True])
def test_a_set_aside_journal_without_a_stamp_is_refused(tmp_path, fresh):
    """By every process at the start, fresh or not (a fresh start's set-aside runs on process 0 alone, after the
    compile); moving metrics.jsonl onto itself plus "" would lose it."""
    (tmp_path / "metrics.jsonl").write_text("a line")
    (tmp_path / ".fresh-in-progress").write_text("")
    stampless = r"should hold the stamp of an unfinished run.fresh set-aside.* holds ''"
    with pytest.raises(UserError, match=stampless):
        runfolder.refuse_unfinished_set_aside(str(tmp_path), fresh)
    with pytest.raises(UserError, match=stampless):
        runfolder.set_aside_previous_run(str(tmp_path))
    assert (tmp_path / "metrics.jsonl").read_text() == "a line"


def test_a_moved_run_folders_own_config_says_where_the_run_goes_on(tmp_path, capsys):
    """A run folder moved after it was written: its config.yaml still names the old folder as run.out_dir, and
    `--config <moved>/config.yaml` alone would start the run there again from step 0 (before, in silence)."""
    moved = tmp_path / "moved"
    (moved / "checkpoints" / "4").mkdir(parents=True)
    (moved / "config.yaml").write_text(f"run: {{out_dir: {tmp_path / 'old'}}}\n")
    config.load(["--config", str(moved / "config.yaml")])
    assert capsys.readouterr().err == (f"warning: {moved / 'config.yaml'} is the config of the run in {moved}, but its "
                                       f"run.out_dir is {tmp_path / 'old'}: the run goes on there; to resume the run in "
                                       f"{moved}, add --run.out_dir={moved}\n")
    config.load(["--config", str(moved / "config.yaml"), f"--run.out_dir={tmp_path / 'elsewhere'}"])  # said so
    (moved / "config.yaml").write_text(f"run: {{out_dir: {moved}}}\n")  # where it is
    config.load(["--config", str(moved / "config.yaml")])
    assert capsys.readouterr().err == ""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 2, no traceback, and stderr one line that names every word."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].count("error:") == 1 and all(w in lines[0] for w in words), proc.stderr


def test_run_out_dir_under_a_file(a_file):
    _one_error_line(_cli("jaxtrain.run", "--config", "configs/tiny.yaml", f"--run.out_dir={a_file}/run"),
                    f"run.out_dir='{a_file}/run' lies under {a_file}, which is a file", "--run.out_dir")


@pytest.mark.parametrize("name,kind", [("tb", "folder"), (".lock", "file"), ("checkpoints.corrupt", "folder")])
def test_an_entry_of_the_run_folder_of_the_wrong_kind_is_named(tmp_path, name, kind):
    if kind == "folder":
        (tmp_path / name).write_text("x")
    else:
        (tmp_path / name).mkdir()
    with pytest.raises(UserError) as e:
        config.load(["--config", "configs/tiny.yaml", f"--run.out_dir={tmp_path}"])
    other = "file" if kind == "folder" else "folder"
    assert str(e.value) == (f"{tmp_path / name} is a {other} where the run keeps a {kind} of that name; move it aside, "
                            f"or choose another --run.out_dir")


@pytest.mark.parametrize("tool", ["jaxtrain.run", "torchref.run"])
def test_run_out_dir_the_kernel_refuses(tool):
    _one_error_line(_cli(tool, "--config", "configs/tiny.yaml", "--run.out_dir=/proc/x/run"),
                    "run.out_dir='/proc/x/run' cannot be created or written (No such file or directory: /proc/x)")


def test_prepare_out_is_a_file(tmp_path, a_file):
    text = tmp_path / "in.txt"
    text.write_text("hello\n" * 100)
    _one_error_line(_cli("jaxtrain.data", "prepare", "--input", str(text), "--out", str(a_file), "--tokenizer",
                         "bytes"), f"--out '{a_file}' is a file; choose another --out")
    assert a_file.read_text() == "not a folder"


def test_convert_dst_under_a_file_is_refused_before_the_source_is_read(tmp_path, a_file):
    """The source does not exist either: the destination is checked first, so the user learns both in turn
    without reading a checkpoint for nothing."""
    _one_error_line(_cli("jaxtrain.convert", "to-torch", str(tmp_path / "no-such-step"), str(a_file / "dst")),
                    f"DST '{a_file}/dst' lies under {a_file}, which is a file")


@pytest.mark.parametrize("tool,flags,words", [
    ("benchmarks.run", ["--steps", "0"], ["argument --steps", "'0' is not a whole number >= 1"]),
    ("benchmarks.run", ["--rounds", "-1"], ["argument --rounds", "'-1' is not a whole number >= 1"]),
    ("benchmarks.run", ["--peak-tflops", "-1"], ["argument --peak-tflops", "'-1' is not a finite number > 0"]),
    ("benchmarks.run", ["--peak-tflops", "nan"], ["argument --peak-tflops", "'nan' is not a finite number > 0"]),
    ("benchmarks.run", ["--json", "{missing}/bench.json"], ["argument --json", "which is not a folder"]),
    ("benchmarks.run", ["--json", "{tmp}"], ["argument --json", "is a folder; choose another file"]),
    ("benchmarks.profile", ["--steps", "zero"], ["argument --steps", "'zero' is not a whole number >= 1"]),
    ("benchmarks.roofline", ["--hlo", "{missing}/step.hlo"], ["argument --hlo", "which is not a folder"]),
    ("benchmarks.xla_flags", ["--target", "cpu", "--devices", "0"], ["argument --devices", "'0'"]),
    ("benchmarks.xla_flags", ["--target", "cpu", "--hlo", "{file}/hlo"], ["argument --hlo", "which is a file"]),
    ("parity_tests.report", ["--out", "{file}/report"], ["argument --out", "which is a file; choose another folder"]),
    ("parity_tests.report", ["--out", "{tmp}/report", "--steps", "0"], ["argument --steps", "'0'"]),
])
def test_tool_flags_are_checked_before_any_work(tmp_path, a_file, tool, flags, words):
    fill = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path), "file": str(a_file)}
    _one_error_line(_cli(tool, "--config", "configs/tiny.yaml", *(f.format(**fill) for f in flags)), *words)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # nothing written


@pytest.mark.parametrize("tool,argv,message", [
    ("jaxtrain.data", ["prepare", "--input", "a.txt"], "the following arguments are required: --out, --tokenizer; "
                                                       "see python -m jaxtrain.data prepare --help"),
    ("jaxtrain.data", ["stats", "--data_path", "d"], "unrecognized arguments: --data_path d; see python -m "
                                                     "jaxtrain.data stats --help"),
    ("jaxtrain.sample", ["--run", "out/tiny", "--top-k", "5"], "unrecognized arguments: --top-k 5; see python -m "
                                                               "jaxtrain.sample --help"),
    ("jaxtrain.convert", [], "the following arguments are required: command; see python -m jaxtrain.convert --help"),
    ("jaxtrain.convert", ["to-torch", "out/tiny/checkpoints/4"], "the following arguments are required: dst; see "
                                                                 "python -m jaxtrain.convert to-torch --help"),
    ("jaxtrain.sample", ["--run", "out/tiny", "--top_k", "many"], "argument --top_k: invalid int value: 'many'; see "
                                                                   "python -m jaxtrain.sample --help"),
    ("parity_tests.inject_nan", ["jaxtrain"], "the following arguments are required: steps; see python -m "
                                              "parity_tests.inject_nan --help"),
])
def test_a_command_line_argparse_refuses_is_one_line_naming_its_help(tmp_path, monkeypatch, capsys, tool, argv,
                                                                      message):
    """argparse's refusals, in jaxtrain's one line (errors.OneLineParser), not its usage block: the line names the
    subcommand's own --help where there is one."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(tool).main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert os.listdir(tmp_path) == []


@given(st.integers(-10**6, 10**6))
def test_positive_int_takes_whole_numbers_from_1(n):
    if n >= 1:
        assert cmdline.positive_int(str(n)) == n
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{n}' is not a whole number >= 1"):
            cmdline.positive_int(str(n))


@given(st.text().filter(lambda t: not t.strip().lstrip("+").replace("_", "").isdigit()))
def test_positive_int_refuses_what_is_not_a_whole_number(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a whole number >= 1"):
        cmdline.positive_int(text)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_positive_float_takes_finite_numbers_above_0(x):
    if math.isfinite(x) and x > 0:
        assert cmdline.positive_float(repr(x)) == x
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^'{re.escape(repr(x))}' is not a finite number > 0$"):
            cmdline.positive_float(repr(x))


def _not_a_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


@given(st.text().filter(_not_a_float))
def test_positive_float_refuses_what_is_not_a_number(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a finite number > 0"):
        cmdline.positive_float(text)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (a Linux device) to fill the disk with")
def test_a_disk_that_fills_during_the_run_is_one_line_naming_the_file(tmp_path, capsys):
    """metrics.jsonl's appends meet a full disk (/dev/full answers every write with ENOSPC): one line naming the
    file and the fix, exit code 2, from the write and again from the close that flushes what is left."""
    from etils import epath
    from jaxtrain.errors import exit_on_user_error
    metrics = tmp_path / "metrics.jsonl"
    log = runfolder.GrowingFile(epath.Path(metrics), [])
    log.local.close()
    log.local = open("/dev/full", "a", encoding="utf-8")  # the disk is full from here on
    for last_words in (lambda: log.write('{"step": 1}\n'), log.close):
        with pytest.raises(SystemExit) as ended, exit_on_user_error():
            last_words()
        assert ended.value.code == 2
        assert capsys.readouterr().err == (f"error: could not write {metrics} (No space left on device): mend what "
                                           f"it names (free space, write access, the storage) and run the same "
                                           f"command again\n")


def test_an_object_store_file_is_uploaded_whole_at_most_a_twentieth_of_the_time(monkeypatch):
    """Each upload is of the whole object, which grows with the run: every 30 s, the uploads took a growing share
    of the run (2 s in 30 by a 600k-step run's end). Now at least 30 s, and at least 20 times the last upload's
    seconds, apart: a 3 s upload puts the next 60 s later. A fake clock; uploads recorded, not made."""
    from etils import epath
    clock, uploads = [0.0], []

    def upload(file, data):  # an upload of 3 s once the file holds 3 records
        uploads.append((clock[0], data))
        clock[0] += 3.0 if data.count("\n") >= 3 else 0.0

    monkeypatch.setattr(runfolder.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runfolder, "write_whole", upload)
    log = runfolder.GrowingFile(epath.Path("gs://bucket/run/metrics.jsonl"), [])
    for step in range(1, 15):  # a record every 10 s
        clock[0] += 10.0
        log.write(f"{step}\n")
    assert [(at, data.count("\n")) for at, data in uploads] == [(0.0, 0), (30.0, 3), (93.0, 9)]
    clock[0] = 155.0  # 59 s after the last upload ended (62 after it began): not yet; 60 s after it: uploaded
    log.write("15\n")
    clock[0] = 156.0
    log.write("16\n")
    assert [at for at, _ in uploads] == [0.0, 30.0, 93.0, 156.0]
