"""The systemd unit (checked by systemd's own tools) and `vsup install-systemd` into a temp root."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vsup.cli.main import main
from vsup.config.schema import parse_config
from vsup.systemd.install import example_config_text, install
from vsup.systemd.unit import UnitSettings, render_unit, timeouts_for

REPO = Path(__file__).resolve().parent.parent
MAX_EXPOSURE = 5.0
# what numactl --membind/--physcpubind and vLLM's worker binding call
NUMA_SYSCALLS = ("mbind", "set_mempolicy", "get_mempolicy", "migrate_pages", "move_pages", "sched_setaffinity", "sched_getaffinity")


@pytest.fixture(scope="module")
def analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze is missing: install the `systemd` package (apt-get install systemd); these tests need it"
    return path


@pytest.fixture(scope="module")
def vsup_path() -> str:
    """The vsup command of the environment running the tests: systemd-analyze verify wants
    ExecStart= to exist and be executable."""
    path = Path(sys.executable).parent / "vsup"
    assert path.is_file(), f"{path} is missing: pip install -e . in this environment"
    return str(path)


def unit_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vsup.service"
    path.write_text(text)
    return path


def test_repository_unit_is_the_default_rendering():
    committed = (REPO / "systemd" / "vsup.service").read_text()
    assert committed == render_unit(UnitSettings()), (
        "systemd/vsup.service is out of date: regenerate it with\n  python -c 'from vsup.systemd.unit import *; "
        "print(render_unit(UnitSettings()), end=\"\")' > systemd/vsup.service"
    )


def test_verify_is_clean(tmp_path, analyze, vsup_path):
    path = unit_file(tmp_path, render_unit(UnitSettings(vsup=vsup_path)))
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr


def test_verify_notices_a_missing_executable(tmp_path, analyze):
    # guards the test above: verify does look at ExecStart=
    path = unit_file(tmp_path, render_unit(UnitSettings(vsup=str(tmp_path / "no-such-vsup"))))
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no-such-vsup" in out.stderr


def test_security_exposure(tmp_path, analyze, vsup_path):
    path = unit_file(tmp_path, render_unit(UnitSettings(vsup=vsup_path)))
    out = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(path)],
                         capture_output=True, text=True, timeout=120)
    match = re.search(r"Overall exposure level for vsup\.service: (\d+\.\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    exposure = float(match.group(1))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{out.stdout}"
    # docs/systemd.md quotes docs/bench/systemd_security.json (bench/systemd_security.py): the unit of
    # this tree must rate the same under the same systemd, and never worse under another one.
    recorded = json.loads((REPO / "docs" / "bench" / "systemd_security.json").read_text())["figures"]
    version = subprocess.run([analyze, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    if version == recorded["systemd"]:
        assert exposure == recorded["exposure"], (
            f"exposure {exposure}, docs/bench/systemd_security.json says {recorded['exposure']}: "
            "run bench/systemd_security.py and scripts/published_numbers.py")
    else:
        assert exposure <= recorded["exposure"], f"exposure {exposure} > the recorded {recorded['exposure']} ({version})"


@functools.cache
def _syscalls(analyze: str, group: str) -> frozenset[str]:
    out = subprocess.run([analyze, "syscall-filter", "--no-pager", group], capture_output=True, text=True, timeout=60).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        names |= _syscalls(analyze, line) if line.startswith("@") else {line}
    return frozenset(names)


def test_numa_syscalls_stay_allowed(analyze):
    """Resolve the unit's SystemCallFilter= lines with systemd's own syscall groups."""
    allowed: frozenset[str] = frozenset()
    for line in render_unit(UnitSettings()).splitlines():
        if not line.startswith("SystemCallFilter="):
            continue
        value = line.split("=", 1)[1]
        deny = value.startswith("~")
        names = frozenset().union(*(_syscalls(analyze, n) if n.startswith("@") else {n} for n in value.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    assert allowed, "no allow list found"
    missing = [name for name in NUMA_SYSCALLS if name not in allowed]
    assert not missing, f"the unit's system call filter denies {missing}: numactl and vLLM's binding need them"


def test_lines_vllm_depends_on():
    text = render_unit(UnitSettings())
    lines = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in text.splitlines() if "=" in line and not line.startswith("#")}
    assert lines["Type"] == "notify" and lines["NotifyAccess"] == "main"
    assert lines["KillMode"] == "mixed" and lines["Restart"] == "on-failure"
    assert lines["LimitNOFILE"] == "65536"
    assert lines["OOMPolicy"] == "continue"
    assert lines["PrivateDevices"] == "yes"  # keeps /dev/shm: systemd bind-mounts it into the private /dev
    assert "MemoryDenyWriteExecute" not in lines  # oneDNN / torch JIT write and run machine code
    assert "ProcSubset" not in lines
    assert "AF_NETLINK" in lines["RestrictAddressFamilies"]
    assert int(lines["WatchdogSec"]) > 0


def test_reload_is_vsup_reload_of_the_units_own_config():
    text = render_unit(UnitSettings(vsup="/opt/vsup/bin/vsup", config="/srv/vsup/prod.yaml"))
    assert "ExecStart=/opt/vsup/bin/vsup run --config /srv/vsup/prod.yaml\n" in text
    assert "ExecReload=/opt/vsup/bin/vsup reload --config /srv/vsup/prod.yaml\n" in text
    result = CliRunner().invoke(main, ["reload", "--help"])
    assert result.exit_code == 0 and "--config" in result.output  # the command the unit runs exists


def test_timeouts_follow_the_configuration():
    cfg = parse_config("model: /m\ninstances: 4\nstop: {timeout: 45}\nproxy: {drain_timeout: 20}\nhealth: {startup_timeout: 900}\n")
    start, stop = timeouts_for(cfg, 4)
    assert stop == 20 + 4 * 45 + 30
    assert start == 900 + 60
    text = render_unit(UnitSettings(timeout_start_sec=start, timeout_stop_sec=stop))
    assert "TimeoutStopSec=230\n" in text and "TimeoutStartSec=960\n" in text


@pytest.mark.parametrize("bad", ["relative/vsup", "/opt/my vsup/bin/vsup", "/opt/%n/vsup"])
def test_paths_systemd_would_misread_are_refused(bad):
    with pytest.raises(Exception, match="absolute path"):
        render_unit(UnitSettings(vsup=bad))


# ---------------------------------------------------------------- install-systemd

def run_install(root: Path, vsup: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["install-systemd", "--root", str(root), "--vsup", vsup, *args])
    return result.exit_code, result.output


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_example_configuration_is_valid():
    parse_config(example_config_text(), "example")


def test_install_writes_unit_and_config_then_is_idempotent(tmp_path, vsup_path, analyze):
    code, out = run_install(tmp_path, vsup_path)
    assert code == 0, out
    unit = tmp_path / "etc/systemd/system/vsup.service"
    config = tmp_path / "etc/vsup/vsup.yaml"
    assert config.read_text() == example_config_text()
    assert f"ExecStart={vsup_path} run --config /etc/vsup/vsup.yaml\n" in unit.read_text()
    for step in ("systemctl daemon-reload", "systemctl enable --now vsup", "systemctl status vsup", "journalctl -u vsup -f"):
        assert step in out
    verify = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stderr
    before = snapshot(tmp_path)

    code, out = run_install(tmp_path, vsup_path)
    assert code == 0, out
    assert f"{unit}: unchanged" in out and f"{config}: unchanged" in out
    assert snapshot(tmp_path) == before


def test_changed_config_is_never_overwritten(tmp_path, vsup_path):
    config = tmp_path / "etc/vsup/vsup.yaml"
    config.parent.mkdir(parents=True)
    mine = "model: /srv/models/mine\ninstances: 3\nstop: {timeout: 50}\n"
    config.write_text(mine)
    code, out = run_install(tmp_path, vsup_path)
    assert code == 0, out
    assert config.read_text() == mine
    assert "kept as it is" in out and "not overwritten" in out
    unit = (tmp_path / "etc/systemd/system/vsup.service").read_text()
    assert "TimeoutStopSec=210\n" in unit  # 30 drain + 3 x 50 + 30, from the kept configuration


def test_unit_changed_by_hand_is_kept_as_bak(tmp_path, vsup_path):
    run_install(tmp_path, vsup_path)
    unit = tmp_path / "etc/systemd/system/vsup.service"
    edited = unit.read_text().replace("WatchdogSec=30", "WatchdogSec=99")
    unit.write_text(edited)
    code, out = run_install(tmp_path, vsup_path)
    assert code == 0 and "updated" in out
    assert (unit.parent / "vsup.service.bak").read_text() == edited
    assert "WatchdogSec=30" in unit.read_text()


def test_dry_run_writes_nothing(tmp_path, vsup_path):
    code, out = run_install(tmp_path, vsup_path, "--dry-run")
    assert code == 0, out
    assert list(tmp_path.iterdir()) == []
    assert "would be written" in out and "[Service]" in out and "nothing was written" in out


def test_user_option_and_useradd_hint(tmp_path, vsup_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    code, out = run_install(tmp_path, vsup_path, "--user", "llm")
    assert code == 0, out
    assert "useradd --system --user-group" in out and out.count(" llm\n") >= 1
    unit = (tmp_path / "etc/systemd/system/vsup.service").read_text()
    assert "User=llm\nGroup=llm\n" in unit
    (tmp_path / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\nllm:x:990:990::/var/lib/vsup:/usr/sbin/nologin\n")
    code, out = run_install(tmp_path, vsup_path, "--user", "llm")
    assert "useradd --system" not in out


def test_custom_config_path_and_unit_dir(tmp_path, vsup_path):
    code, out = run_install(tmp_path, vsup_path, "--config", "/srv/vsup/prod.yaml", "--unit-dir", "/usr/lib/systemd/system")
    assert code == 0, out
    assert (tmp_path / "srv/vsup/prod.yaml").is_file()
    assert "--config /srv/vsup/prod.yaml" in (tmp_path / "usr/lib/systemd/system/vsup.service").read_text()


def test_paths_under_home_are_flagged(tmp_path, vsup_path):
    config = tmp_path / "etc/vsup/vsup.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("model: /home/alice/models/qwen\n")
    code, out = run_install(tmp_path, vsup_path)
    assert code == 0
    assert "model /home/alice/models/qwen is under /home, which ProtectHome=yes hides" in out


def test_a_fleets_models_are_each_checked_and_counted(tmp_path, vsup_path):
    config = tmp_path / "etc/vsup/vsup.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("stop: {timeout: 10}\nproxy: {drain_timeout: 5}\nmodels:\n  - {model: /srv/chat, instances: 2}\n"
                      "  - {model: /root/embed, instances: 1}\n")
    code, out = run_install(tmp_path, vsup_path)
    assert code == 0, out
    assert "models[1].model /root/embed is under /root, which ProtectHome=yes hides" in out
    assert "/srv/chat is under" not in out
    _start, stop = timeouts_for(parse_config(config.read_text()), 3)
    assert f"TimeoutStopSec={stop}" in (tmp_path / "etc/systemd/system/vsup.service").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (("--vsup", "/nonexistent/vsup"), "not an executable file"),
    (("--config", "relative.yaml"), "absolute path"),
    (("--user", "Bad User"), "not a valid user name"),
])
def test_bad_input_is_one_line(tmp_path, vsup_path, args, message):
    result = CliRunner().invoke(main, ["install-systemd", "--root", str(tmp_path), "--vsup", vsup_path, *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == [] or not any(p.is_file() for p in tmp_path.rglob("*"))


def test_install_library_call_reports_the_unit(tmp_path, vsup_path):
    report = install(root=tmp_path, vsup=vsup_path, dry_run=True)
    assert report.unit_text.startswith("# vsup as a systemd service")
    assert not os.listdir(tmp_path)
