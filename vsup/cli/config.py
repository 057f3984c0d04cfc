"""`vsup config --example [--all]`, `vsup config --tune-settings`: the commented example
configurations (generated from vsup/config/schema.py and vsup/config/tune_settings.py;
configs/vsup.yaml is `--example`, docs/configuration.md holds `--example --all`)."""

from __future__ import annotations

import click


@click.command("config")
@click.option("--example", is_flag=True, help="Print the commented example configuration: the keys people set, with short comments.")
@click.option("--all", "every", is_flag=True, help="With --example: every key, its default, what it does and how `vsup reload` treats a change.")
@click.option("--tune-settings", is_flag=True, help="Print every key of a `vsup tune --settings FILE` file, with its default.")
def config_command(example: bool, every: bool, tune_settings: bool) -> None:
    """Print a commented example configuration (`vsup config --example > vsup.yaml` starts one)."""
    from vsup.config.example import example_yaml, tune_settings_yaml

    if example and tune_settings:
        raise click.UsageError("--example and --tune-settings print different files: ask for one")
    if tune_settings:
        if every:
            raise click.UsageError("--all goes with --example; --tune-settings always prints every key")
        click.echo(tune_settings_yaml(), nl=False)
        return
    if every and not example:
        raise click.UsageError("--all goes with --example: `vsup config --example --all` prints every key")
    if not example:
        raise click.UsageError("say what to show: --example prints the commented example configuration "
                               "(--example --all: every key), --tune-settings the keys of a `vsup tune --settings` file")
    click.echo(example_yaml(full=every), nl=False)
