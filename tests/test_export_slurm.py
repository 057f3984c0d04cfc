"""`vsup export slurm`: the sbatch script's content (steps bound to the plan's CPU masks, one
node's instances each, the front proxy), its syntax (`bash -n`), and a run of it with stand-ins
for srun and scontrol that record what the script asks of Slurm."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import subprocess
from itertools import pairwise
from pathlib import Path

import pytest

from tests.fakevllm.fixtures import free_port
from tests.machines import make_machine
from tests.proxy_support import start_fakes
from tests.sysfs_builder import GIB, build_sysfs
from tests.test_plan_cli import vsup
from tests.test_proxy_cli import REPO, VSUP, wait_until
from tests.tools import AS_NOBODY, need_nobody_running
from vsup.config.planning import settings_from_config
from vsup.config.schema import parse_config
from vsup.export.pod import node_type
from vsup.export.slurm import cpu_mask, export_slurm
from vsup.topology.planner import plan


def script_for(machine, config: str, hosts: int = 1):
    cfg = parse_config(config)
    machine = node_type(machine)
    host_plan = plan(machine, settings_from_config(cfg, numactl_available=True))
    return host_plan, export_slurm(machine, host_plan, cfg, hosts=hosts, job_name="llm")


def srun_lines(script: str) -> list[str]:
    return [line + " " + nxt for line, nxt in pairwise(script.splitlines()) if line.startswith("srun ")]


def test_one_step_per_numa_node_bound_to_the_plan_and_a_front_proxy():
    machine = make_machine(sockets=2, cores_per_node=16, smt=2, node_memory=128 * GIB)
    host_plan, script = script_for(machine, "model: /m\ninstances: 4\nplacement:\n  model_size_gib: 15\n", hosts=3)
    assert script.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --exclusive\n" in script and "#SBATCH --job-name=llm\n" in script
    local, *steps = srun_lines(script)
    assert "--job-name=vsup-local" in local and "--nodes=3 --ntasks-per-node=1" in local and "mktemp -d" in local
    assert len(steps) == 3  # two NUMA nodes + the front proxy
    for node_id, step in zip((0, 1), steps[:2], strict=True):  # the last step is the front proxy
        cpus = sorted(cpu for inst in host_plan.instances if inst.cpu_nodes == (node_id,) for cpu in inst.cpus)
        assert f"--cpu-bind=verbose,mask_cpu:{cpu_mask(cpus)}" in step and "--mem-bind=verbose,local" in step
        assert f'"$VSUP" run --config "$CONF/node{node_id}.yaml" &' in step and "--nodes=3 --ntasks-per-node=1" in step
    # the front proxy sits on the core the plan reserved (CPUs 0 and 32), outside every step's mask
    assert host_plan.reserved_cpus == (0, 32)
    assert f"--cpu-bind=verbose,mask_cpu:{cpu_mask([0, 32])}" in steps[2] and '"$VSUP" proxy --forward-key --config "$CONF/front.yaml"' in steps[2]
    assert cpu_mask([0, 32]) == "0x100000001"
    assert "for port in 8001 8002; do" in script
    assert script.rstrip().endswith("until wait; do :; done")  # waits again after the TERM trap
    assert "trap stop_vsups TERM" in script and "#SBATCH --signal=B:TERM@" in script


def test_the_script_is_valid_bash(tmp_path):
    machine = make_machine(sockets=1, nodes_per_socket=4, cores_per_node=24, smt=2, l3_per_node=3, node_memory=96 * GIB)
    _, script = script_for(machine, "model: /m\nvllm:\n  args: [--dtype, $DTYPE, '`x`']\nplacement:\n  model_size_gib: 4\n")
    path = tmp_path / "vsup.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


STUBS = {
    # each call: its arguments, one line, shell-quoted; the steps would run in the background
    # (concurrently: each line is one append, and the test does not rely on their order)
    # With SRUN_RUN set, srun runs its command too, on each host of the job (--nodelist: that one) in
    # turn, with SLURMD_NODENAME set as Slurm does: for a test whose $VSUP is a stand-in.
    "srun": '#!/bin/bash\nline=$(printf "%q " "$@")\necho "$line" >> "$SRUN_LOG"\n[ -n "$SRUN_RUN" ] || exit 0\n'
            'hosts="cpu-a1 cpu-a2"\nwhile [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && hosts=${1#--nodelist=}; '
            'shift; done\nfor h in $hosts; do SLURMD_NODENAME=$h "$@" || exit 1; done\n',
    "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "cpu-a1\\ncpu-a2\\n"\n',
}


def test_running_the_script_writes_the_step_configs_and_asks_slurm_for_the_steps(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(16, 16), smt=2, packages=2, node_memory=128 * GIB)
    config = tmp_path / "vsup.yaml"
    config.write_text("model: /models/x\nvllm:\n  args: [--dtype, '$bf16']\nplacement:\n  model_size_gib: 15\n"
                      "proxy:\n  port: 9000\n  drain_timeout: 20\nhealth:\n  interval: 2\n")
    out = tmp_path / "out"
    result = vsup("export", "slurm", "--config", str(config), "--fsroot", str(root), "--hosts", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    env = stub_slurm(tmp_path)
    run = subprocess.run(["bash", str(out / "vsup.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "clients connect to http://cpu-a1:9000" in run.stderr

    calls = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    assert len(calls) == 4 and sum("--job-name=vsup-local" in call for call in calls) == 1  # each host's folder first
    # the script starts the three steps in the background, so srun.log lists them in any order
    steps = sorted((call for call in calls if "run" in call), key=lambda call: call[-1])
    fronts = [call for call in calls if "proxy" in call]
    assert len(steps) == 2 and len(fronts) == 1, calls
    for node_id, call in enumerate(steps):
        assert call[-4:] == ["vsup", "run", "--config", str(tmp_path / "conf" / f"node{node_id}.yaml")]
        step = parse_config((tmp_path / "conf" / f"node{node_id}.yaml").read_text())
        assert step.instances == 1 and step.proxy.port == 9001 + node_id and step.proxy.host == "0.0.0.0"
        assert step.vllm.base_port == 8100 + node_id and step.placement.reserve_cores == 0
        assert step.placement.kvcache_gib == 109 and step.placement.model_size_gib == 15
        assert step.log.dir is None  # the step's node-local folder: LOGS_DIRECTORY, set as it starts
        assert step.vllm.args == ["--dtype", "$bf16"]  # the user's own $ stays literal
    front = fronts[0]
    assert front[front.index("--nodelist=cpu-a1") + 1:][:1] == ["--overlap"]
    upstreams = [front[i + 1] for i, word in enumerate(front) if word == "--upstream"]
    assert upstreams == ["http://cpu-a1:9001", "http://cpu-a1:9002", "http://cpu-a2:9001", "http://cpu-a2:9002"]
    proxy = parse_config((tmp_path / "conf" / "front.yaml").read_text(), require_model=False)
    assert proxy.proxy.port == 9000 and proxy.proxy.host == "0.0.0.0" and proxy.proxy.drain_timeout == 20
    assert proxy.health.interval == 2
    # the front holds the Batch API's store, in a folder that outlives the job (VSUP_BATCH_DIR, else
    # one per job name under ~/.local/state); the steps have theirs off
    assert front[front.index("--batch-dir") + 1] == f"{os.environ['HOME']}/.local/state/vsup/batches-vsup"
    assert proxy.batch.slots_per_instance == 128  # a step's instance's slots: the front's share of it
    for node_id in (0, 1):
        assert parse_config((tmp_path / "conf" / f"node{node_id}.yaml").read_text()).batch.enabled is False
    env = {**stub_slurm(tmp_path), "VSUP_BATCH_DIR": str(tmp_path / "batches")}
    (tmp_path / "srun.log").unlink()
    run = subprocess.run(["bash", str(out / "vsup.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    [front] = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines() if " proxy " in line]
    assert front[front.index("--batch-dir") + 1] == str(tmp_path / "batches")


def stub_slurm(tmp_path) -> dict:
    """srun and scontrol stand-ins on PATH; the environment the script runs in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "cpu-a[1-2]",
            "SRUN_LOG": str(tmp_path / "srun.log"), "VSUP_CONF_DIR": str(tmp_path / "conf")}


def test_the_api_key_goes_by_environment_to_the_per_node_vsups_never_into_a_shared_file(tmp_path):
    # the step configurations land on a filesystem every host (and user) sees: the key is in none
    # of them nor in the script; the per-node vsups and the front read VSUP_API_KEY; the front
    # passes the client's key on (--forward-key), for the per-node vsups check it too
    root = build_sysfs(tmp_path / "m", nodes=(4, 4), smt=2, packages=2, node_memory=32 * GIB)
    config = tmp_path / "vsup.yaml"
    config.write_text("model: /m\nplacement:\n  model_size_gib: 1\nproxy:\n  api_key: s3cret-k3y\n")
    out = tmp_path / "out"
    result = vsup("export", "slurm", "--config", str(config), "--fsroot", str(root), "-o", str(out))
    assert result.returncode == 0, result.stderr
    script = (out / "vsup.sbatch").read_text()
    assert "s3cret-k3y" not in script

    env = stub_slurm(tmp_path)
    env.pop("VSUP_API_KEY", None)
    missing = subprocess.run(["bash", str(out / "vsup.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "export VSUP_API_KEY=" in missing.stderr, missing.stderr
    assert not (tmp_path / "srun.log").exists()  # refused before any step started

    run = subprocess.run(["bash", str(out / "vsup.sbatch")], cwd=tmp_path, env={**env, "VSUP_API_KEY": "s3cret-k3y"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    written = sorted(p for p in (tmp_path / "conf").iterdir() if p.is_file())
    assert [p.name for p in written] == ["front.yaml", "node0.yaml", "node1.yaml"]
    for path in written:
        assert "s3cret-k3y" not in path.read_text() and "api_key" not in path.read_text(), path
    calls = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    [front] = [call for call in calls if "proxy" in call]
    assert front[front.index("proxy") - 1:front.index("proxy") + 2] == ["vsup", "proxy", "--forward-key"]
    assert "env" not in front


def test_without_a_key_the_script_asks_for_none():
    machine = make_machine(sockets=2, cores_per_node=4)
    _, script = script_for(machine, "model: /m\nplacement:\n  model_size_gib: 1\n")
    assert "VSUP_API_KEY:?" not in script


@pytest.mark.parametrize("name", ["x\nrm -rf ~", "my job", "a'b", 'a"b', "-x", "", "a" * 65, "a;b", "$(id)", "é"])
def test_a_job_name_the_script_cannot_carry_is_refused_in_one_line(tmp_path, name):
    root = build_sysfs(tmp_path / "m", nodes=(4,), node_memory=32 * GIB)
    (tmp_path / "vsup.yaml").write_text("model: /m\nplacement:\n  model_size_gib: 1\n")
    result = vsup("export", "slurm", "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root), "--job-name", name)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith(f"vsup: error: --job-name {name!r}: use 1 to 64 letters") and result.stderr.count("\n") == 1


def test_an_allowed_odd_job_name_is_one_sbatch_line_and_the_script_stays_valid_bash(tmp_path):
    machine = make_machine(sockets=1, cores_per_node=4)
    cfg = parse_config("model: /m\nplacement:\n  model_size_gib: 1\n")
    machine = node_type(machine)
    host_plan = plan(machine, settings_from_config(cfg, numactl_available=True))
    script = export_slurm(machine, host_plan, cfg, hosts=1, job_name="Llama-3.1_8b." + "x" * 50)
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH --job-name")]
    assert sbatch == ["#SBATCH --job-name=Llama-3.1_8b." + "x" * 50]
    (tmp_path / "s").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "s")], capture_output=True).returncode == 0


@pytest.mark.parametrize("config, message", [
    ("instances: 3\n", "instances: 3 do not split evenly over NUMA nodes"),
    ("proxy:\n  port: 65535\n", "proxy.port 65535: the per-node vsups listen on the 2 ports after it, past 65535"),
    ("proxy:\n  drain_timeout: 65500\n", "proxy.drain_timeout + stop.timeout = 65530 s: the job's stop signal"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, config, message):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8), smt=2, packages=2)
    (tmp_path / "vsup.yaml").write_text("model: /m\nplacement:\n  model_size_gib: 1\n" + config)
    result = vsup("export", "slurm", "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_masks_are_hex_numbers_slurm_reads():
    assert cpu_mask([0]) == "0x1" and cpu_mask([1, 3]) == "0xa" and re.fullmatch(r"0x[0-9a-f]+", cpu_mask(range(100, 200)))


# alice's key written in the config, bob's read from the submitter's BOB_KEY already
NAMED = ("model: fake-model\nplacement:\n  model_size_gib: 1\nproxy:\n  port: 9000\n  api_keys:\n"
         "    - {name: alice, key: al1ce-s3cret, priority: 5}\n    - {name: bob.ci, key_env: BOB_KEY}\n")
KEYS = {"VSUP_KEY_ALICE": "al1ce-s3cret", "BOB_KEY": "b0b-s3cret"}


def export_and_run_named(tmp_path) -> dict:
    """`vsup export slurm` of NAMED, its script run with the stand-ins and the keys' variables set;
    the environment it ran in."""
    root = build_sysfs(tmp_path / "m", nodes=(4, 4), smt=2, packages=2, node_memory=32 * GIB)
    (tmp_path / "vsup.yaml").write_text(NAMED)
    result = vsup("export", "slurm", "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root), "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    env = {**stub_slurm(tmp_path), **KEYS}
    run = subprocess.run(["bash", str(tmp_path / "out" / "vsup.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    return env


def test_named_keys_go_by_environment_never_into_the_script_or_a_step_config(tmp_path):
    env = export_and_run_named(tmp_path)
    # every file the export and the script wrote (the shared folder): no key's value in any
    written = [p for p in [*(tmp_path / "out").rglob("*"), *(tmp_path / "conf").rglob("*")] if p.is_file()]
    assert {p.name for p in written} >= {"vsup.sbatch", "front.yaml", "node0.yaml", "node1.yaml"}
    for path in written:
        assert not [key for key in KEYS.values() if key in path.read_text()], path
    # each step's vsup and the front name the variables (key_env), in the config's order
    for name in ("node0.yaml", "node1.yaml", "front.yaml"):
        cfg = parse_config((tmp_path / "conf" / name).read_text(), require_model=False)
        assert [(k.name, k.key, k.key_env, k.priority) for k in cfg.proxy.api_keys] == \
            [("alice", None, "VSUP_KEY_ALICE", 5), ("bob.ci", None, "BOB_KEY", 0)], name
    # the script stops before any step while a key's variable is unset, naming the key and the variable
    (tmp_path / "srun.log").unlink()
    missing = subprocess.run(["bash", str(tmp_path / "out" / "vsup.sbatch")], cwd=tmp_path,
                             env={k: v for k, v in env.items() if k != "VSUP_KEY_ALICE"}, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and not (tmp_path / "srun.log").exists()
    assert "proxy.api_keys[0] (alice) is read from VSUP_KEY_ALICE: export VSUP_KEY_ALICE=<its key> before sbatch" in missing.stderr


def test_the_front_passes_the_clients_key_on_to_a_per_node_vsup_that_checks_the_same_keys(tmp_path):
    # the exported front and a per-node vsup's proxy (vsup proxy on node0.yaml's proxy section: the
    # same checks as vsup run's) as real processes, over the fake vLLM; the keys by environment only
    export_and_run_named(tmp_path)
    conf = tmp_path / "conf"
    calls = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    [front_call] = [call for call in calls if "proxy" in call]
    assert "--forward-key" in front_call
    env = {**os.environ, "PYTHONPATH": str(REPO), "VSUP_API_KEY": "", **KEYS}
    back_port, front_port = free_port(), free_port()
    (fake,) = start_fakes(["n0"])
    procs: list[subprocess.Popen] = []
    try:
        # a per-node vsup without a key's variable stops at once, in one line naming the key and the variable
        unset = subprocess.run([*VSUP, "proxy", "--config", str(conf / "node0.yaml"), "--upstream", fake.url, "--port",
                                str(back_port)], env={k: v for k, v in env.items() if k != "BOB_KEY"}, capture_output=True,
                               text=True, timeout=60)
        assert unset.returncode == 2 and unset.stderr.count("\n") == 1, unset.stderr
        assert "proxy.api_keys[1].key_env: the environment variable BOB_KEY that holds the key of 'bob.ci' is not set" in unset.stderr
        for argv in ([*VSUP, "proxy", "--config", str(conf / "node0.yaml"), "--upstream", fake.url, "--port", str(back_port)],
                     [*VSUP, "proxy", "--forward-key", "--config", str(conf / "front.yaml"), "--upstream",
                      f"http://127.0.0.1:{back_port}", "--port", str(front_port)]):
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        wait_until(lambda: chat(front_port, KEYS["VSUP_KEY_ALICE"])[0] == 200, what="the front to serve through the per-node vsup")
        assert chat(front_port, KEYS["BOB_KEY"]) == (200, "n0")
        assert chat(front_port, "wrong")[0] == 401 and chat(front_port, None)[0] == 401
        assert chat(back_port, "wrong")[0] == 401 and chat(back_port, KEYS["BOB_KEY"]) == (200, "n0")  # it checks them too
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(15)
        fake.cleanup()


def chat(port: int, key: str | None) -> tuple[int, str]:
    """A chat request with Bearer `key`: (status, the fake instance that answered)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                                                                  "max_tokens": 1}), headers)
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("X-Fake-Instance", "")
    finally:
        conn.close()


def test_each_host_keeps_its_pid_files_and_logs_in_a_private_folder_no_one_can_take_first(tmp_path):
    # the script run with srun's stand-in running every step on each "host" and a stand-in vsup that
    # records what it was given; another user (uid 65534) made the folder the job's pid files once
    # went to, /tmp/vsup-<job id>/pids, first, with a link in it where vsup's pid would be written
    job = str(40000 + os.getpid() % 20000)  # the stand-ins of concurrent runs share /tmp
    squat, target = f"/tmp/vsup-{job}", tmp_path / "target"
    need_nobody_running(["mkdir"])
    for command in (["mkdir", "-p", f"{squat}/pids"], ["ln", "-s", str(target), f"{squat}/pids/node0.pid"]):
        subprocess.run([*AS_NOBODY, *command], check=True, timeout=30)
    root = build_sysfs(tmp_path / "m", nodes=(4, 4), smt=2, packages=2, node_memory=32 * GIB)
    (tmp_path / "vsup.yaml").write_text("model: fake-model\nplacement:\n  model_size_gib: 1\nproxy:\n  port: 9000\n")
    assert vsup("export", "slurm", "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root), "-o", str(tmp_path / "out")).returncode == 0
    stand_in = tmp_path / "vsup-stand-in"
    stand_in.write_text('#!/bin/bash\necho "$SLURMD_NODENAME $$ $LOGS_DIRECTORY $1 ${@: -1}" >> "$VSUP_LOG"\n')
    stand_in.chmod(0o755)
    env = {**stub_slurm(tmp_path), "SLURM_JOB_ID": job, "SRUN_RUN": "1", "VSUP": str(stand_in), "VSUP_LOG": str(tmp_path / "vsup.log")}
    folders: list[Path] = []
    try:
        run = subprocess.run(["bash", str(tmp_path / "out" / "vsup.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=60)
        assert not target.exists() and os.listdir(f"{squat}/pids") == ["node0.pid"]  # nothing went through the link
        assert run.returncode == 0, run.stderr
        folders = [Path(p.read_text().strip()) for p in sorted((tmp_path / "conf" / "local").iterdir())]
        # one folder per host, made by mktemp -d: 0700, ours, under /tmp with a name no one could guess
        assert len(folders) == 2 and len(set(folders)) == 2
        for folder in folders:
            assert re.fullmatch(rf"/tmp/vsup-{job}\.\w{{8}}", str(folder)), folder
            info = folder.stat()
            assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.getuid()
        by_host = dict(zip(("cpu-a1", "cpu-a2"), folders, strict=True))
        # each vsup's pid is in its host's folder, and its instance logs go there (LOGS_DIRECTORY)
        started = {}
        for line in (tmp_path / "vsup.log").read_text().splitlines():
            host, pid, logs, command, last = line.split()
            started[host, Path(last).stem if command == "run" else "front"] = (pid, logs)
        assert sorted(started) == [("cpu-a1", "front"), ("cpu-a1", "node0"), ("cpu-a1", "node1"), ("cpu-a2", "node0"), ("cpu-a2", "node1")]
        for (host, step), (pid, logs) in started.items():
            assert (by_host[host] / "pids" / f"{step}.pid").read_text().strip() == pid and logs == str(by_host[host] / step)
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(squat, ignore_errors=True)
