"""The README's promises that a test can hold: its two set-up commands, what CI runs, and the
configuration reference being `vsup config --example`."""

from __future__ import annotations

import re
from pathlib import Path

from vsup.cli import command_names
from vsup.config.example import example_yaml, with_readme_reference
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


def test_configuration_reference_is_the_generated_example():
    assert with_readme_reference(README) == README, (
        "README's configuration reference differs from `vsup config --example`: "
        "run `.venv/bin/python scripts/config_reference.py`")
    blocks = [body for lang, body in _code_blocks(README) if lang == "yaml"]
    assert example_yaml() in blocks
    parse_config(example_yaml(), "configs/vsup.yaml")


def test_every_subcommand_is_mentioned():
    for name in command_names():
        assert f"vsup {name}" in README, name


def test_the_vsup_top_capture_is_the_one_the_tmux_test_took():
    """docs/vsup-top.txt is what tests/test_observe_run.py captured in a tmux pane
    (VSUP_UPDATE_DOCS=1 rewrites it); the README shows that very capture."""
    capture = (ROOT / "docs" / "vsup-top.txt").read_text()
    assert "TOK/S" in capture and "LOCAL" in capture
    assert f"```\n{capture}```" in README
