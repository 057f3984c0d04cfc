"""Files vsup writes are its own: root's vsup never follows a link another user planted (uid 65534,
a real second uid, in a working directory everyone may write), the instance logs go to a private
folder by default (not the working directory), folders are 0700 and files 0600 (0750/0640 for
log.group), rotation and reopening never write through a link, and tune's report the same."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.tools import AS_NOBODY, need_nobody_running
from tests.vsup_harness import VSUP, VsupRun, make_config
from vsup.errors import VsupError
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.rundir import default_log_dir
from vsup.tune.results import ResultsFile

pytestmark = pytest.mark.timeout(120)

ROOTS = "root's own lines\n"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def make_log(directory: Path, **kwargs) -> InstanceLog:
    options = dict(max_bytes=1024, backups=2, echo=False, logger=logging.getLogger("test.own_files"))
    options.update(kwargs)
    return InstanceLog("i0", directory, **options)


@pytest.fixture
def box():
    """A folder in /tmp (uid 65534 can reach it): `work`, a working directory everyone may write
    (0777), and `secret`, root's private folder with a 0600 file `victim`."""
    outer = Path(tempfile.mkdtemp(prefix="vsup-own-"))
    outer.chmod(0o755)
    work = outer / "work"
    work.mkdir()
    work.chmod(0o777)
    secret = outer / "secret"
    secret.mkdir(mode=0o700)
    victim = secret / "victim"
    victim.write_text(ROOTS)
    victim.chmod(0o600)
    yield outer, work, victim
    shutil.rmtree(outer)


def as_nobody(script: str, cwd: Path) -> None:
    """`sh -c script` as uid 65534 (the other local user)."""
    need_nobody_running(["/bin/sh", "-c", "true"])
    subprocess.run([*AS_NOBODY, "/bin/sh", "-c", script], cwd=cwd, check=True, timeout=30, stdin=subprocess.DEVNULL)


def plant_links(work: Path, victim: Path) -> Path:
    """What another user does in a working directory they may write: a `vsup-logs` folder of
    theirs whose log names point at root's files (one that exists, one to be made)."""
    as_nobody(f"mkdir vsup-logs && ln -s {victim} vsup-logs/i0.log && ln -s {victim.parent / 'made'} vsup-logs/i1.log", work)
    assert (work / "vsup-logs").stat().st_uid == 65534
    return work / "vsup-logs"


def test_a_log_dir_another_user_made_or_may_write_is_refused_and_no_link_is_followed(box):
    _outer, work, victim = box
    planted = plant_links(work, victim)
    for name in ("i0", "i1"):
        with pytest.raises(VsupError) as err:
            InstanceLog(name, planted, max_bytes=4096, backups=1, echo=False, logger=logging.getLogger("test"))
        assert str(err.value) == (f"log.dir {str(planted)!r} is owned by uid 65534, not by vsup's user (uid 0): another user "
                                  "could plant links there; use a folder of vsup's own user that only it may write "
                                  "(or leave the setting unset)")
    # root's own folder, but others may write it (the 0777 working directory itself)
    with pytest.raises(VsupError, match=r"log.dir '.*/work' is writable by others \(mode 0777\)"):
        make_log(work)
    # a link at the folder's own name is not followed either
    as_nobody(f"ln -s {victim.parent} logs-link", work)
    work.chmod(0o755)  # (now only root may write the working directory: the link alone is the problem)
    with pytest.raises(VsupError, match=r"log.dir '.*/logs-link' is a symlink \(vsup does not follow it\)"):
        make_log(work / "logs-link")
    assert victim.read_text() == ROOTS and not (victim.parent / "made").exists()
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_root_in_a_working_directory_others_may_write_logs_to_its_private_state_folder(box):
    """The issue's case end to end: `vsup run` as root from a 0777 folder where another user planted
    ./vsup-logs with links; log.dir unset. The logs go to the state folder, private."""
    outer, work, victim = box
    plant_links(work, victim)
    state = outer / "state"
    config = make_config(work, instances=1, log={"dir": None})
    run = VsupRun(work, config, env={"XDG_STATE_HOME": str(state), "LOGS_DIRECTORY": ""})
    try:
        run.wait_ready(1, timeout=60)
        assert run.terminate() == 0
    finally:
        run.close()
    logs = state / "vsup" / "logs"
    assert mode(logs) == 0o700 and os.lstat(logs).st_uid == 0
    assert mode(logs / "i0.log") == 0o600 and "started" in (logs / "i0.log").read_text()
    assert victim.read_text() == ROOTS and not (victim.parent / "made").exists()


def test_default_log_dir_is_systemds_else_the_users_state_folder():
    assert default_log_dir({"LOGS_DIRECTORY": "/var/log/vsup:/var/log/other", "HOME": "/h"}) == Path("/var/log/vsup")
    assert default_log_dir({"XDG_STATE_HOME": "/s", "HOME": "/h"}) == Path("/s/vsup/logs")
    # a relative XDG_STATE_HOME is ignored (the XDG rule), the home's default taken
    assert default_log_dir({"XDG_STATE_HOME": "rel", "HOME": "/h"}) == Path("/h/.local/state/vsup/logs")
    assert default_log_dir({}) == Path(os.path.expanduser("~root" if os.geteuid() == 0 else "~")) / ".local/state/vsup/logs"


def test_folders_are_0700_files_0600_and_an_older_0644_log_becomes_private(tmp_path):
    log = make_log(tmp_path / "fresh" / "logs")
    log.line("stdout", "x")
    log.close()
    assert mode(tmp_path / "fresh" / "logs") == 0o700 and mode(tmp_path / "fresh" / "logs" / "i0.log") == 0o600
    older = tmp_path / "older"
    older.mkdir(mode=0o755)  # an older vsup's folder: readable by others, writable by none: kept
    (older / "i0.log").write_text("old line\n")
    (older / "i0.log").chmod(0o644)
    make_log(older).close()
    assert mode(older / "i0.log") == 0o600 and (older / "i0.log").read_text() == "old line\n"


def test_log_group_makes_the_folder_0750_and_the_files_0640_of_that_group(tmp_path):
    gid = 65534
    log = make_log(tmp_path / "logs", group=gid, max_bytes=1024, backups=1)
    for i in range(60):
        log.line("stdout", f"line {i} " + "z" * 30)
    log.close()
    folder = tmp_path / "logs"
    assert mode(folder) == 0o750 and folder.stat().st_gid == gid
    for name in ("i0.log", "i0.log.1"):
        assert mode(folder / name) == 0o640 and (folder / name).stat().st_gid == gid, name


def test_rotation_and_reopening_never_write_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(ROOTS)
    folder = tmp_path / "logs"
    # backups 0: the file starts over; a link put at its name meanwhile is not truncated through
    log = make_log(folder, backups=0)
    log.line("stdout", "first")
    (folder / "i0.log").unlink()
    (folder / "i0.log").symlink_to(victim)
    for i in range(40):
        log.line("stdout", f"line {i} " + "y" * 30)
    log.close()
    assert victim.read_text() == ROOTS
    # backups: a link at a backup's name is moved along (rename acts on the link), never written
    shutil.rmtree(folder)
    log = make_log(folder, backups=2)
    (folder / "i0.log.1").symlink_to(victim)
    for i in range(60):
        log.line("stdout", f"line {i} " + "y" * 30)
    log.close()
    assert victim.read_text() == ROOTS
    assert not (folder / "i0.log.1").is_symlink() and (folder / "i0.log").is_file()
    # reopening after a failure: a link there is refused, the lines go to the echo
    shutil.rmtree(folder)
    log = make_log(folder, backups=1)
    log._fail(OSError(5, "Input/output error"))  # (what a failed write does: close, retry later)
    (folder / "i0.log").unlink()
    (folder / "i0.log").symlink_to(victim)
    log._retry_at = 0.0
    log.line("stdout", "after the failure")
    log.close()
    assert victim.read_text() == ROOTS
    # and at the start: one line naming the link
    with pytest.raises(VsupError, match=r"log file '.*/i0.log' cannot be opened for writing \(it is a symlink, which vsup does not follow\)"):
        make_log(folder)


def test_tunes_results_file_is_never_written_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(ROOTS)
    report = tmp_path / "report"
    report.mkdir(mode=0o700)
    (report / "results.jsonl").symlink_to(victim)
    with pytest.raises(VsupError, match=r"--report: .*/results.jsonl is a symlink, which vsup does not follow"):
        ResultsFile(report / "results.jsonl").start({"model": "m"}, resume=False)
    (report / "results.jsonl").unlink()
    results = ResultsFile(report / "results.jsonl")
    results.start({"model": "m"}, resume=False)
    assert mode(report / "results.jsonl") == 0o600
    (report / "results.jsonl").rename(report / "kept")
    (report / "results.jsonl").symlink_to(victim)  # swapped while the search ran
    with pytest.raises(OSError):
        results.append({"type": "pruned"})
    assert victim.read_text() == ROOTS


def test_tunes_report_folder_of_another_user_is_refused_before_measuring(box):
    _outer, work, victim = box
    as_nobody("mkdir report && chmod 0755 report", work)
    config = work / "c.yaml"
    config.write_text("model: m\nplacement:\n  model_size_gib: 0.25\n")
    for report, why in ((work / "report", "is owned by uid 65534, not by vsup's user (uid 0)"),
                        (work, "is writable by others (mode 0777)")):
        out = subprocess.run([*VSUP, "tune", "-c", str(config), "--no-roofline", "--report", str(report)], capture_output=True,
                             text=True, timeout=60, cwd=work, stdin=subprocess.DEVNULL)
        assert out.returncode == 2, out.stderr[-3000:]
        assert out.stderr.startswith(f"vsup: error: --report {str(report)!r} {why}: another user could plant links there")
        assert out.stderr.count("\n") == 1, out.stderr
    assert victim.read_text() == ROOTS
