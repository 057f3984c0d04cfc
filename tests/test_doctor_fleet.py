"""`vsup doctor --config` on a file with `models:`: every model's files and its part of the memory
plan, each result naming the model (on a fake tree: the models' paths are read under --fsroot)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.sysfs_builder import build_sysfs
from vsup.cli.main import main

GIB = 1024**3

FLEET = """\
placement: {memory_reserve_gib: 1, launcher: taskset}
models:
  - model: /srv/chat
    served_model_name: chat
    instances: 2
    placement: {model_size_gib: 1}
  - model: /srv/embed
    served_model_name: embed
    instances: 1
    placement: {cores_per_instance: 1, model_size_gib: 0.5, kvcache_gib: 1}
  - model: org/rerank
    served_model_name: rerank
    instances: 1
    placement: {cores_per_instance: 1, kvcache_gib: 1}
"""


def doctor(root, config) -> dict[str, list[dict]]:
    result = CliRunner().invoke(main, ["doctor", "--fsroot", str(root), "--config", str(config), "--format", "json"])
    checks: dict[str, list[dict]] = {}
    for check in json.loads(result.output)["checks"]:
        checks.setdefault(check["check"], []).append(check)
    return checks


def test_every_models_files_and_memory_are_checked_by_name(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(4, 4), node_memory=16 * GIB)
    (root / "srv" / "chat").mkdir(parents=True)
    with (root / "srv" / "chat" / "model.safetensors").open("wb") as weights:
        weights.truncate(3 * GIB)  # sparse: its size is what counts
    (root / "srv" / "embed").mkdir(parents=True)  # no weight files
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    checks = doctor(root, config)
    chat, embed, rerank = checks["model-files"]
    assert chat["status"] == "pass" and chat["summary"] == "chat: /srv/chat: 3 GiB of weights"
    assert embed["status"] == "warn" and embed["summary"].startswith("embed: /srv/embed holds no weight files")
    assert "models[1].model" in embed["fix"]
    assert rerank["status"] == "skip" and rerank["summary"].startswith("rerank: org/rerank is a hub name")
    assert "set models[2].placement.model_size_gib" in rerank["summary"]
    memory = checks["model-memory"]
    assert [m["summary"].split(":")[0] for m in memory] == ["chat", "embed", "rerank"]
    assert all(m["status"] == "pass" for m in memory)
    assert "2 instance(s) on node(s)" in memory[0]["summary"] and "1 GiB weights" in memory[0]["summary"]
    # rerank's weights are unknown: the plan's warning names it
    assert any(w["summary"].startswith("rerank: model size unknown") for w in checks["plan-warning"])
    assert checks["memory-plan"][0]["status"] == "pass"


def test_a_missing_model_path_fails_naming_its_key(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(4, 4), node_memory=16 * GIB)
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    chat = doctor(root, config)["model-files"][0]
    assert chat["status"] == "fail"
    assert chat["summary"] == f"chat: {config}:3: models[0].model: /srv/chat: no such file or directory"


def test_a_fleet_that_does_not_fit_fails_naming_the_model(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(4, 4), node_memory=4 * GIB)
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET.replace("kvcache_gib: 1}\n  - model: org", "kvcache_gib: 8}\n  - model: org"))
    checks = doctor(root, config)
    (plan,) = checks["memory-plan"]
    assert plan["status"] == "fail" and plan["summary"].startswith(f"{config}:7: models[1].model: "), plan["summary"]
    assert "model-memory" not in checks


def test_a_single_model_config_gets_no_per_model_results(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(4,), node_memory=16 * GIB)
    config = tmp_path / "one.yaml"
    config.write_text("model: /srv/chat\ninstances: 1\nplacement: {model_size_gib: 1}\n")
    checks = doctor(root, config)
    assert "model-files" not in checks and "model-memory" not in checks
    assert checks["memory-plan"][0]["summary"].startswith("1 instance(s) fit")


def test_live_paths_are_read_here_and_relative_ones_are_not_guessed_under_a_dump(tmp_path, monkeypatch):
    from vsup.config.fleet import models_of
    from vsup.config.schema import parse_config
    from vsup.doctor.models import check_model_files
    from vsup.topology.fsroot import FsRoot

    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "model.gguf").write_bytes(b"\0" * 1024)
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(FLEET.replace("/srv/chat", "./chat").replace("/srv/embed", str(tmp_path / "chat")), "f.yaml")
    chat, embed, _ = models_of(cfg)
    live = check_model_files(chat, FsRoot("/"), live=True)
    assert live.status == "pass" and live.summary.startswith("chat: ./chat: ")
    assert check_model_files(embed, FsRoot("/"), live=True).status == "pass"
    dump = check_model_files(chat, FsRoot(tmp_path / "dump"), live=False)
    assert dump.status == "skip" and "relative to where vsup runs" in dump.summary
