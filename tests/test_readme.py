"""The README's promises that a test can hold: a newcomer's ten minutes (at most 400 lines), its
two set-up commands, what CI runs, every command named, its configuration a file vsup takes, the
several-models example being a file vsup takes with the plan `vsup plan` prints for it, and every
link it and docs/ hold pointing at a file that is there. What moved into docs/ keeps its checks:
docs/operations.md shows the `vsup top` capture and explains every alert, docs/fleet.md quotes
what routing by model costs from its result file."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.test_plan_cli import XEON
from tests.test_plan_cli import vsup as run_vsup
from vsup.cli import command_names
from vsup.config.fleet import models_of
from vsup.config.schema import parse_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def test_readme_opens_with_exactly_two_setup_commands_that_exist():
    lang, first = _code_blocks(README)[0]
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["bash scripts/demo", "bash scripts/test"]
    for command in commands:
        assert (ROOT / command.split()[1]).is_file()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test" in ci
    assert "VSUP_SKIP_VLLM" not in ci  # the real-vLLM tests are part of CI


def test_every_subcommand_is_mentioned():
    for name in command_names():
        assert f"vsup {name}" in README, name


def test_the_readme_is_read_in_ten_minutes():
    assert len(README.splitlines()) <= 400
    headings = [line for line in README.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## What vsup does", "## Install", "## Quick start"] and headings[-1] == "## What to read next"


def test_the_readmes_configuration_is_a_file_vsup_takes():
    section = README[README.index("## The configuration\n"):]
    section = section[:section.index("\n## ", 1)]
    (text,) = [body for lang, body in _code_blocks(section) if lang == "yaml"]
    config = parse_config(text, "my.yaml")
    assert config.instances == 2 and config.restart.max_rss == 1.2 and config.proxy.api_key == "change-me"


def _links(text: str) -> list[str]:
    """The relative link targets of a markdown text (no URLs, no in-page anchors), anchors cut."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
            if not target.startswith(("http://", "https://", "#", "mailto:"))]


def test_every_link_of_the_readme_and_docs_points_at_a_file_that_is_there():
    missing = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in _links(path.read_text()):
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert missing == []


def test_the_vsup_top_capture_is_the_one_the_tmux_test_took():
    """docs/vsup-top.txt is what tests/test_observe_run.py captured in a tmux pane
    (VSUP_UPDATE_DOCS=1 rewrites it); docs/operations.md shows that very capture."""
    capture = (ROOT / "docs" / "vsup-top.txt").read_text()
    assert "TOK/S" in capture and "LOCAL" in capture
    assert f"```\n{capture}```" in (ROOT / "docs" / "operations.md").read_text()


def test_every_alert_rule_is_explained_in_docs_operations():
    rules = yaml.safe_load((ROOT / "docs" / "prometheus" / "vsup-alerts.yml").read_text())["groups"][0]["rules"]
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert len(rules) >= 10
    assert [rule["alert"] for rule in rules if f"| `{rule['alert']}` |" not in operations] == []


# ---- "Several models on one machine" ----------------------------------------------------------------

def _fleet_example() -> tuple[str, str, str]:
    """(the section, its YAML, the plan it shows) from the README."""
    section = README[README.index("## Several models on one machine\n"):]
    section = section[:section.index("\n## ", 1)]
    yaml_text = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    shown = section.split("$ vsup plan --config fleet.yaml --fsroot DUMP\n", 1)[1].split("```", 1)[0]
    return section, yaml_text, shown


def test_the_several_models_example_is_a_fleet_of_chat_and_a_pooling_embedding_model():
    section, yaml_text, _ = _fleet_example()
    chat, embed = models_of(parse_config(yaml_text, "fleet.yaml"))
    assert (chat.name, embed.name) == ("chat", "embed")
    assert chat.config.vllm.args[-2:] == ["--max-model-len", "8192"]
    assert embed.config.vllm.args[-4:] == ["--runner", "pooling", "--convert", "embed"]
    assert f"tests/data/hwloc/{XEON}.tar.bz2" in section  # the machine of the plan is named
    # the measured cost comes from fleet_bench.json, in docs/fleet.md
    assert "<!-- BEGIN published:fleet " in (ROOT / "docs" / "fleet.md").read_text()


def test_the_several_models_plan_is_what_vsup_plan_prints(corpus, tmp_path):
    _, yaml_text, shown = _fleet_example()
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml_text)
    result = run_vsup("plan", "--config", str(path), "--fsroot", str(corpus.fsroot(XEON)))
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown
