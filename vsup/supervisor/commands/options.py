"""Options shared by several subcommands, so they are spelled the same everywhere."""

from __future__ import annotations

import click


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
