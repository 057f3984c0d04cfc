"""The files docs/kubernetes.md and docs/slurm.md show are what `vsup export` writes for the sample
machine: a hand-made 2-socket tree (2 × 16 cores × 2 threads, 2 NUMA nodes of 128 GiB) and
docs/examples/vsup.yaml. Run with VSUP_REGEN_DOCS=1 to write them again after a change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sysfs_builder import GIB, build_sysfs
from tests.test_plan_cli import vsup

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
GENERATED = {
    ("kubernetes",): ["kubernetes/vsup.yaml", "kubernetes/kubelet-config.yaml"],
    ("slurm", "--hosts", "2"): ["slurm/vsup.sbatch"],
}


@pytest.mark.parametrize("args", list(GENERATED), ids=lambda args: args[0])
def test_checked_in_examples_are_what_export_writes(tmp_path, args):
    machine = build_sysfs(tmp_path / "machine", nodes=(16, 16), smt=2, packages=2, node_memory=128 * GIB)
    out = tmp_path / "out"
    result = vsup("export", *args, "--config", str(EXAMPLES / "vsup.yaml"), "--fsroot", str(machine), "-o", str(out))
    assert result.returncode == 0, result.stderr
    for rel in GENERATED[args]:
        written = (out / Path(rel).name).read_text()
        if os.environ.get("VSUP_REGEN_DOCS") == "1":
            (EXAMPLES / rel).write_text(written)
        assert (EXAMPLES / rel).read_text() == written, f"docs/examples/{rel} is stale: VSUP_REGEN_DOCS=1 pytest {__file__}"


def test_the_pages_show_the_examples():
    for page, files in (("kubernetes.md", GENERATED[("kubernetes",)]), ("slurm.md", GENERATED[("slurm", "--hosts", "2")])):
        text = (ROOT / "docs" / page).read_text()
        for rel in files:
            assert f"examples/{rel}" in text, (page, rel)
