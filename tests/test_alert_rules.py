"""The shipped alert rules and dashboard, read by Prometheus's own tool: `promtool check rules`
(they load) and `promtool test rules` (tests/data/vsup-alerts-test.yml: they fire per model, with
the summaries docs/operations.md promises), and the dashboard's queries and legends kept per model. That
every query reads metrics a running vsup exports is tests/test_observe_run.py's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.tools import need_tool

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "docs/prometheus/vsup-alerts.yml"
CASES = ROOT / "tests/data/vsup-alerts-test.yml"
DASHBOARD = ROOT / "docs/grafana/vsup.json"


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = need_tool("promtool", package="prometheus")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_the_alert_rules_load_in_promtool():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_alerts_fire_per_model_in_promtool():
    done = promtool("test", "rules", str(CASES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rule_that_groups_per_instance_groups_per_model_too():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    for rule in rules:
        for grouping in re.findall(r"\bby \(([^)]*)\)", rule["expr"]):
            labels = {label.strip() for label in grouping.split(",")}
            if labels & {"exported_instance", "instance"} and rule["alert"] != "VsupFiguresStale":
                assert "model" in labels, (rule["alert"], rule["expr"])
    ready = next(r for r in rules if r["alert"] == "VsupNoInstanceReady")
    assert "by (instance, model)" in ready["expr"]


def dashboard_targets() -> list[tuple[str, dict]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def test_the_dashboards_per_instance_queries_and_legends_name_the_model():
    for title, target in dashboard_targets():
        for grouping in re.findall(r"\bby \(([^)]*)\)", target["expr"]):
            if "exported_instance" in grouping:
                assert "model" in grouping, (title, target["expr"])
        if "{{exported_instance}}" in target.get("legendFormat", ""):
            assert "{{model}}" in target["legendFormat"], (title, target["legendFormat"])


def test_the_dashboard_has_a_models_row_of_ready_instances_requests_and_tokens_by_model():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"].startswith("Models"))
    following = []
    for p in panels[row + 1:]:
        if p["type"] == "row":
            break
        following.append(p)
    by_model = {name for p in following for t in p["targets"] if "by (model)" in t["expr"]
                for name in re.findall(r"(vsup_\w+|vllm:\w+)", t["expr"])}
    assert {"vsup_instance_ready", "vsup_proxy_requests_total", "vsup_proxy_in_flight",
            "vllm:generation_tokens_total"} <= by_model
    assert all("{{model}}" in t["legendFormat"] for p in following for t in p["targets"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    # the rows below moved down, nothing overlaps: each panel's cells are its own
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
