"""The systemd unit for vsup, rendered from vsup/systemd/data/vsup.service.in (pure: no writes).

The template is the one source of the unit's text; `systemd/vsup.service` in the repository is
this rendering for the defaults (vsup at /usr/local/bin/vsup) and a test keeps the two equal.
Timeouts follow the configuration, so that systemd never kills vsup in the middle of an orderly
stop of N instances."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from importlib import resources

from vsup.config.schema import HealthConfig, VsupConfig
from vsup.errors import VsupError

DEFAULT_VSUP = "/usr/local/bin/vsup"
DEFAULT_CONFIG = "/etc/vsup/vsup.yaml"
DEFAULT_USER = "vsup"
DEFAULT_WATCHDOG_SEC = 30
# room for vsup's own shutdown (proxy socket, logs) on top of the configured timeouts
STOP_MARGIN_SEC = 30
# before vsup's first EXTEND_TIMEOUT_USEC: Python start-up and topology reading
START_MARGIN_SEC = 60

_PLACEHOLDER = re.compile(r"@[A-Z_]+@")
# systemd splits ExecStart= on whitespace and expands % and $: refuse paths it would misread
_UNIT_SAFE_PATH = re.compile(r"/[A-Za-z0-9._+/-]*")
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]*[$]?")


@dataclass(frozen=True)
class UnitSettings:
    vsup: str = DEFAULT_VSUP  # absolute path of the vsup command
    config: str = DEFAULT_CONFIG
    user: str = DEFAULT_USER
    timeout_start_sec: int = math.ceil(HealthConfig().startup_timeout) + START_MARGIN_SEC  # the default config's
    timeout_stop_sec: int = 30 + 2 * 30 + STOP_MARGIN_SEC
    watchdog_sec: int = DEFAULT_WATCHDOG_SEC


def timeouts_for(cfg: VsupConfig, instances: int) -> tuple[int, int]:
    """(TimeoutStartSec, TimeoutStopSec) for `instances` instances under `cfg`.

    Stop: the proxy drains, then the instances stop one after another, each within stop.timeout.
    Start: one model load; vsup extends the start timeout itself while more instances load."""
    stop = cfg.proxy.drain_timeout + instances * cfg.stop.timeout + STOP_MARGIN_SEC
    start = cfg.health.startup_timeout + START_MARGIN_SEC
    return math.ceil(start), math.ceil(stop)


def template_text() -> str:
    return resources.files("vsup.systemd").joinpath("data/vsup.service.in").read_text()


def render_unit(settings: UnitSettings) -> str:
    for name, value in (("vsup path", settings.vsup), ("config path", settings.config)):
        if not _UNIT_SAFE_PATH.fullmatch(value):
            raise VsupError(
                f"{name} {value!r} cannot go into a unit file as it is: use an absolute path of "
                "letters, digits and ._+-/ (no spaces, % or $)"
            )
    if not _USER_NAME.fullmatch(settings.user):
        raise VsupError(f"--user {settings.user!r} is not a valid user name: use e.g. vsup (lower case, digits, _ and -)")
    values = {
        "@VSUP@": settings.vsup,
        "@CONFIG@": settings.config,
        "@USER@": settings.user,
        "@GROUP@": settings.user,
        "@TIMEOUT_START@": str(settings.timeout_start_sec),
        "@TIMEOUT_STOP@": str(settings.timeout_stop_sec),
        "@WATCHDOG@": str(settings.watchdog_sec),
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(0)], template_text())
