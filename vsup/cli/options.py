"""Options shared by several subcommands, so they are spelled the same everywhere."""

from __future__ import annotations

import click

from vsup.errors import VsupError


def format_option(*choices: str, default: str | None = None):
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(choices),
        default=default or choices[0],
        show_default=True,
        help="Output format.",
    )


fsroot_option = click.option(
    "--fsroot",
    # Existence is checked by vsup.topology.read_machine, so a bad path is one `vsup: error:` line
    # (exit 2) like every other user error, not click's multi-line usage message.
    type=click.Path(file_okay=False),
    envvar="VSUP_FSROOT",
    default="/",
    show_default=True,
    help="Read sysfs/procfs under this directory instead of / (like hwloc's HWLOC_FSROOT; env VSUP_FSROOT).",
)


class Checked(click.ParamType):
    """Converts an option's text; a bad value is one `vsup: error:` line naming the option (exit 2)
    instead of click's multi-line usage message."""

    name = "value"

    def __init__(self, parse, expected: str):
        self.parse, self.expected = parse, expected

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            result = self.parse(value.strip())
        except ValueError:
            result = None
        if result is None:
            raise VsupError(f"{param.opts[0]} {value!r}: expected {self.expected}")
        return result
