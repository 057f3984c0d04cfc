"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class TopologyError(ValueError):
    """A sysfs file is missing or malformed in a way that would make the topology wrong.

    The message names the file and what was expected."""


class PlanError(ValueError):
    """The requested layout cannot be planned on this machine; the message says why and what would work."""
