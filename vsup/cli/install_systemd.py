"""`vsup install-systemd`: install vsup as a systemd service (unit + starting configuration)."""

from __future__ import annotations

import click

from vsup.systemd.install import DEFAULT_UNIT_DIR, install
from vsup.systemd.unit import DEFAULT_CONFIG, DEFAULT_USER


@click.command("install-systemd")
@click.option("--config", "config_path", default=DEFAULT_CONFIG, show_default=True,
              help="Configuration the service runs with; written from the example when missing, never overwritten.")
@click.option("--user", default=DEFAULT_USER, show_default=True, help="Dedicated account the service runs as (User=/Group=).")
@click.option("--unit-dir", default=DEFAULT_UNIT_DIR, show_default=True, help="Where the unit file goes.")
@click.option("--vsup", "vsup_path", default=None, help="Path of the vsup command for ExecStart= (default: this vsup).")
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Install into this directory tree instead of / (image builds, tests).")
@click.option("--dry-run", is_flag=True, help="Show what would be written, and the unit, without writing anything.")
def install_systemd(config_path: str, user: str, unit_dir: str, vsup_path: str | None, root: str, dry_run: bool) -> None:
    """Install vsup as a systemd service.

    Writes vsup.service (Type=notify, hardened; see docs/systemd.md) pointing at this vsup, and a
    starting configuration if there is none. Running it again changes nothing that is up to date.
    """
    report = install(root=root, unit_dir=unit_dir, config_path=config_path, user=user, vsup=vsup_path, dry_run=dry_run)
    for line in report.actions:
        click.echo(line)
    for note in report.notes:
        click.echo(f"note: {note}")
    if dry_run:
        click.echo("\n--- the unit ---")
        click.echo(report.unit_text, nl=False)
        click.echo("--- dry run: nothing was written ---")
        return
    click.echo("\nNext, as root:")
    for step in report.next_steps:
        click.echo(f"  {step}")
