"""Errors a user can act on; the CLI prints them as one line and exits with code 2."""


class VsupError(Exception):
    """Bad input or an impossible request; the message names the value and what would work."""


class ConfigError(VsupError):
    """The YAML configuration is invalid; the message names the key, the value and the line."""
