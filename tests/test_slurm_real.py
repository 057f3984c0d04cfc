"""`vsup export slurm` under a real Slurm (22.05): two hosts on this machine (scripts/slurm-sim: two
network namespaces, a slurmd each, private /tmp and /dev/shm), once with proctrack/cgroup and once
with proctrack/linuxproc. The exported script is submitted with sbatch; the front proxy answers the
openai client with the fake vLLM behind both hosts' vsups, splits requests between them, drains the
requests in flight on every scancel docs/slurm.md says drains under that plugin, leaves vsup's
shutdown lines in the job's output and nothing running on either host; the one it says does not
(plain scancel under linuxproc) does not; with named keys (proxy.api_keys) a client's key passes the
front to the per-node vsups, which check it too, and no file on the shared folder holds a key; a
host whose vsup is killed is ejected while the other serves; a batch through the front (the openai
SDK's files and batches) completes with one result per custom_id, its lines run by both hosts' vsups; real vLLM on one host (marked `vllm` too) answers and drains. Marked `slurm`; needs root
and Debian's slurmctld slurmd slurm-client munge (scripts/test installs them under CI)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.fakevllm.fixtures import fake_command
from tests.tools import need_tool, unavailable

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "scripts" / "slurm-sim"
WORK = Path(os.environ.get("VSUP_SLURM_DIR", "/var/tmp/vsup-slurm"))
ADDR = {"h1": "198.18.0.11", "h2": "198.18.0.12"}
PORT = 18000  # the front proxy, on h1; the per-node vsup on PORT + 1 on each host
TOKENS = 60   # per in-flight request, at 0.05 s a token: 3 s, well past the moment of scancel


def sh(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_CONF": str(WORK / "slurm.conf")}
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert result.returncode == 0, f"{args}: {result.stderr}"
    return result


@pytest.fixture(scope="module")
def slurm(request):
    """The cluster, up afresh (2 s) under the ProctrackType the test is parametrized with; down after."""
    if os.geteuid() != 0:
        unavailable("the Slurm test needs root (network namespaces, slurmd)")
    for tool, package in (("slurmctld", None), ("slurmd", None), ("munged", "munge"), ("sbatch", "slurm-client"),
                          ("ip", "iproute2"), ("nsenter", "util-linux")):
        need_tool(tool, package=package)
    request.addfinalizer(lambda: subprocess.run([str(SIM), "down"], capture_output=True, timeout=120))
    up = subprocess.run([str(SIM), "up", request.param], capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    return request.param


def get(url: str | urllib.request.Request, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def submit(tmp_path: Path, config: dict | None = None, hosts: int = 2, env: dict[str, str] | None = None) -> str:
    """Export for --hosts 2 (or `hosts`) from this machine's plan and sbatch it, with `env` in the
    environment sbatch passes on (the keys' variables); the job id."""
    config = config or {
        "model": "fake-model",
        "placement": {"model_size_gib": 0.01, "kvcache_gib": 0.01, "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
        "vllm": {"command": fake_command(), "env": {"FAKE_VLLM_TOKEN_DELAY": "0.05"}},
        "proxy": {"port": PORT, "drain_timeout": 20},
        "health": {"interval": 0.3, "timeout": 2, "failures": 2, "startup_timeout": 60},
        "stop": {"timeout": 5},
    }
    (tmp_path / "vsup.yaml").write_text(yaml.safe_dump(config))
    out = WORK / f"export-{tmp_path.name}"
    sh(str(Path(sys.executable).parent / "vsup"), "export", "slurm", "--config", str(tmp_path / "vsup.yaml"),
       "--hosts", str(hosts), "-o", str(out))
    # the front's batch store in the work folder, not under root's home (the script's default)
    added = {"VSUP": str(Path(sys.executable).parent / "vsup"), "VSUP_BATCH_DIR": str(WORK / f"batches-{tmp_path.name}"),
             **(env or {})}
    os.environ.update(added)  # sbatch passes the environment on
    try:
        job = sh("sbatch", "--parsable", f"--output={WORK}/job-%j.out", f"--chdir={WORK}", str(out / "vsup.sbatch")).stdout.strip()
    finally:
        for name in added:
            del os.environ[name]
    return job.split(";")[0]


def front(path: str, key: str | None = None) -> tuple[int, str]:
    if key is None:
        return get(f"http://{ADDR['h1']}:{PORT}{path}")
    return get(urllib.request.Request(f"http://{ADDR['h1']}:{PORT}{path}", headers={"Authorization": f"Bearer {key}"}))


def served_by_host(metrics: str) -> dict[str, float]:
    """Requests the front proxy sent to each host's vsup (vsup_proxy_requests_total by instance)."""
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vsup_proxy_requests_total{"):
            match = re.search(r'instance="http://(h\d):\d+"', line)
            if match:
                counts[match[1]] = counts.get(match[1], 0) + float(line.rsplit(" ", 1)[1])
    return counts


def in_flight(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vsup_proxy_in_flight{"))


def client(key: str = "none"):
    import openai

    return openai.OpenAI(base_url=f"http://{ADDR['h1']}:{PORT}/v1", api_key=key, max_retries=0, timeout=60)


def wait_serving(job: str, hosts: int = 2, timeout: float = 150, key: str | None = None) -> None:
    def all_ready():
        status, body = front("/metrics", key)
        return status == 200 and len(re.findall(r'vsup_instance_ready\{instance="http://h\d:\d+"\} 1\.0', body)) == hosts
    try:
        wait_until(all_ready, timeout, f"the front proxy to see {hosts} host(s)' vsups ready")
    except AssertionError:
        print(job_output(job))
        raise


def job_output(job: str) -> str:
    path = WORK / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


def local_folder(job: str, host: str) -> str:
    """The host's node-local folder (pid files, instance logs): mktemp -d's, as the script recorded it."""
    return (WORK / f"vsup-{job}" / "local" / host).read_text().strip()


def host_pids(host: str) -> set[int]:
    """The processes in a host's network namespace other than its slurmd."""
    pids = {int(p) for p in sh("ip", "netns", "pids", f"vsup-{host}").stdout.split()}
    return pids - {int((WORK / f"slurmd.{host}.pid").read_text())}


def in_host(host: str, *command: str) -> str:
    """A command in the host's mount namespace (its private /tmp and /dev/shm)."""
    slurmd = (WORK / f"slurmd.{host}.pid").read_text().strip()
    return sh("nsenter", f"--mount=/proc/{slurmd}/ns/mnt", *command).stdout


STOPS = {"plain": ("scancel",), "batch": ("scancel", "--batch", "--signal=TERM")}


def start_long_requests(pool, api) -> list[concurrent.futures.Future]:
    def long_request(_):
        return api.completions.create(model="fake-model", prompt="drain me", max_tokens=TOKENS)

    futures = [pool.submit(long_request, i) for i in range(4)]
    wait_until(lambda: in_flight(front("/metrics")[1]) == 4, 20, "4 requests in flight at the front")
    return futures


def wait_gone(job: str) -> None:
    wait_until(lambda: sh("squeue", "-h", "-j", job, check=False).stdout.strip() == "", 90, f"job {job} to leave squeue")
    for host in ADDR:
        wait_until(lambda host=host: not host_pids(host), 30, f"{host} to have nothing left running")


# every stop docs/slurm.md says drains, under the plugin it names
@pytest.mark.parametrize("slurm, stop", [("cgroup", "plain"), ("cgroup", "batch"), ("linuxproc", "batch")], indirect=["slurm"])
def test_two_hosts_serve_split_by_ready_instances_and_drain_on_scancel(slurm, stop, tmp_path):
    job = submit(tmp_path)
    wait_serving(job)
    api = client()
    for _ in range(12):
        reply = api.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].message.content == "tok0 tok1"
    counts = served_by_host(front("/metrics")[1])
    assert counts.get("h1", 0) >= 3 and counts.get("h2", 0) >= 3, counts  # one ready instance each: an even share

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = start_long_requests(pool, api)
        sh(*STOPS[stop], job)
        replies = [future.result(timeout=90) for future in futures]
    assert [r.usage.completion_tokens for r in replies] == [TOKENS] * 4  # every one finished whole
    # the job stays until its vsups have drained and stopped; then nothing is left on either host
    wait_gone(job)
    output = job_output(job)
    # each host's per-node step ran bound to the plan's mask (srun --cpu-bind=verbose reports it)
    mask = re.search(r"mask_cpu:(0x[0-9a-f]+) --mem-bind", (WORK / f"export-{tmp_path.name}" / "vsup.sbatch").read_text())[1]
    for host in ADDR:
        assert re.search(rf"cpu-bind=MASK - {host}, task +\d+ +\d+ \[\d+\]: mask {mask} set", output), output
    # vsup's shutdown is in the job's output: both hosts' vsups and the front proxy drained
    assert output.count("stopping: draining the proxy") == 2 and output.count("vsup.supervisor: stopped after") == 2, output
    assert "vsup proxy: draining (4 in flight" in output, output
    for host in ADDR:
        assert not [name for name in in_host(host, "ls", "/dev/shm").split() if name.startswith(("psm_", "sem.mp-"))]


@pytest.mark.parametrize("slurm", ["linuxproc"], indirect=True)
def test_a_plain_scancel_under_linuxproc_kills_the_instances_mid_request(slurm, tmp_path):
    # what docs/slurm.md warns of: Slurm signals every process of a step at once, vLLM's too
    import openai

    job = submit(tmp_path)
    wait_serving(job)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = start_long_requests(pool, client())
        sh(*STOPS["plain"], job)
        failed = [future for future in futures if isinstance(future.exception(timeout=90), openai.APIError)]
    assert failed, "every request completed: docs/slurm.md's table is wrong"
    wait_gone(job)


# alice's key written in the config, bob's read from BOB_KEY; proxy.api_key (the admin's, for /metrics) from VSUP_API_KEY
KEYS = {"VSUP_API_KEY": "adm1n-s3cret", "VSUP_KEY_ALICE": "al1ce-s3cret", "BOB_KEY": "b0b-s3cret"}
NAMED_KEYS = [{"name": "alice", "key": KEYS["VSUP_KEY_ALICE"], "priority": 5}, {"name": "bob", "key_env": "BOB_KEY"}]


# the ejection does not depend on the plugin: once; with named keys, which go by environment alone
@pytest.mark.parametrize("slurm", ["cgroup"], indirect=True)
def test_a_host_whose_vsup_is_killed_is_ejected_and_the_other_serves(slurm, tmp_path):
    import openai

    config = {
        "model": "fake-model",
        "placement": {"model_size_gib": 0.01, "kvcache_gib": 0.01, "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
        "vllm": {"command": fake_command()},
        "proxy": {"port": PORT, "drain_timeout": 5, "api_key": KEYS["VSUP_API_KEY"], "api_keys": NAMED_KEYS},
        "health": {"interval": 0.3, "timeout": 2, "failures": 2, "startup_timeout": 60},
        "stop": {"timeout": 5},
    }
    job = submit(tmp_path, config, env=KEYS)
    (tmp_path / "vsup.yaml").unlink()  # the config the export read holds alice's key; nothing the export or the job wrote does
    admin = KEYS["VSUP_API_KEY"]
    wait_serving(job, key=admin)
    # each client's key passes the front to the per-node vsups of both hosts, which check the same keys
    for key in (KEYS["VSUP_KEY_ALICE"], KEYS["BOB_KEY"]):
        for _ in range(4):
            reply = client(key).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].message.content == "tok0 tok1"
    counts = served_by_host(front("/metrics", admin)[1])
    assert counts.get("h1", 0) >= 2 and counts.get("h2", 0) >= 2, counts
    with pytest.raises(openai.AuthenticationError):
        client("wrong").chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    per_node = get(urllib.request.Request(f"http://{ADDR['h2']}:{PORT + 1}/v1/models", headers={"Authorization": "Bearer wrong"}))
    assert per_node[0] == 401  # a client that goes round the front meets the same keys
    # no file on the shared folder (the export, the step configurations, the job's output) holds a key
    shared = [p for p in [*(WORK / f"export-{tmp_path.name}").rglob("*"), *(WORK / f"vsup-{job}").rglob("*"),
                          WORK / f"job-{job}.out"] if p.is_file()]
    assert len(shared) >= 5, shared
    for path in shared:
        assert not [key for key in KEYS.values() if key in path.read_text()], path
    # each host's node-local folder is mktemp's, 0700, and holds the pid files
    folders = {host: local_folder(job, host) for host in ADDR}
    for host, folder in folders.items():
        assert re.fullmatch(rf"/tmp/vsup-{job}\.\w{{8}}", folder), folder
        assert in_host(host, "stat", "-c", "%a %U", folder).split() == ["700", "root"]

    # a batch through the front: the lines run on both hosts' vsups (as batch lines there: X-Vsup-Batch)
    before = served_by_host(front("/metrics", admin)[1])
    alice = client(KEYS["VSUP_KEY_ALICE"])
    ids = [f"q{i}" for i in range(6)]
    lines = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "fake-model", "messages": [{"role": "user", "content": cid}], "max_tokens": 2}}) + "\n" for cid in ids)
    uploaded = alice.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_until(lambda: (b := alice.batches.retrieve(batch.id)).status in ("completed", "failed") and b, 60,
                       "the batch to end")
    assert (batch.status, batch.request_counts.completed) == ("completed", 6), batch
    output = [json.loads(line) for line in alice.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(entry["custom_id"] for entry in output) == ids
    assert all(entry["response"]["body"]["choices"][0]["message"]["content"] == "tok0 tok1" for entry in output)
    after = served_by_host(front("/metrics", admin)[1])
    assert after.get("h1", 0) > before.get("h1", 0) and after.get("h2", 0) > before.get("h2", 0), (before, after)

    vsup_pid = in_host("h2", "cat", f"{folders['h2']}/pids/node0.pid").strip()
    os.kill(int(vsup_pid), 9)
    wait_until(lambda: re.search(r'vsup_instance_ready\{instance="http://h2:\d+"\} 0\.0', front("/metrics", admin)[1]), 30,
               "the front proxy to eject h2")
    api = client(KEYS["BOB_KEY"])
    before = served_by_host(front("/metrics", admin)[1])
    for _ in range(6):
        reply = api.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].message.content == "tok0 tok1"
    after = served_by_host(front("/metrics", admin)[1])
    assert after.get("h1", 0) - before.get("h1", 0) == 6 and after.get("h2", 0) == before.get("h2", 0), (before, after)
    sh(*STOPS["batch"], job)
    wait_gone(job)


@pytest.mark.vllm
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("slurm", ["linuxproc"], indirect=True)
def test_real_vllm_on_one_host_answers_and_drains(slurm, vllm_install, tmp_path):
    # the real vLLM CPU build (tiny random-weight model) instead of the fake, on h1 only; vsup from
    # the checkout's venv, pointed at vLLM's by vllm.venv
    venv, model = vllm_install
    config = {
        "model": str(model), "served_model_name": "tiny-llama",
        "placement": {"kvcache_gib": 0.0625, "overhead_gib": 1.5},
        "vllm": {"venv": str(venv), "args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
                 "env": {"HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(WORK / "vllm-cache")}},
        "proxy": {"port": PORT, "drain_timeout": 60},
        "health": {"interval": 1, "timeout": 10, "failures": 3, "startup_timeout": 600},
        "stop": {"timeout": 30},
    }
    job = submit(tmp_path, config, hosts=1)
    wait_serving(job, hosts=1, timeout=660)
    api = client()
    reply = api.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert reply.usage.completion_tokens == 8
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(api.completions.create, model="tiny-llama", prompt="drain me", max_tokens=1500,
                             extra_body={"ignore_eos": True})
        wait_until(lambda: in_flight(front("/metrics")[1]) == 1, 30, "the request in flight at the front")
        sh(*STOPS["batch"], job)
        assert future.result(timeout=300).usage.completion_tokens == 1500  # finished whole while vsup drained
    wait_gone(job)
    assert "stopped after" in job_output(job)
