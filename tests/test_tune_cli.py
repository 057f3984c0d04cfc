"""`vsup tune` end to end over the fake vLLM's speed model: real `vsup run` children, real ports.

The fake's steps are 3× slower when OpenMP takes every CPU of its mask and threads beyond one add
nothing (FAKE_VLLM_BUSY_PENALTY, FAKE_VLLM_SATURATE_THREADS), so on two cores one instance with
one thread and an idle core is known to be best (the seed's "about half the cores"), and
LD_PRELOAD makes it faster still. The machine is a hand-made 2-core sysfs (--fsroot), pinned with
taskset to CPUs 0-1, which every test machine has. Every process a test starts carries a unique
marker in its environment, so "nothing left behind" is checked without counting other tests' fakes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from tests.fakevllm import WRAPPER
from tests.sysfs_builder import GIB, build_sysfs
from tests.vsup_harness import VSUP
from vsup.config.planning import plan_from_config
from vsup.config.schema import load_config

pytestmark = pytest.mark.timeout(240)

SPEED = {"FAKE_VLLM_STEP_TIME": "0.02", "FAKE_VLLM_SATURATE_THREADS": "1", "FAKE_VLLM_BUSY_PENALTY": "3",
         "FAKE_VLLM_PRELOAD_SPEEDUP": "1.6", "FAKE_VLLM_ACCESS_LOG": "0"}
QUICK = ["--concurrency", "4", "--input-len", "8", "--output-len", "12", "--min-duration", "1s", "--max-duration", "2s",
         "--no-roofline",
         "--max-num-seqs", "8"]


class Tuning:
    def __init__(self, tmp: Path, command: list[str] | None = None, **config) -> None:
        self.tmp = tmp
        self.fsroot = build_sysfs(tmp / "machine", nodes=(2,), node_memory=8 * GIB)
        lib = self.fsroot / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"")  # found like the real one; ld.so skips it with a warning
        self.config = {
            "model": "fake-model",
            "placement": {"launcher": "taskset", "reserve_cores": 0, "model_size_gib": 0.25,
                          "overhead_gib": 0.25, "memory_reserve_gib": 0.5},
            "vllm": {"command": command or [str(WRAPPER), "serve"], "args": ["--max-num-seqs", "8"]},
            "health": {"interval": 0.3, "startup_timeout": 30},
            "restart": {"max_delay": 0.2},
            "stop": {"timeout": 5},
            "proxy": {"drain_timeout": 1},
            **config,
        }
        self.config_path = tmp / "vsup.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.report = tmp / "report"
        self.marker = f"VSUP_TUNE_TEST={uuid.uuid4().hex}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_VLLM_")}
        self.env.update(SPEED)
        self.env[self.marker.split("=")[0]] = self.marker.split("=")[1]

    def argv(self, *extra: str) -> list[str]:
        return [*VSUP, "tune", "--config", str(self.config_path), "--fsroot", str(self.fsroot),
                "--report", str(self.report), *QUICK, *extra]

    def run(self, *extra: str, timeout: float = 200) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*extra), cwd=self.tmp, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def results(self, kind: str | None = None) -> list[dict]:
        lines = [json.loads(line) for line in (self.report / "results.jsonl").read_text().splitlines() if line.strip()]
        return [e for e in lines if kind is None or e["type"] == kind]

    def leftovers(self) -> list[int]:
        """Live processes (vsup, fake servers, EngineCores, Workers) started by this test."""
        needle = self.marker.encode() + b"\0"
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.pid != os.getpid() and needle in (Path(f"/proc/{proc.pid}/environ").read_bytes() + b"\0") \
                        and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
            except (OSError, psutil.Error):
                continue
        return found

    def cleanup(self) -> None:
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def tuning(tmp_path):
    made = []

    def make(**kw) -> Tuning:
        made.append(Tuning(tmp_path, **kw))
        return made[-1]

    yield make
    for t in made:
        t.cleanup()


def test_the_known_best_layout_wins_preload_becomes_the_default_and_the_written_config_plans(tuning):
    t = tuning()
    out = t.run("--budget", "2m", "--preload", "none,tcmalloc,iomp", "--write-config", str(t.tmp / "tuned.yaml"))
    assert out.returncode == 0, out.stderr[-3000:]

    final = t.results("result")[-1]
    assert final["best"] == "i1-t1-tcmalloc", out.stdout
    assert final["ranking"][:2] == ["i1-t1-tcmalloc", "i1-t1"]
    screened = {e["candidate"] for e in t.results("run") if e["stage"] == "screen"}
    assert screened == {"i1", "i1-t1", "i2"}
    pruned = {e["candidate"]: e["reason"] for e in t.results("pruned")}
    assert pruned["i1-hk"] == "same placement as i1-t1"
    assert "2 instance(s) need 4 physical cores" in pruned["i2-hk"]
    assert pruned["preload:iomp"].startswith("libiomp5.so not found")
    best_row = next(line for line in out.stdout.splitlines() if "i1-t1-tcmalloc" in line)
    assert "best" in best_row

    # the written config is a complete vsup configuration of the winner, figures as comments
    tuned = t.tmp / "tuned.yaml"
    text = tuned.read_text()
    assert text.startswith("# Written by `vsup tune`") and "output tokens/s" in text
    cfg = load_config(tuned)
    _machine, plan = plan_from_config(cfg, t.fsroot)
    [inst] = plan.instances
    assert inst.cpus == (0, 1) and inst.omp_cpus == (0,)
    [library] = cfg.vllm.preload  # the winning preload, as vllm.preload (the user's vllm.env untouched)
    assert library == str(t.fsroot / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4") and "LD_PRELOAD" not in cfg.vllm.env
    assert cfg.vllm.args == ["--max-num-seqs", "8"]

    # the report: a real PNG and a summary that names the winner
    from PIL import Image

    with Image.open(t.report / "chart.png") as image:
        assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 200
    summary = (t.report / "summary.md").read_text()
    assert "**Best: `i1-t1-tcmalloc`**" in summary and "![throughput against time to first token](chart.png)" in summary
    assert not t.leftovers()


def test_a_candidate_killed_at_start_is_recorded_as_failed_and_the_search_goes_on(tuning, tmp_path):
    # one layout dies like an out-of-memory kill: the 2-thread instance is SIGKILLed as it starts
    wrapper = tmp_path / "oom-vllm"
    wrapper.write_text(f'#!/bin/sh\nif [ "$OMP_NUM_THREADS" = 2 ]; then kill -9 $$; fi\nexec {WRAPPER} "$@"\n')
    wrapper.chmod(0o755)
    t = tuning(command=[str(wrapper), "serve"])
    out = t.run("--budget", "2m", "--preload", "none", "--objective", "latency")
    assert out.returncode == 0, out.stderr[-3000:]
    failed = [e for e in t.results("run") if not e["ok"]]
    assert [e["candidate"] for e in failed] == ["i1"]
    assert "SIGKILL" in failed[0]["error"], failed[0]["error"]
    assert t.results("result")[-1]["best"] == "i1-t1"
    failed_row = next(line for line in out.stdout.splitlines() if " i1 " in line)
    assert "failed" in failed_row and "SIGKILL" in failed_row
    assert not t.leftovers()


def test_a_budget_too_small_for_more_than_one_run_skips_the_rest_and_says_so(tuning):
    t = tuning()
    out = t.run("--budget", "1s", "--preload", "none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e["candidate"] for e in t.results("run")] == ["i1"]  # the first run always happens
    skipped = t.results("skipped")
    assert {e["candidate"] for e in skipped} == {"i1-t1", "i2"}
    assert all(e["reason"].startswith("budget:") for e in skipped)
    assert "skipped" in out.stdout


def test_ctrl_c_stops_the_running_candidate_and_resume_finishes_the_search(tuning):
    t = tuning()
    proc = subprocess.Popen(t.argv("--budget", "2m", "--preload", "none"), cwd=t.tmp, env=t.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = t.results("run") if (t.report / "results.jsonl").exists() else []
            # one run recorded and the next candidate's vsup (and its fake) running
            if len(runs) >= 1 and len(t.leftovers()) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the second candidate never started")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "--resume continues" in stderr
    assert not t.leftovers(), "Ctrl-C left processes behind"
    recorded = [(e["candidate"], e["stage"]) for e in t.results("run")]

    out = t.run("--budget", "2m", "--preload", "none", "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [(e["candidate"], e["stage"]) for e in t.results("run")]
    assert runs[: len(recorded)] == recorded
    assert len(runs) == len(set(runs)), f"a recorded run was measured again: {runs}"
    assert {c for c, stage in runs if stage == "screen"} == {"i1", "i1-t1", "i2"}
    assert t.results("result")[-1]["best"] == "i1-t1"
    assert "recorded" in out.stderr  # the replayed runs are shown as such
    assert not t.leftovers()


def test_dry_run_lists_layouts_and_pruned_ones_of_a_two_socket_smt_machine(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(4, 4), smt=2, node_memory=16 * GIB)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": "m", "placement": {"model_size_gib": 6, "kvcache_gib": 2, "launcher": "numactl"}}))
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--fsroot", str(root), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.split()[:1] == ["i2"] for line in lines) and any(line.split()[:1] == ["i2-smt"] for line in lines)
    # two 6 GiB instances per 16 GiB node do not fit: pruned with the planner's numbers
    i4 = next(line for line in lines if line.split()[:1] == ["i4"])
    assert "GiB" in i4 and "try --instances 2" in i4


@pytest.mark.parametrize(("args", "message"), [
    (["--slo", "ttft_p77=1s"], "--slo 'ttft_p77=1s': 'ttft_p77' is not a metric"),
    (["--budget", "soon"], "--budget 'soon': expected a duration"),
    (["--concurrency", "0,8"], "--concurrency '0,8': expected a comma list of whole numbers"),
    (["--resume"], "--resume: nothing to resume"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, args, message):
    config = tmp_path / "c.yaml"
    config.write_text("model: m\n")
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--report", str(tmp_path / "r"), "--no-roofline", *args],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("vsup: error: ") and message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_a_bad_workload_line_names_the_file_and_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: m\n")
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "hi", "max_tokens": 4}\n{"prompt": "hi"}\n')
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--workload", str(workload), "--dry-run"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2
    assert f"--workload {workload}:2: max_tokens: None is not a whole number of at least 1" in out.stderr


def test_a_workload_from_the_settings_file_is_read_from_its_folder_and_its_errors_name_the_key(tmp_path):
    (tmp_path / "in").mkdir()
    workload = tmp_path / "in" / "w.jsonl"
    workload.write_text('{"prompt": "hi", "max_tokens": 4}\n{"prompt": "hi"}\n')
    config = tmp_path / "c.yaml"
    config.write_text("model: m\n")
    settings = tmp_path / "in" / "tune.yaml"
    settings.write_text("concurrency: [4]\nworkload: w.jsonl\n")
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--settings", str(settings), "--dry-run"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"vsup: error: {settings}:2: workload {workload}:2: max_tokens: None is not a whole number" in out.stderr


@pytest.mark.parametrize(("text", "message"), [
    ("concurrency: [0, 8]\n", "{settings}:1: concurrency: [0, 8] is not valid: every value must be at least 1"),
    ("smt: [off]\nomp_threads: [all, most]\n", "{settings}:2: omp_threads[1]: 'most' is not valid: Input should be a valid integer or 'all' or 'half'"),
    ("smt: [1]\n", "{settings}:1: smt[0]: 1 is not valid: Input should be a valid boolean"),
    ("concurency: [8]\n", "{settings}:1: concurency: unknown key (check the spelling; `vsup config --tune-settings` lists every key)"),
    ("tune:\n  concurrency: [8]\n", "{settings}:1: tune: a settings file holds the keys at its top level"),
    ("- 8\n", "{settings}: expected a mapping of vsup tune's settings"),
])
def test_a_bad_settings_file_is_one_line_naming_the_key_and_line(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text("model: m\n")
    settings = tmp_path / "tune.yaml"
    settings.write_text(text)
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--settings", str(settings), "--dry-run"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("vsup: error: " + message.format(settings=settings)), out.stderr


def test_a_tune_section_in_the_run_file_says_where_it_went(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: m\ninstances: 1\ntune:\n  concurrency: [4]\n")
    for command in (["tune", "-c", str(config), "--dry-run"], ["plan", "--config", str(config)]):
        out = subprocess.run([*VSUP, *command], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"vsup: error: {config}:3: tune: `vsup tune`'s settings left the run file"), out.stderr
        assert "--settings FILE" in out.stderr


def test_flags_override_the_settings_file(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(4,), smt=2, node_memory=16 * GIB)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": "m", "placement": {"model_size_gib": 1, "kvcache_gib": 1, "launcher": "numactl"}}))
    settings = tmp_path / "tune.yaml"
    settings.write_text("instances_per_node: [1]\nsmt: [false]\nhousekeeping_core: [false]\nomp_threads: [all]\n")

    def layouts(*args: str) -> set[str]:
        out = subprocess.run([*VSUP, "tune", "-c", str(config), "--fsroot", str(root), "--dry-run", "--settings", str(settings), *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  i")}

    assert layouts() == {"i1"}
    assert layouts("--instances-per-node", "2") == {"i2"}


def test_enforce_eager_on_and_off_are_measured_side_by_side_with_their_start_times(tuning):
    # the fake compiles for 4 s at start unless --enforce-eager is given, and then decodes 3× faster
    t = tuning()
    t.env.update({"FAKE_VLLM_COMPILE": "4", "FAKE_VLLM_COMPILED_SPEEDUP": "3"})
    out = t.run("--budget", "2m", "--instances-per-node", "1", "--omp-threads", "1", "--housekeeping-core", "off",
                "--preload", "none", "--enforce-eager", "on,off", "--write-config", str(t.tmp / "tuned.yaml"))
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {e["candidate"]: e for e in t.results("run")}
    assert set(runs) == {"i1-t1", "i1-t1-eager"}, runs.keys()  # the config's own (no flag: compiled) and the other
    compiled, eager = runs["i1-t1"]["extra"]["start"], runs["i1-t1-eager"]["extra"]["start"]
    # the phase is seen at the supervisor's progress readings (every 2 s): the compile at that resolution
    assert compiled["compile_s"] >= 2.0 and compiled["ready_s"] >= 4.0 and compiled["vsup_s"] >= compiled["ready_s"]
    assert eager["compile_s"] == 0.0 and eager["ready_s"] is not None
    [instance] = compiled["instances"]
    assert instance["took"]["compiling"] == compiled["compile_s"]
    assert "--enforce-eager" in (t.report / "candidates" / "i1-t1-eager.yaml").read_text()
    assert "--enforce-eager" not in (t.report / "candidates" / "i1-t1.yaml").read_text()

    # the objective (throughput) picks the compiled one; the report says what it costs at start
    assert t.results("result")[-1]["best"] == "i1-t1"
    header = next(line for line in out.stdout.splitlines() if "candidate" in line and "tok/s" in line)
    assert header.index("tok/s") < header.index("start") < header.index("compile") < header.index("req/s")
    assert "--enforce-eager on (`i1-t1-eager`): ready in" in out.stdout and "of it compiling" in out.stdout
    summary = (t.report / "summary.md").read_text()
    assert "## Start time against speed: --enforce-eager" in summary
    assert "Off costs" in summary and "more at every start" in summary
    from PIL import Image

    with Image.open(t.report / "chart.png") as image:  # the load level's panel, and start time against speed
        assert image.size[0] >= 2 * 6.5 * 100
    tuned = (t.tmp / "tuned.yaml").read_text()
    assert "start to ready:" in tuned and load_config(t.tmp / "tuned.yaml").vllm.args == ["--max-num-seqs", "8"]
    assert not t.leftovers()


@pytest.mark.parametrize("via_settings", [False, True])
def test_enforce_eager_off_on_a_config_that_turns_compile_off_is_refused_naming_the_key(tmp_path, via_settings):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": "m", "vllm": {"args": ["--dtype", "float32", "-O0"]}}))
    settings = tmp_path / "tune.yaml"
    settings.write_text("concurrency: [4]\nenforce_eager: [true, false]\n")
    extra = ["--settings", str(settings)] if via_settings else ["--enforce-eager", "on,off"]
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--dry-run", *extra], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    origin = f"{settings}:2: enforce_eager" if via_settings else "--enforce-eager"
    assert out.stderr.startswith(f"vsup: error: {origin}: off (a compiled start) cannot be measured: vllm.args has '-O0'"), out.stderr
    # on alone is no contradiction: the dry run lists it as the last tweak
    ok = subprocess.run([*VSUP, "tune", "-c", str(config), "--dry-run", "--enforce-eager", "on"], capture_output=True,
                        text=True, timeout=60, cwd=tmp_path)
    assert ok.returncode == 0 and "enforce_eager [True]" in ok.stdout, ok.stderr
