"""`vsup install-systemd`: put the unit and a starting configuration in place, idempotently.

Every destination lives under `root` ("/" normally; a temporary tree in tests or image builds).
Nothing an admin changed is overwritten silently: a configuration that differs from the example
is left alone, and a unit that differs from the new rendering is kept next to it as .bak (local
changes belong in drop-ins, `systemctl edit vsup`). Accounts are not created here: the command
to do it is printed, so that the admin sees every change made to the system's user database."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path, PurePosixPath

from vsup.config.fleet import models_of
from vsup.config.schema import VsupConfig, parse_config
from vsup.errors import ConfigError, VsupError
from vsup.systemd.unit import DEFAULT_CONFIG, DEFAULT_USER, UnitSettings, render_unit, timeouts_for

UNIT_NAME = "vsup.service"
DEFAULT_UNIT_DIR = "/etc/systemd/system"
# ProtectHome=yes hides these from the service
_HIDDEN_BY_PROTECT_HOME = ("/home", "/root", "/run/user")


@dataclass
class InstallReport:
    actions: list[str] = field(default_factory=list)  # "<path>: written" / "unchanged" / ...
    notes: list[str] = field(default_factory=list)  # things the admin should know or fix
    next_steps: list[str] = field(default_factory=list)  # commands to run now
    unit_text: str = ""


def example_config_text() -> str:
    """The starting configuration, shipped in the package (configs/vsup.yaml links to it)."""
    try:
        return resources.files("vsup.config").joinpath("data/vsup.yaml").read_text()
    except OSError as exc:
        raise VsupError(
            f"the example configuration is missing from this installation ({exc}): reinstall vsup, "
            "or pass --config pointing at a configuration you wrote"
        ) from None


def _example_or_none() -> str | None:
    try:
        return example_config_text()
    except VsupError:
        return None


def installed_vsup() -> str | None:
    """The path of the `vsup` command being run (kept as invoked, so a /usr/local/bin symlink stays
    a symlink across upgrades), else the first `vsup` on PATH."""
    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "vsup" and os.path.isfile(argv0) and os.access(argv0, os.X_OK):
        return os.path.abspath(argv0)
    found = shutil.which("vsup")
    return os.path.abspath(found) if found else None


def user_exists(name: str, root: Path) -> bool:
    if root == Path("/"):
        try:
            pwd.getpwnam(name)
            return True
        except KeyError:
            return False
    return _name_in_db(root / "etc/passwd", name)


def _group_id(name: str, root: Path) -> int | None:
    if root != Path("/"):
        return None  # a tree being prepared for another system: its ids mean nothing here
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _name_in_db(path: Path, name: str) -> bool:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    return any(line.split(":", 1)[0] == name for line in lines)


def _under(path: str, prefixes: tuple[str, ...]) -> str | None:
    p = PurePosixPath(path)
    return next((prefix for prefix in prefixes if p == PurePosixPath(prefix) or PurePosixPath(prefix) in p.parents), None)


def _write_atomic(dest: Path, text: str, mode: int, gid: int | None = None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        if gid is not None:
            os.chown(tmp, -1, gid)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _count_instances(cfg: VsupConfig) -> int:
    """Every model's instances (a fleet's stop timeout covers them all)."""
    counts = [view.config.instances for view in models_of(cfg)]
    if all(isinstance(count, int) for count in counts):
        return sum(int(count) for count in counts)
    # instances: auto -> one per NUMA node with usable CPUs on this machine
    from vsup.topology.errors import TopologyError
    from vsup.topology.sysfs import read_machine

    try:
        nodes = max(1, len(read_machine("/").cpu_nodes))
    except (TopologyError, OSError):
        nodes = 1
    return sum(count if isinstance(count, int) else nodes for count in counts)


def install(
    *,
    root: str | Path = "/",
    unit_dir: str = DEFAULT_UNIT_DIR,
    config_path: str = DEFAULT_CONFIG,
    user: str = DEFAULT_USER,
    vsup: str | None = None,
    dry_run: bool = False,
) -> InstallReport:
    root = Path(root)
    report = InstallReport()
    verb = "would be " if dry_run else ""

    vsup = vsup or installed_vsup()
    if vsup is None:
        raise VsupError("cannot find the vsup command (not run as `vsup` and not on PATH): pass --vsup /path/to/vsup")
    vsup = os.path.abspath(vsup)
    if not (os.path.isfile(vsup) and os.access(vsup, os.X_OK)):
        raise VsupError(f"--vsup {vsup}: not an executable file; pass the path of the installed vsup command")
    if not os.path.isabs(config_path):
        raise VsupError(f"--config {config_path}: the service needs an absolute path, e.g. {DEFAULT_CONFIG}")
    settings = UnitSettings(vsup=vsup, config=config_path, user=user)
    render_unit(settings)  # refuses bad paths / user names before anything is written

    # 1. the configuration: written only when there is none
    config_dest = root / config_path.lstrip("/")
    wrote_config = False
    gid = _group_id(user, root)
    if config_dest.exists():
        current = config_dest.read_text()
        example = _example_or_none()
        if current == example:
            report.actions.append(f"{config_dest}: unchanged")
        elif example is None:
            report.actions.append(f"{config_dest}: kept as it is (not overwritten)")
        else:
            report.actions.append(f"{config_dest}: kept as it is (it differs from the example; not overwritten)")
        config_text = current
    else:
        config_text = example = example_config_text()
        if not dry_run:
            # 0640 + the service's group: the file may hold proxy.api_key
            _write_atomic(config_dest, example, 0o640 if gid is not None else 0o644, gid)
        report.actions.append(f"{config_dest}: {verb}written from the example configuration")
        report.notes.append(f"edit {config_path}: set `model:` to your model directory (it must not be under /home or /root)")
        wrote_config = True

    # 2. the unit, with timeouts that fit this configuration
    try:
        cfg = parse_config(config_text, config_path)
    except ConfigError as exc:
        report.notes.append(f"`vsup run` will refuse the configuration until it is fixed: {exc}")
    else:
        start, stop = timeouts_for(cfg, _count_instances(cfg))
        settings = replace(settings, timeout_start_sec=start, timeout_stop_sec=stop)
        used = [(f"{view.key}.{key}".lstrip("."), path) for view in models_of(cfg) for key, path in (
            ("model", view.config.model), ("vllm.venv", str(view.config.vllm.venv) if view.config.vllm.venv else ""),
            ("vllm.command", view.config.vllm.command[0] if view.config.vllm.command else ""))]
        used = list(dict.fromkeys(used))  # a fleet's models may share a venv
        for key, path in used:
            hidden = _under(path, _HIDDEN_BY_PROTECT_HOME) if path.startswith("/") else None
            if hidden:
                report.notes.append(
                    f"{key} {path} is under {hidden}, which ProtectHome=yes hides from the service: move it "
                    "(e.g. to /var/lib/vsup or /opt) or add `ProtectHome=read-only` with `systemctl edit vsup`"
                )
    unit_text = render_unit(settings)
    report.unit_text = unit_text
    unit_dest = root / unit_dir.lstrip("/") / UNIT_NAME
    if unit_dest.exists() and unit_dest.read_text() == unit_text:
        report.actions.append(f"{unit_dest}: unchanged")
    elif unit_dest.exists():
        backup = unit_dest.with_name(UNIT_NAME + ".bak")
        if not dry_run:
            shutil.copy2(unit_dest, backup)
            _write_atomic(unit_dest, unit_text, 0o644)
        report.actions.append(f"{unit_dest}: {verb}updated (the previous version {verb}saved as {backup.name})")
    else:
        if not dry_run:
            _write_atomic(unit_dest, unit_text, 0o644)
        report.actions.append(f"{unit_dest}: {verb}written")

    hidden = _under(vsup, _HIDDEN_BY_PROTECT_HOME)
    if hidden:
        report.notes.append(
            f"{vsup} is under {hidden}, which ProtectHome=yes hides from the service: install vsup elsewhere, e.g. "
            "`python3 -m venv /opt/vsup && /opt/vsup/bin/pip install vsup`, then run /opt/vsup/bin/vsup install-systemd"
        )

    # 3. what the admin runs next
    if not user_exists(user, root):
        report.next_steps.append(
            f"useradd --system --user-group --home-dir /var/lib/vsup --no-create-home --shell /usr/sbin/nologin {user}"
        )
    if wrote_config and gid is None:
        # written world-readable because the group did not exist yet; it may hold proxy.api_key
        report.next_steps.append(f"chgrp {user} {config_path} && chmod 640 {config_path}")
    report.next_steps += [
        "systemctl daemon-reload",
        "systemctl enable --now vsup",
        "systemctl status vsup",
        "journalctl -u vsup -f",
    ]
    return report
