"""`vsup config --example`: the commented example configuration, every key with its default and
what it does (generated from vsup/config/schema.py; configs/vsup.yaml is this output);
`vsup config --tune-settings`: the keys of a `vsup tune --settings FILE` file."""

from __future__ import annotations

import click


@click.command("config")
@click.option("--example", is_flag=True, help="Print the commented example configuration (every key, its default and what it does).")
@click.option("--tune-settings", is_flag=True, help="Print every key of a `vsup tune --settings FILE` file, with its default.")
def config_command(example: bool, tune_settings: bool) -> None:
    """Print the commented example configuration (`vsup config --example > vsup.yaml` starts one)."""
    from vsup.config.example import example_yaml, tune_settings_yaml

    if example and tune_settings:
        raise click.UsageError("--example and --tune-settings print different files: ask for one")
    if tune_settings:
        click.echo(tune_settings_yaml(), nl=False)
        return
    if not example:
        raise click.UsageError("say what to show: --example prints the commented example configuration, "
                               "--tune-settings the keys of a `vsup tune --settings` file")
    click.echo(example_yaml(), nl=False)
