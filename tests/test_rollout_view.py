"""`vsup status` / `vsup reload` text for a rollout's record (vsup/cli/rollout_view.py)."""

from __future__ import annotations

from vsup.cli.rollout_view import render_changing, render_rollout

STEP = {"index": 0, "action": "replace", "why": "command line +--dtype bfloat16", "how": "in place, on port 8100: its CPUs 0 are in use",
        "state": "done", "detail": "ready again as pid 4301"}


def record(**fields) -> dict:
    base = {"kind": "reload", "trigger": "SIGHUP", "state": "done", "started": 10.0, "took": 41.2, "error": None, "step": 2,
            "steps": [STEP, {**STEP, "index": 1, "detail": "ready again as pid 4302"}], "unchanged": [], "applied": []}
    return {**base, **fields}


def test_a_finished_reload_is_one_line_unless_asked_for_the_steps():
    assert render_rollout(record(), steps=False) == ["last reload (SIGHUP): done after 41s; 2 replaced, 0 unchanged"]
    assert render_rollout(record(applied=["proxy.policy"]))[1:] == [
        "  instance 0: replace (command line +--dtype bfloat16), in place, on port 8100: its CPUs 0 are in use: done — ready again as pid 4301",
        "  instance 1: replace (command line +--dtype bfloat16), in place, on port 8100: its CPUs 0 are in use: done — ready again as pid 4302",
        "  applied at once: proxy.policy"]
    assert render_rollout(record(not_applied=["start.mode (read when `vsup run` starts)"]), steps=False)[1:] == [
        "  not applied by the running vsup: start.mode (read when `vsup run` starts)"]
    assert render_rollout(None) == []


def test_a_running_or_failed_one_shows_every_step_and_the_error():
    running = record(state="running", step=2, steps=[STEP, {**STEP, "index": 1, "state": "running", "how": "beside, on port 8201",
                                                           "new": {"name": "1b", "port": 8201, "pid": 99, "state": "warming"}}])
    lines = render_rollout(running, steps=False)
    assert lines[0] == "reload (SIGHUP) running for 41s: step 2 of 2; 1 replaced, 0 unchanged"
    assert lines[2].endswith("beside, on port 8201: running — 1b on port 8201 is warming")
    failed = record(state="failed", error="instance 1: instance 1 did not become ready (exited with code 1)",
                    steps=[STEP, {**STEP, "index": 1, "state": "failed"}])
    lines = render_rollout(failed, steps=False)
    assert lines[0].startswith("last reload (SIGHUP): FAILED after 41s") and lines[1].startswith("  error: instance 1:")
    assert lines[-1].endswith(": FAILED")
    rejected = render_rollout(record(state="rejected", steps=[], error="vsup.yaml:2: instances: 0 is not valid"), steps=False)
    assert rejected == ["last reload (SIGHUP): REJECTED after 41s", "  error: vsup.yaml:2: instances: 0 is not valid"]


def test_instances_outside_the_fleet_say_which_side_they_are_on():
    assert render_changing([{"index": 1, "name": "1b", "port": 8201, "pid": 99, "state": "warming"},
                            {"index": 0, "name": "0", "port": 8100, "pid": 98, "state": "draining"}]) == [
        "  instance 1 (1b, port 8201, pid 99): warming (its replacement)",
        "  instance 0 (0, port 8100, pid 98): draining (being replaced)"]


def test_a_follow_up_reload_waiting_or_reading_never_reads_done():
    running = render_rollout(record(state="running", pending="SIGHUP"), steps=False)
    assert running[0] == ("reload (SIGHUP) running for 41s: step 2 of 2; 2 replaced, 0 unchanged; then another reload "
                          "(SIGHUP: the file changed during this one)")
    assert render_rollout(record(state="pending", pending="SIGHUP")) == [
        "reload (SIGHUP) pending: the file is re-read once the last change has ended"]
    assert render_rollout(record(state="running", steps=[], step=0), steps=False) == [
        "reload (SIGHUP) running for 41s: reading and checking the file"]


def test_under_unix_sockets_the_lines_name_the_socket_not_a_port():
    step = {**STEP, "index": 1, "state": "running", "how": "beside, on socket 1b.sock: its CPUs 2-3 are free",
            "new": {"name": "1b", "port": 8201, "at": "socket 1b.sock", "pid": 99, "state": "warming"}}
    lines = render_rollout(record(state="running", step=1, steps=[step]), steps=True)
    assert lines[1].endswith("beside, on socket 1b.sock: its CPUs 2-3 are free: running — 1b on socket 1b.sock is warming")
    assert "port" not in lines[1]
    changing = render_changing([{"index": 1, "name": "1b", "port": 8201, "address": "/run/vsup/instances-8000/1b.sock",
                                 "pid": 99, "state": "warming"}])
    assert changing == ["  instance 1 (1b, /run/vsup/instances-8000/1b.sock, pid 99): warming (its replacement)"]
