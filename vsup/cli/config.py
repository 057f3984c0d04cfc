"""`vsup config --example`: the commented example configuration, every key with its default and
what it does (generated from vsup/config/schema.py; configs/vsup.yaml is this output)."""

from __future__ import annotations

import click


@click.command("config")
@click.option("--example", is_flag=True, help="Print the commented example configuration (every key, its default and what it does).")
def config_command(example: bool) -> None:
    """Print the commented example configuration (`vsup config --example > vsup.yaml` starts one)."""
    if not example:
        raise click.UsageError("say what to show: --example prints the commented example configuration")
    from vsup.config.example import example_yaml

    click.echo(example_yaml(), nl=False)
