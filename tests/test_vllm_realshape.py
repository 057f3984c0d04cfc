"""Issue 31's proof at the size users run: two real vLLM CPU instances of a model of real shape
(scripts/build_tiny_model.py with Qwen2-1.5B's shape: 1.32 B random fp32 parameters, 5.3 GB of
weights each; tests/vllm_fixtures.py builds it once per machine) under one `vsup run`:

- the start phases show in `vsup status --format json` while they happen (booting, loading with
  its progress, profiling, opening, warming), and each instance's finished start names them;
- both instances start at once and the fleet is ready within 1.25x the slowest instance's own
  start (the bound of bench/start_bench.py, which measures it with the compile; here
  `--enforce-eager` keeps CI's time down — a start is ~1-2 min here instead of ~4);
- an instance whose EngineCore is SIGSTOPped (its /health still answers) is taken out of the
  rotation by the proxy's stall watchdog and recycled, while the other serves every request;
- the installed vLLM build's needs refuse a CPU dump without AVX2 (`vsup plan --fsroot`, the
  real venv read; tests/test_isa_refusal.py covers the refusal's every path on made-up venvs).

Sized for CI's time: a short --max-model-len, a small KV cache, a few short requests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.test_vllm_e2e import (
    alive,
    close_and_sweep,
    comm,
    metric_total,
    served_config,
    tree,
)
from tests.vsup_harness import VSUP, VsupRun, instance_get
from vsup.supervisor.phases import Phase

STARTUP_TIMEOUT = 900.0
SERVED = "real-shape"
BOUND = 1.25  # all ready / slowest own start (issue 31)
OPTERON = "16amd64-8n2c"  # the corpus's x86_64 dump from before AVX2 (tests/test_isa_refusal.py)
# the order phases come in; vLLM's CPU worker compiles inside its profiling, so the two share a rank
RANK = {Phase.BOOTING: 0, Phase.LOADING: 1, Phase.PROFILING: 2, Phase.COMPILING: 2, Phase.OPENING: 3, Phase.WARMING: 4}

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def vsup_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


class Started:
    """The run, its status while it started (read through the control socket every 0.5 s, and by
    `vsup status --format json` every few seconds: a CLI call costs a second of CPU here), and when
    all were ready."""

    def __init__(self, run: VsupRun, marker: str, readings: list[tuple[float, dict]], shown: list[dict],
                 all_ready_s: float) -> None:
        self.run, self.marker, self.readings, self.shown, self.all_ready_s = run, marker, readings, shown, all_ready_s

    def client(self, timeout: float = 300.0):
        from openai import OpenAI
        return OpenAI(base_url=f"http://127.0.0.1:{self.run.proxy_port}/v1", api_key="none", timeout=timeout, max_retries=0)


def real_shape_config(tmp: Path, model: Path, venv: Path) -> dict:
    config = served_config(tmp, model)
    config["served_model_name"] = SERVED
    config["vllm"]["venv"] = str(venv)  # vsup from this checkout's .venv: no wheel to build for this module
    config["vllm"]["args"] = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8"]
    # 128 MiB of KV cache: ~2,300 tokens of this model (56 KiB a token in fp32), room for --max-model-len
    config["placement"] = {**config["placement"], "kvcache_gib": 0.125}
    config["start"] = {"mode": "auto"}  # both fit at their load peaks (startmode.py, as measured): parallel
    return config


@pytest.fixture(scope="module")
def started(vllm_install, real_shape_model, tmp_path_factory):
    venv, _tiny = vllm_install
    tmp = tmp_path_factory.mktemp("vllm-realshape")
    config = real_shape_config(tmp, real_shape_model, venv)
    marker = f"VLLM_CACHE_ROOT={config['vllm']['env']['VLLM_CACHE_ROOT']}"
    began = time.monotonic()
    run = VsupRun(tmp, config)
    readings: list[tuple[float, dict]] = []
    shown: list[dict] = []  # what `vsup status --format json` printed while they started
    try:
        deadline, next_cli = began + STARTUP_TIMEOUT, began
        while True:
            assert time.monotonic() < deadline, f"not ready within {STARTUP_TIMEOUT:.0f}s:\n{run.log()[-4000:]}"
            assert run.proc.poll() is None, f"vsup exited ({run.proc.returncode}):\n{run.log()[-4000:]}"
            try:
                status = run.status()
            except OSError:  # not listening yet
                time.sleep(0.2)
                continue
            readings.append((time.monotonic() - began, status))
            if all(inst["state"] == "ready" for inst in status["instances"]):
                break
            if time.monotonic() >= next_cli:
                cli = vsup_cli("status", "--socket", run.socket, "--format", "json")
                if cli.returncode == 0:
                    shown.append(json.loads(cli.stdout))
                next_cli = time.monotonic() + 5
            time.sleep(0.5)
        yield Started(run, marker, readings, shown, readings[-1][0])
    finally:
        close_and_sweep(run, marker)


def seen(started: Started, index: int) -> list[dict]:
    """Instance `index`'s phase readings while it started (state starting or warming), in order."""
    return [dict(inst["phase"], state=inst["state"], t=t) for t, status in started.readings
            for inst in status["instances"] if inst["index"] == index and inst["phase"]]


def own_start(inst: dict) -> float:
    """Its own start: from the spawn (the transition into starting) to ready, by vsup's clock."""
    spawned = [t["at"] for t in inst["transitions"] if t["to"] == "starting"]
    ready = [t["at"] for t in inst["transitions"] if t["to"] == "ready"]
    assert spawned and ready, inst["transitions"]
    return ready[-1] - spawned[-1]


def test_plan_of_a_dump_without_avx2_is_refused_for_the_installed_build(vllm_install, real_shape_model, corpus, tmp_path):
    """The refusal of tests/test_isa_refusal.py, with the real vLLM venv's build read (first: no start needed)."""
    venv, _tiny = vllm_install
    config = tmp_path / "vsup.yaml"
    config.write_text(yaml.safe_dump(real_shape_config(tmp_path, real_shape_model, venv)))
    result = vsup_cli("plan", "--config", str(config), "--fsroot", str(corpus.fsroot(OPTERON)))
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and "no AVX2" in result.stderr and "illegal instruction" in result.stderr


def test_the_phases_show_in_status_while_they_happen(started):
    # `vsup status --format json` showed the starts as they went: each starting instance's phase
    cli = [inst for status in started.shown for inst in status["instances"] if inst["phase"]]
    assert cli, f"`vsup status --format json` never showed a start phase ({len(started.shown)} calls)"
    assert {inst["phase"]["name"] for inst in cli} - {"booting"}, "the CLI saw nothing but booting"
    assert all({"name", "text", "for", "idle", "took"} <= set(inst["phase"]) for inst in cli)
    for index in started.run.config_instances():
        readings = seen(started, index)
        names = [Phase(r["name"]) for r in readings]
        assert names and names[0] is Phase.BOOTING, names
        ranks = [RANK[name] for name in names]
        assert ranks == sorted(ranks), f"instance {index}: phases out of order: {names}"
        # seen live: the load (with how far it is), the KV cache's profiling or what follows it, the warm-up
        assert {Phase.LOADING, Phase.WARMING} <= set(names), f"instance {index}: seen {sorted(set(names))}"
        loading = [r for r in readings if r["name"] == "loading"]
        assert all(r["weights_bytes"] and r["weights_bytes"] > 5 * 10**9 for r in loading), loading[-1]
        assert any((r["read_bytes"] or 0) > 0 or r["percent"] is not None for r in loading), \
            f"instance {index}: no load progress in {loading}"
        # the last reading (warming) carries every phase the start went through, each with its seconds
        took = readings[-1]["took"]
        assert list(took) == [p.value for p in Phase if p.value in took]
        assert {"booting", "loading", "profiling", "opening", "warming"} <= set(took), took
        assert took["loading"] > 0
    # and the finished start's transition names them too (vsup's log, `vsup status`)
    final = started.readings[-1][1]
    for inst in final["instances"]:
        healthy = [t for t in inst["transitions"] if t["event"] == "healthy"]
        assert healthy and "loading" in healthy[-1]["reason"], inst["transitions"]


def test_both_instances_are_ready_within_the_bound(started):
    final = started.readings[-1][1]
    own = [own_start(inst) for inst in final["instances"]]
    assert "start: parallel (start.mode auto): all 2 instances load at once" in started.run.log()
    assert started.all_ready_s <= BOUND * max(own), (
        f"`vsup run` to all ready {started.all_ready_s:.1f} s, own starts {own}: over {BOUND}x the slowest")
    print(f"real shape: all ready {started.all_ready_s:.1f} s, own starts {[round(s, 1) for s in own]}, "
          f"ratio {started.all_ready_s / max(own):.2f}")


def test_a_sigstopped_engine_is_taken_out_and_recycled_while_the_other_serves_every_request(started):
    # vLLM's /health answers while its EngineCore is stopped: only the proxy's stall watchdog sees it
    run = started.run
    victim, other = run.instance(1), run.instance(0)
    engines = [pid for pid in tree(victim["pid"]) if pid != victim["pid"] and "EngineCor" in comm(pid)]
    assert engines, f"no EngineCore in instance 1's tree: {[(p, comm(p)) for p in tree(victim['pid'])]}"
    served_before = metric_total(other["address"], "vllm:request_success_total")
    os.kill(engines[0], signal.SIGSTOP)
    try:
        assert instance_get(victim["address"], "/health")[0] == 200  # health does not see it
        client = started.client()
        answered = 0
        # round robin sends one of the first two to the stopped engine: retried on the other after
        # proxy.stall_timeout; the rest go to the other while instance 1 is out and being recycled
        for n in range(6):
            reply = client.completions.create(model=SERVED, prompt=f"while stopped {n}", max_tokens=3,
                                              extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 3
            answered += 1
        status = run.wait_for(lambda s: s["instances"][1]["restarts"] >= victim["restarts"] + 1
                              and s["instances"][1]["pid"] not in (None, victim["pid"]), 300, "instance 1 recycled")
        assert "stalled" in run.log(), run.log()[-3000:]
        assert status["instances"][0]["restarts"] == other["restarts"] and status["instances"][0]["state"] == "ready"
        assert status["instances"][1]["state"] in ("starting", "warming", "ready")
        # every request was served by the other instance (its own counter), none by the stopped one
        assert metric_total(other["address"], "vllm:request_success_total") - served_before >= answered
    finally:
        for pid in engines:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    wait = time.monotonic() + 60
    while alive(engines) and time.monotonic() < wait:  # the stopped tree is gone (recycled, not left behind)
        time.sleep(0.5)
    assert not alive(engines), f"the stopped EngineCore {engines} outlived its instance"


