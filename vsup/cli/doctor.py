"""`vsup doctor`: check this machine against what vLLM CPU needs."""

from __future__ import annotations

import json
import sys

import click

from vsup.cli.options import format_option, fsroot_option
from vsup.doctor.checks import run_doctor
from vsup.doctor.result import exit_code, render_text, to_json


@click.command("doctor")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Also check this configuration: valid, and its plan fits each NUMA node.")
@click.option("--no-bandwidth", is_flag=True, help="Skip the memory-bandwidth triad (about a second per NUMA node).")
@fsroot_option
@format_option("text", "json")
def doctor(config_path: str | None, no_bandwidth: bool, fsroot: str, output_format: str) -> None:
    """Check this machine against what vLLM CPU needs: AVX2, numactl, vLLM's install, broken
    dependencies (pip check of vsup's and vLLM's environments), the memory plan, kernel NUMA
    settings, limits, preload libraries, other pinned processes, and the memory bandwidth of each
    NUMA node (a pinned STREAM-like triad: the limit decode runs against).

    \b
    Each line is pass / warn / fail (with the fix) or skip (not applicable here).
    Exit status: 0 all passed, 1 the worst is a warning, 2 at least one failure.
    With --fsroot, only the checks that read files run (no vLLM probe, no limits).
    """
    results = run_doctor(config_path, fsroot, bandwidth=not no_bandwidth)
    if output_format == "json":
        click.echo(json.dumps(to_json(results), indent=2))
    else:
        click.echo(render_text(results), nl=False)
    sys.exit(exit_code(results))
