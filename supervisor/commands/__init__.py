"""One module per `vsup` subcommand. A module lists itself here by name."""

from __future__ import annotations

import importlib

# module name -> click command attribute
_MODULES: dict[str, str] = {
}


def _load():
    commands = []
    for module_name, attr in _MODULES.items():
        module = importlib.import_module(f"supervisor.commands.{module_name}")
        commands.append(getattr(module, attr))
    return commands


COMMANDS = _load()
