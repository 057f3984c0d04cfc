"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class TopologyError(ValueError):
    """A sysfs file is missing or malformed in a way that would make the topology wrong.

    The message names the file and what was expected."""


class PlanError(ValueError):
    """The requested layout cannot be planned on this machine; the message says why and what would work."""


class SettingError(PlanError):
    """A PlanError about the value of one PlanSettings field. The planner does not know where the
    value came from, so its text names the `vsup plan` flag; vsup.config.planning names the
    config key and its file:line instead when the value came from a config file."""

    def __init__(self, setting: str, flag: str, value: str | None, detail: str):
        self.setting, self.flag, self.value, self.detail = setting, flag, value, detail
        super().__init__(f"{flag} {value}: {detail}" if value is not None else f"{flag}: {detail}")
