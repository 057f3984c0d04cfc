"""`vsup run --config FILE`: plan, start the instances and the proxy, keep them healthy until SIGTERM."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import time

import click

from vsup.config.schema import load_config
from vsup.errors import VsupError
from vsup.safetext import PrintableFormatter

from .options import fsroot_option


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):  # the journal adds its own timestamps
        handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def check_port_free(host: str, port: int, what: str) -> None:
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            from vsup.supervisor.leftovers import describe_port_holder

            holder = describe_port_holder(port) if exc.errno == errno.EADDRINUSE else None
            raise VsupError(f"{what}: port {port} on {host} is not free ({exc.strerror})"
                            + (f": {holder}" if holder else "") + "; stop what uses it or choose another port") from None


@click.command("run")
@click.option("--config", "-c", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The YAML configuration (`vsup config --example --all` lists every key).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="Overrides log.level.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="vsup's own log on stderr: text lines or one JSON object per line.")
@fsroot_option
def run_command(config_path: str, log_level: str | None, log_format: str, fsroot: str) -> None:
    """Start the planned instances and the proxy; keep them healthy until SIGTERM/SIGINT."""
    # the supervisor's modules (aiohttp, the proxy, psutil) load only when vsup really runs
    from vsup.proxy.runloop import run
    from vsup.supervisor.launch import build_command, model_config
    from vsup.supervisor.leftovers import sweep as sweep_leftovers
    from vsup.supervisor.preflight import check_programs, checked_plan
    from vsup.supervisor.supervisor import Supervisor

    began = time.monotonic()
    config = load_config(config_path)
    setup_logging(log_level or config.log.level, log_format)
    _machine, plan = checked_plan(config, fsroot, os.environ, runs_here=True)
    # what a killed vsup left running may hold the ports: stop it first (never a live vsup's)
    sweep_leftovers(os.environ, config.stop.timeout)
    check_port_free(config.proxy.host, config.proxy.port, "proxy.port")
    for inst in plan.instances:  # what this machine must have now, beyond the config checks
        argv, _env = build_command(inst, model_config(config, inst), os.environ)
        check_programs(argv, len(inst.argv))
        if config.vllm.listen == "tcp":
            check_port_free("127.0.0.1", inst.port, f"vllm.base_port (instance {inst.index})")
    logging.getLogger("vsup").info("planned %d instance(s) in %.2fs; config %s", len(plan.instances),
                                   time.monotonic() - began, config_path)
    code = run(Supervisor(config, plan, config_path=os.path.abspath(config_path), fsroot=fsroot,
                          log_level_given=log_level is not None).run())
    sys.exit(code)
