"""The `vsup` fixture: a factory of real `vsup run` processes over fake vLLM instances, each
closed (with everything it started) at teardown. Registered for every test module by tests/conftest.py."""

from __future__ import annotations

import pytest

from tests.vsup_harness import VsupRun, make_config


@pytest.fixture
def vsup(tmp_path):
    """vsup(faults={index: {"START_DELAY": "2", ...}}, env={...}, **config sections) -> a started
    VsupRun. Faults become FAKE_VLLM_* variables of that instance only (see tests/fake_per_port.py);
    env is added to vsup's own environment."""
    runs: list[VsupRun] = []

    def start(faults: dict[int, dict[str, str]] | None = None, env: dict[str, str] | None = None, **sections) -> VsupRun:
        config = make_config(tmp_path, **sections)
        base = config["vllm"]["base_port"]
        instance_env = dict(config["vllm"]["env"])
        for index, values in (faults or {}).items():
            prefix = f"PORT{base + index}__" if config["vllm"].get("listen") == "tcp" else f"SOCK{index}__"
            instance_env.update({f"{prefix}FAKE_VLLM_{key}": str(value) for key, value in values.items()})
        config["vllm"]["env"] = instance_env
        run = VsupRun(tmp_path, config, env)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()
