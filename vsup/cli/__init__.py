"""One module per `vsup` subcommand. A module lists itself here by name; the command's name is
the module's with "_" as "-". Modules are imported only when their command runs (or for --help),
so `vsup status` does not pay for importing the proxy or the doctor."""

from __future__ import annotations

import importlib

import click

# module name -> click command attribute
_MODULES: dict[str, str] = {
    "config": "config_command",
    "doctor": "doctor",
    "install_systemd": "install_systemd",
    "topology": "topology_command",
    "plan": "plan_command",
    "run": "run_command",
    "status": "status_command",
    "top": "top_command",
    "restart": "restart_command",
    "reload": "reload_command",
    "proxy": "proxy_command",
    "tune": "tune_command",
    "export": "export_command",
    "batch": "batch_command",
}


def command_names() -> list[str]:
    return sorted(name.replace("_", "-") for name in _MODULES)


def load_command(name: str) -> click.Command | None:
    module_name = name.replace("-", "_")
    if module_name not in _MODULES:
        return None
    module = importlib.import_module(f"vsup.cli.{module_name}")
    return getattr(module, _MODULES[module_name])
