"""`vsup tune` with a fleet config (issue 21): several models need --model (one line naming them);
--model tunes that model alone on the CPUs the fleet plan gives it (candidates planned on them,
each measured vsup run with them as its affinity), and writes a single-model config of it."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.sysfs_builder import GIB, build_sysfs
from tests.test_tune_cli import Tuning
from tests.vsup_harness import VSUP
from vsup.config.planning import plan_from_config
from vsup.config.schema import load_config, parse_config
from vsup.topology.sysfs import read_machine
from vsup.tune.runner import CandidateRun

FLEET = """\
placement: {launcher: numactl}
models:
  - model: /m/chat
    served_model_name: chat
    instances: 1
    placement: {model_size_gib: 2, kvcache_gib: 2}
  - model: /m/embed
    served_model_name: embed
    instances: 1
    placement: {model_size_gib: 1, kvcache_gib: 1}
"""


def tune(tmp_path, *args):
    root = build_sysfs(tmp_path / "m", nodes=(4, 4), smt=2, node_memory=16 * GIB)
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    out = subprocess.run([*VSUP, "tune", "-c", str(config), "--fsroot", str(root), "--dry-run", *args],
                         capture_output=True, text=True, timeout=60)
    return root, config, out


def test_several_models_without_model_is_one_line_naming_them(tmp_path):
    _, config, out = tune(tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr == f"vsup: error: --config {config} serves 2 models ('chat', 'embed'): tune one at a time with --model NAME\n"


def test_an_unknown_model_names_the_served_ones(tmp_path):
    _, _, out = tune(tmp_path, "--model", "rerank")
    assert out.returncode == 2 and "--model 'rerank': no model 'rerank' in this configuration; it serves 'chat', 'embed'" \
        in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_model_is_tuned_on_its_share_of_the_fleet(tmp_path):
    root, config, out = tune(tmp_path, "--model", "embed")
    assert out.returncode == 0, out.stderr
    _, fleet_plan = plan_from_config(load_config(config), root)
    share = next(m for m in fleet_plan.models if m.name == "embed")
    cores = len({c.id for c in read_machine(root).cores if set(c.cpus) & set(share.cpus)})
    assert 0 < cores < 8  # a share, not the machine
    assert max(sizes(out.stdout)) == cores  # every layout fits in the share's cores, the largest takes them all
    # the same model alone (a single-model config) is tried on the whole machine's 8 cores
    single = tmp_path / "one.yaml"
    single.write_text("model: /m/embed\nplacement: {launcher: numactl, model_size_gib: 1, kvcache_gib: 1}\n")
    whole = subprocess.run([*VSUP, "tune", "-c", str(single), "--fsroot", str(root), "--dry-run"],
                           capture_output=True, text=True, timeout=60)
    assert max(sizes(whole.stdout)) == 8, whole.stdout


def sizes(stdout: str) -> list[int]:
    """Cores each listed layout takes: "i2  2 × 2 cores, 2 threads" -> 4."""
    layouts = stdout.split(" pruned:")[0].splitlines()
    return [int(w[1]) * int(w[3]) for w in (line.split() for line in layouts if line.startswith("  i")) if w[3].isdigit()]


def test_the_measured_vsup_runs_with_the_share_as_its_affinity(tmp_path):
    # a stand-in for vsup that prints its affinity: what `vsup run` reads its usable CPUs from
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    log = tmp_path / "log"
    with CandidateRun(show, tmp_path / "c.yaml", log, proxy_port=1, socket_path=tmp_path / "s", instances=1,
                      cpus=frozenset({0})) as run:
        assert run.proc is not None and run.proc.wait(30) == 0
    assert log.read_text().strip() == "[0]"


def test_a_model_of_a_fleet_is_measured_and_written_as_a_single_model_config(tmp_path):
    t = Tuning(tmp_path)
    base = dict(t.config)
    models = [{"model": "fake-model", "served_model_name": name, "instances": 1} for name in ("chat", "embed")]
    base.pop("model")
    t.config_path.write_text(yaml.safe_dump({**base, "models": models}))
    try:
        out = t.run("--model", "embed", "--instances-per-node", "1", "--omp-threads", "all", "--smt", "off",
                    "--housekeeping-core", "off", "--preload", "none", "--write-config", str(tmp_path / "best.yaml"))
        assert out.returncode == 0, out.stderr
        written = (tmp_path / "best.yaml").read_text()
        best = parse_config(written)  # a single-model config of that model
        assert best.models is None and best.served_model_name == "embed" and best.instances == 1
        assert "Model 'embed' alone, tuned on the CPUs the fleet plan gives it" in written
        assert [r["ok"] for r in t.results("run")] and all(r["ok"] for r in t.results("run"))
        assert not t.leftovers()
    finally:
        t.cleanup()

