"""`vsup plan` and the preflight checks on a file with `models:` (a real subprocess on the corpus's
2-socket Xeon): a line per model and a MODEL column, the models in JSON, each model's launch lines."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.test_plan_cli import XEON, vsup
from vsup.config.schema import parse_config
from vsup.errors import VsupError
from vsup.supervisor.preflight import checked_plan

FLEET = """\
placement: {memory_reserve_gib: 2, launcher: numactl}
vllm: {args: [--dtype, bfloat16]}
models:
  - model: /srv/chat
    served_model_name: chat
    instances: 1
    placement: {nodes: [0], model_size_gib: 16}
  - model: /srv/embed
    served_model_name: embed
    instances: 1
    placement: {cores_per_instance: 2, model_size_gib: 1, kvcache_gib: 2}
    vllm: {args: [--runner, pooling, --convert, embed]}
  - model: /srv/rerank
    served_model_name: rerank
    instances: 1
    placement: {cores_per_instance: 2, model_size_gib: 1}
"""


@pytest.fixture(scope="module")
def xeon(corpus) -> str:
    return str(corpus.fsroot(XEON))


@pytest.fixture
def fleet(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def test_table_has_a_line_per_model_and_a_model_column(xeon, fleet):
    result = vsup("plan", "-c", str(fleet), "--fsroot", xeon)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("models:")
    assert lines[start + 1].split() == ["model", "instances", "cores", "nodes", "why"]
    assert lines[start + 2].split()[:4] == ["chat", "0", "7", "0"] and "node 0 whole (placement.nodes 0" in lines[start + 2]
    assert lines[start + 3].split()[:4] == ["embed", "1", "2", "1"] and "2 cores of node 1 beside rerank" in lines[start + 3]
    assert "[i1 8+24 9+25] [i2 10+26 11+27]" in result.stdout
    row = next(line.split() for line in lines if line.strip().startswith("2  rerank"))
    assert row[:4] == ["2", "rerank", "2.sock", "1"]
    assert "planned 45 GiB of 45.2 GiB (MemTotal - 2 GiB reserve)" in result.stdout  # node 1: both models, one budget


def test_json_lists_the_models(xeon, fleet):
    result = vsup("plan", "-c", str(fleet), "--fsroot", xeon, "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(m["name"], m["instances"], m["cpus_list"]) for m in data["models"]] == [
        ("chat", [0], "1-7,17-23"), ("embed", [1], "8-9,24-25"), ("rerank", [2], "10-11,26-27")]
    assert [(i["model"], i["replica"]) for i in data["instances"]] == [("chat", 0), ("embed", 0), ("rerank", 0)]


def test_shell_gives_each_model_its_own_launch_lines(xeon, fleet):
    result = vsup("plan", "-c", str(fleet), "--fsroot", xeon, "--format", "shell")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0::2] == ["# chat", "# embed", "# rerank"]
    chat, embed, rerank = (shlex.split(line) for line in lines[1::2])
    assert chat[chat.index("serve") + 1] == "/srv/chat" and chat[-2:] == ["--dtype", "bfloat16"]
    assert embed[embed.index("serve") + 1] == "/srv/embed" and embed[-4:] == ["--runner", "pooling", "--convert", "embed"]
    assert "--served-model-name" in rerank and rerank[rerank.index("--served-model-name") + 1] == "rerank"
    assert "VLLM_CPU_KVCACHE_SPACE=2" in embed and "--membind=1" in rerank


@pytest.mark.parametrize("flag", [["-n", "2"], ["--model", "/m"]])
def test_model_flags_are_refused_for_a_fleet(xeon, fleet, flag):
    result = vsup("plan", "-c", str(fleet), "--fsroot", xeon, *flag)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"vsup: error: {flag[0] if flag[0] != '-n' else '--instances'}: {fleet} lists models: set "
                                     f"{'instances' if flag[0] == '-n' else 'model'} in each entry of models (placement flags "
                                     "apply to every model that does not set the key itself)")


def test_a_placement_flag_applies_to_every_model(xeon, fleet):
    result = vsup("plan", "-c", str(fleet), "--fsroot", xeon, "--launcher", "taskset", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert all(i["argv"][0] == "taskset" for i in json.loads(result.stdout)["instances"])


def test_preflight_checks_every_models_path(xeon, tmp_path):
    chat = tmp_path / "chat"
    chat.mkdir()
    cfg = parse_config(FLEET.replace("/srv/chat", str(chat)), "f.yaml")
    with pytest.raises(VsupError, match=r"^f\.yaml:8: models\[1\]\.model: '/srv/embed': no such file or directory"):
        checked_plan(cfg, xeon, {}, runs_here=True)
    checked_plan(cfg, xeon, {}, runs_here=False)  # planned for another machine: its paths are not here


def test_preflight_names_the_model_whose_size_max_rss_needs(xeon):
    text = FLEET.replace("{cores_per_instance: 2, model_size_gib: 1}", "{cores_per_instance: 2, kvcache_gib: 1}")
    cfg = parse_config("restart: {max_rss: 1.5}\n" + text.replace("/srv/rerank", "org/rerank"), "f.yaml")
    with pytest.raises(VsupError) as info:
        checked_plan(cfg, xeon, {}, runs_here=False)
    assert str(info.value) == (
        "f.yaml:1: restart.max_rss: 1.5 is a multiple of the planned memory, but the plan does not know the model's size "
        "(f.yaml:14: models[2].model) (a hub name, or no weight files found); set models[2].placement.model_size_gib, "
        'or give restart.max_rss in bytes, e.g. "6GiB"')


def test_the_fleet_example_in_docs_placement_is_what_vsup_plan_prints(xeon, tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "placement.md").read_text()
    section = doc[doc.index("## Several models on one machine"):]
    yaml_text = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    shown = section.split("$ vsup plan -c fleet.yaml --fsroot DUMP\n", 1)[1].split("```", 1)[0]
    assert yaml_text == FLEET
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml_text)
    result = vsup("plan", "-c", str(path), "--fsroot", xeon)
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown
