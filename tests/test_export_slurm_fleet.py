"""`vsup export slurm` of a fleet (issue 21): one step per model and NUMA node of its share, bound
to its instances' CPUs, each running a single-model config of that model; the front proxy's
upstreams name their model, so it routes by the request's model. Run with stand-ins for srun and
scontrol that record what the script asks of Slurm."""

from __future__ import annotations

import json
import shlex
import subprocess

from tests.sysfs_builder import GIB, build_sysfs
from tests.test_export_kubernetes_fleet import FLEET
from tests.test_export_slurm import cpu_mask, stub_slurm
from tests.test_plan_cli import vsup
from vsup.cli.proxy import build_pool, model_configs
from vsup.config.schema import parse_config


def test_steps_per_model_and_a_front_that_routes_by_model(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8, 8, 8), smt=2, packages=2, node_memory=64 * GIB)
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    out = tmp_path / "out"
    plan = vsup("plan", "--config", str(config), "--fsroot", str(root), "--format", "json")
    assert plan.returncode == 0, plan.stderr
    result = vsup("export", "slurm", "--config", str(config), "--fsroot", str(root), "--hosts", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    script = (out / "vsup.sbatch").read_text()
    assert "s3cret" not in script  # proxy.api_key's and team-a's
    assert subprocess.run(["bash", "-n", str(out / "vsup.sbatch")], capture_output=True).returncode == 0
    run = subprocess.run(["bash", str(out / "vsup.sbatch")], cwd=tmp_path, env={**stub_slurm(tmp_path), "VSUP_API_KEY": "k", "VSUP_KEY_TEAM_A": "t"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr

    instances = json.loads(plan.stdout)["instances"]
    calls = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    steps = {call[-1]: call for call in calls if "run" in call}
    (front,) = [call for call in calls if "proxy" in call]
    expected = {}
    for model, slug in (("chat", "chat"), ("Org/Embed_v2", "org-embed-v2")):
        for node in sorted({inst["nodes"][0] for inst in instances if inst["model"] == model}):
            insts = [inst for inst in instances if inst["model"] == model and inst["nodes"] == [node]]
            path = tmp_path / "conf" / f"{slug}-node{node}.yaml"
            call = steps[str(path)]
            assert f"--cpu-bind=verbose,mask_cpu:{cpu_mask(c for i in insts for c in i['cpus'])}" in call
            step = parse_config(path.read_text())  # a single-model config of that model alone
            assert step.models is None and step.served_model_name == model and step.instances == len(insts)
            assert step.vllm.base_port == insts[0]["port"] and step.placement.kvcache_gib * GIB == insts[0]["kvcache_bytes"]
            expected[step.proxy.port] = model
    assert len(steps) == len(expected) == 4  # 2 models × 2 nodes each
    assert sorted(expected) == [9001, 9002, 9003, 9004]
    upstreams = [front[i + 1] for i, word in enumerate(front) if word == "--upstream"]
    assert upstreams == [f"{expected[port]}=http://{host}:{port}" for host in ("cpu-a1", "cpu-a2") for port in sorted(expected)]
    front_cfg = parse_config((tmp_path / "conf" / "front.yaml").read_text(), require_model=False)
    assert front_cfg.proxy.port == 9000 and front_cfg.proxy.api_key is None
    assert "--forward-key" in front and front_cfg.proxy.api_keys[0].key_env == "VSUP_KEY_TEAM_A"
    assert not [p for p in (tmp_path / "conf").glob("*.yaml") if "s3cret" in p.read_text()]
    policies = {m: c.policy for m, c in model_configs(build_pool(tuple(upstreams)), front_cfg.proxy, front_cfg).items()}
    assert policies == {"chat": "prefix_affinity", "Org/Embed_v2": "round_robin"}
