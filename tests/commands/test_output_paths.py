"""Every command that writes checks its output path before any work, and a bad path (a file where a folder
belongs, a folder under a file, a folder it may not write, a read-only file system, a path the system refuses)
is one line and exit 2, never a traceback."""

import argparse
import errno
import os
from pathlib import Path

import pytest

import agoq.files
from agoq.cli import main
from agoq.commands.arguments import run_command
from agoq.files import check_output_file, check_output_folder

BAD_FOLDERS = ("a file", "under a file", "read-only", "no permission", "refused by the system")


@pytest.fixture
def bad_folder(request, tmp_path, monkeypatch):
    """A folder path no command can write (the kind named by the parameter) and the text its message holds."""
    kind = request.param
    if kind in ("a file", "under a file"):
        blocker = tmp_path / "taken"
        blocker.write_text("a file the user keeps")
        return (blocker if kind == "a file" else blocker / "sub" / "dir"), "a file, not a folder"
    if kind == "read-only":  # a read-only mount, as the system reports it (whoever runs the test)
        real = agoq.files.tempfile.mkstemp

        def read_only(*args, dir=None, **kwargs):
            if dir is not None and Path(dir).is_relative_to(tmp_path / "mount"):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
            return real(*args, dir=dir, **kwargs)

        (tmp_path / "mount").mkdir()
        monkeypatch.setattr(agoq.files.tempfile, "mkstemp", read_only)
        return tmp_path / "mount" / "out", os.strerror(errno.EROFS)
    if kind == "no permission":
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder without write permission")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        request.addfinalizer(lambda: locked.chmod(0o755))
        return locked / "out", os.strerror(errno.EACCES)
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    return Path("/proc") / f"agoq-{os.getpid()}" / "out", "cannot write there"


def _refused(capsys, argv, path, said):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and said in err, err
    return err


def _no_work(*args, **kwargs):
    raise AssertionError("the command did work before checking its output path")


@pytest.mark.parametrize("bad_folder", BAD_FOLDERS, indirect=True)
def test_folder_outputs_are_checked_before_any_work(bad_folder, monkeypatch, capsys):
    import agoq.profiler.profile
    import agoq.train.trainer
    from agoq.commands import demo

    path, said = bad_folder
    monkeypatch.setattr(agoq.profiler.profile, "make_profile", _no_work)
    monkeypatch.setattr(agoq.train.trainer, "prepare", _no_work)
    monkeypatch.setattr(demo, "run_loop", _no_work)
    for argv in (["profile", "llama-tiny", "--device", "cpu", "--quiet"], ["train", "llama-tiny", "--quiet"],
                 ["demo", "--quiet"]):
        _refused(capsys, [*argv, "--out", str(path)], path, said)


@pytest.mark.parametrize("bad_folder", BAD_FOLDERS, indirect=True)
def test_file_outputs_are_checked_before_any_work(bad_folder, monkeypatch, capsys, tmp_path):
    import agoq.models

    folder, said = bad_folder
    path = folder / "out.json"
    monkeypatch.setattr(agoq.models, "build", _no_work)  # `agoq activations` builds its model from there
    missing = tmp_path / "no-profile-here"  # read only after --out is checked
    for argv in (["search", "--profile", str(missing), "--budget", "1GiB"], ["activations", "--quiet"], ["policy"]):
        _refused(capsys, [*argv, "--out", str(path)], path, said)


def test_a_folder_where_a_file_belongs_and_bad_storage(tmp_path, capsys):
    taken = tmp_path / "plan.json"
    taken.mkdir()
    for argv in (["search", "--profile", str(tmp_path), "--budget", "1GiB"], ["activations"], ["policy"]):
        _refused(capsys, [*argv, "--out", str(taken)], taken, "is a folder")
    out = tmp_path / "s" / "plan.json"
    (tmp_path / "f").write_text("x")
    search = ["search", "--profile", str(tmp_path / "none"), "--budget", "1GiB", "--out", str(out), "--storage"]
    _refused(capsys, [*search, str(tmp_path / "study.db")], tmp_path / "study.db", "database URL")
    _refused(capsys, [*search, str(tmp_path / "f" / "s.journal")], tmp_path / "f", "a file, not a folder")
    _refused(capsys, [*search, f"sqlite:///{tmp_path / 'f' / 's.db'}"], tmp_path / "f", "a file, not a folder")


def test_the_check_leaves_nothing_behind(tmp_path):
    before = sorted(tmp_path.rglob("*"))
    assert check_output_folder(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert check_output_file(tmp_path / "c" / "plan.json", "--out") == tmp_path / "c" / "plan.json"
    (tmp_path / "d").mkdir()
    check_output_folder(tmp_path / "d", "--out")
    assert sorted(tmp_path.rglob("*")) == [*before, tmp_path / "d"]


def _command(error):
    def func(args):
        raise error
    return argparse.Namespace(func=func)


def test_os_errors_about_a_path_are_messages_and_others_are_raised(capsys):
    """What escapes a command: an OSError naming a path is the user's (exit 2, one line naming it); one that names
    no path is not, and keeps its traceback."""
    path = f"/data/run-{os.getpid()}/x.bin"
    for error in (PermissionError(errno.EACCES, os.strerror(errno.EACCES), path),
                  IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path),
                  OSError(errno.EROFS, os.strerror(errno.EROFS), path)):
        assert run_command(_command(error), "agoq x") == 2
        err = capsys.readouterr().err
        assert err.startswith(f"agoq x: error: {path}: {error.strerror}") and err.count("\n") == 1
    assert run_command(_command(FileNotFoundError("plan file not found: p.json")), "agoq x") == 2
    assert capsys.readouterr().err == "agoq x: error: plan file not found: p.json\n"
    with pytest.raises(OSError, match="No space left"):
        run_command(_command(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))), "agoq x")
