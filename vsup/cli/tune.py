"""`vsup tune`: measure the layouts of this machine with this model, pick the best, write the config."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click
import yaml

from vsup.cli.options import Checked, fsroot_option
from vsup.config.fleet import is_fleet, models_of, view_of
from vsup.config.schema import VsupConfig, load_config, where
from vsup.config.tune_settings import LocatedSettings, load_tune_settings
from vsup.errors import VsupError
from vsup.ownfiles import own_folder


def _list(item, expected: str):
    def parse(text: str):
        values = tuple(item(part.strip()) for part in text.split(","))
        return values if values and all(v is not None for v in values) else None
    return Checked(parse, expected)


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) >= 1 else None


def _rate(text: str) -> float | None:
    value = float(text)
    return value if value > 0 and value != float("inf") else None


def _threads(text: str) -> int | str | None:
    return text if text in ("all", "half") else _count(text)


def _switch(text: str) -> bool | None:
    return {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}.get(text.lower())


def _preload(text: str) -> str | None:
    return text if text in ("none", "tcmalloc", "iomp", "tcmalloc+iomp") else None


def _seconds(text: str) -> float | None:
    from vsup.tune.objective import parse_duration

    value = parse_duration(text)
    return value if value > 0 else None


class _SloType(click.ParamType):
    name = "slo"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        from vsup.tune.objective import parse_slo

        try:
            return parse_slo(value)
        except ValueError as exc:
            raise VsupError(f"--slo {value!r}: {exc}") from None


@click.command("tune")
@click.option("--config", "-c", "config_path", required=True, type=click.Path(dir_okay=False),
              help="Your vsup YAML: the model, vLLM's flags and the placement the candidates start from.")
@click.option("--settings", "settings_path", default=None, type=click.Path(dir_okay=False),
              help="A YAML file of tune settings (what to try, the load): each key of `vsup config --tune-settings`; "
                   "a flag overrides its key.")
@click.option("--model", "model_name", default=None, metavar="NAME",
              help="With a config of several models (models:): the one to tune, on the CPUs the plan gives it, "
                   "the others' held as planned.")
@click.option("--objective", type=Checked(lambda t: t if t in ("throughput", "latency") else None, "throughput or latency"),
              default="throughput", show_default=True,
              help="throughput: most output tokens/s; latency: lowest median time to first token.")
@click.option("--slo", type=_SloType(), default=None,
              help="Limits a winner must meet at every load level, e.g. ttft_p99=2s,itl_p99=200ms (ttft/tpot/itl/e2el × mean/p50/p90/p99).")
@click.option("--workload", type=click.Path(dir_okay=False), default=None,
              help="JSONL of {\"prompt\"|\"messages\", \"max_tokens\"} per line. [default: the --settings file's workload, else synthetic prompts]")
@click.option("--input-len", type=Checked(_count, "a whole number of tokens, at least 1"), default=None,
              help="Synthetic prompts: input tokens, sized with the server's /tokenize. [default: --settings' input_len, else 128]")
@click.option("--output-len", type=Checked(_count, "a whole number of tokens, at least 1"), default=None,
              help="Synthetic prompts: output tokens per request. [default: --settings' output_len, else 64]")
@click.option("--concurrency", type=_list(_count, "a comma list of whole numbers, e.g. 8,32"), default=None,
              help="Closed-loop levels: requests kept in flight. [default: --settings' concurrency, else 8,32]")
@click.option("--request-rate", type=_list(_rate, "a comma list of requests per second, e.g. 2,4.5"), default=None,
              help="Open-loop levels in requests/s (Poisson arrivals). [default: --settings' request_rate, else none]")
@click.option("--budget", type=Checked(_seconds, "a duration, e.g. 30m, 1h, 900s"), default="30m", show_default=True,
              help="Wall-clock time for the whole search, start-ups included.")
@click.option("--min-duration", type=Checked(_seconds, "a duration, e.g. 10s"), default="10s", show_default=True,
              help="Shortest load time per level and run.")
@click.option("--max-duration", type=Checked(_seconds, "a duration, e.g. 5m"), default="5m", show_default=True,
              help="Longest load time per level and run (a large budget ends early rather than run longer).")
@click.option("--instances-per-node", type=_list(_count, "a comma list of whole numbers, e.g. 1,2"), default=None,
              help="Instances per NUMA node to try. [default: --settings' instances_per_node, else 1,2,4,… while each keeps a core]")
@click.option("--omp-threads", type=_list(_threads, "a comma list of all, half or thread counts, e.g. all,half,3"), default=None,
              help="OpenMP threads per instance to try. [default: --settings' omp_threads, else all,half]")
@click.option("--smt", type=_list(_switch, "off, on or off,on"), default=None,
              help="SMT settings to try. [default: --settings' smt, else off,on where cores have siblings]")
@click.option("--housekeeping-core", type=_list(_switch, "off, on or off,on"), default=None,
              help="Housekeeping-core settings to try. [default: --settings' housekeeping_core, else off,on]")
@click.option("--preload", type=_list(_preload, "a comma list of none, tcmalloc, iomp, tcmalloc+iomp"), default=None,
              help="LD_PRELOAD sets to try on the best layout. [default: --settings' preload, else none and the installed ones]")
@click.option("--max-num-seqs", type=_list(_count, "a comma list of whole numbers"), default=None,
              help="vLLM --max-num-seqs values to try on the best layout. [default: --settings' max_num_seqs, else half the busiest level's requests per instance]")
@click.option("--max-num-batched-tokens", type=_list(_count, "a comma list of whole numbers"), default=None,
              help="vLLM --max-num-batched-tokens values to try on the best layout. [default: --settings' max_num_batched_tokens, else none]")
@click.option("--kvcache-gib", type=_list(_rate, "a comma list of positive GiB"), default=None,
              help="KV cache sizes per instance to try on the best layout. [default: --settings' kvcache_gib, else the largest that fits]")
@click.option("--enforce-eager", "enforce_eager", type=_list(_switch, "on, off or on,off"), default=None,
              help="vLLM --enforce-eager settings to try last on the best configuration, side by side with their start "
                   "times (off compiles at every start). [default: --settings' enforce_eager, else the config's own]")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default="vsup-tune", show_default=True,
              help="Folder for results.jsonl, summary.md, chart.png, the candidates' YAML and logs.")
@click.option("--resume", is_flag=True, help="Continue the search recorded in REPORT/results.jsonl.")
@click.option("--write-config", type=click.Path(dir_okay=False), default=None,
              help="Write the winner as a complete vsup YAML, with the measured figures as comments.")
@click.option("--dry-run", is_flag=True, help="List the candidates and the pruned ones (with why), measure nothing.")
@click.option("--no-roofline", is_flag=True, help="Skip the memory-bandwidth triad (no roofline figures).")
@fsroot_option
def tune_command(config_path, settings_path, model_name, objective, slo, workload, input_len, output_len, concurrency, request_rate, budget,
                 min_duration, max_duration, instances_per_node, omp_threads, smt, housekeeping_core, preload, max_num_seqs,
                 max_num_batched_tokens, kvcache_gib, enforce_eager, report_dir, resume, write_config, dry_run, no_roofline, fsroot) -> None:
    """Measure layouts of this machine with this model through `vsup run`, pick the best.

    \b
    Every layout the planner allows (instances per node, OpenMP threads, SMT, housekeeping
    core) runs a short load; the better half runs again, longer, until one wins; then
    LD_PRELOAD and vLLM's batch flags are tried on it (and --enforce-eager on and off, when asked). Prints a ranked table; leaves
    results.jsonl, summary.md and chart.png in --report. docs/tune.md explains the method.
    What to try and the load come from the flags, or a file of their own (--settings).
    """
    from rich.console import Console

    from vsup.tune.candidates import Space
    from vsup.tune.objective import Objective
    from vsup.tune.session import Tune, TuneOptions

    cfg = load_config(config_path)
    data = yaml.safe_load(Path(config_path).read_text())
    cfg, data, cpus = model_to_tune(cfg, data, model_name, config_path, fsroot)
    t = load_tune_settings(settings_path) if settings_path is not None else LocatedSettings()
    if min_duration > max_duration:
        raise VsupError(f"--min-duration {min_duration:g}s is longer than --max-duration {max_duration:g}s")
    space = Space(
        instances_per_node=instances_per_node or _tuple(t.instances_per_node),
        omp_threads=omp_threads or _tuple(t.omp_threads),
        smt=smt or _tuple(t.smt),
        housekeeping_core=housekeeping_core or _tuple(t.housekeeping_core),
        preload=preload or _tuple(t.preload),
        max_num_seqs=max_num_seqs or _tuple(t.max_num_seqs),
        max_num_batched_tokens=max_num_batched_tokens or _tuple(t.max_num_batched_tokens),
        kvcache_gib=kvcache_gib or _tuple(t.kvcache_gib),
        enforce_eager=enforce_eager or _tuple(t.enforce_eager),
    )
    options = TuneOptions(
        config_path=Path(config_path), config=cfg, data=data, space=space, objective=Objective(objective, slo or ()),
        concurrency=concurrency if concurrency is not None else tuple(t.concurrency),
        request_rate=request_rate if request_rate is not None else tuple(t.request_rate),
        workload=Path(workload) if workload else t.workload, input_len=input_len or t.input_len,
        output_len=output_len or t.output_len, budget_s=budget, min_duration_s=min_duration, max_duration_s=max_duration,
        report_dir=Path(report_dir), resume=resume, write_config=Path(write_config) if write_config else None,
        dry_run=dry_run, roofline=not no_roofline, fsroot=fsroot,
        workload_origin="--workload" if workload else where(t, "workload"), cpus=cpus,
        enforce_eager_origin="--enforce-eager" if enforce_eager else where(t, "enforce_eager"),
    )
    if not dry_run:  # before anything is measured: a search must not end in an unwritable report
        check_writable(options.report_dir, "--report", folder=True)
        if options.write_config:
            check_writable(options.write_config, "--write-config", folder=False)
        own_folder(options.report_dir, "--report")  # vsup's own: created 0700, or refused if another user could write it
    # piped output (a log, CI) gets the whole table instead of 80 columns of wrapped cells
    console, out = Console(stderr=True), Console(width=None if sys.stdout.isatty() else 220)
    # SIGTERM ends a tune like Ctrl-C: the candidate running is stopped, the results so far stay
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    session = Tune(options, console, out)
    try:
        code = session.run()
    except KeyboardInterrupt:
        click.echo(f"vsup: interrupted; the runs so far are in {options.report_dir / 'results.jsonl'}: "
                   f"the same command with --resume continues", err=True)
        sys.exit(130)
    finally:
        session.close()
    sys.exit(code)


def model_to_tune(cfg: VsupConfig, data: dict, name: str | None, config_path: str,
                  fsroot: str) -> tuple[VsupConfig, dict, frozenset[int] | None]:
    """(the single-model config to tune, its YAML, the CPUs it is tuned on: None for the whole
    machine). A fleet: the model's view, on the CPUs the fleet plan gives it (the others hold
    theirs); several models and no --model: an error naming them."""
    from vsup.config.planning import plan_from_config

    if not is_fleet(cfg):
        if name is not None:
            view_of(cfg, name)  # the one model it serves, or an error naming it
        return cfg, data, None
    views = models_of(cfg)
    if name is None:
        if len(views) > 1:
            raise VsupError(f"--config {config_path} serves {len(views)} models ({', '.join(repr(v.name) for v in views)}): "
                            "tune one at a time with --model NAME")
        name = views[0].name
    try:
        view = view_of(cfg, name)
    except VsupError as exc:
        raise VsupError(f"--model {name!r}: {exc}") from None
    _machine, fleet_plan = plan_from_config(cfg, fsroot)
    share = next(m for m in fleet_plan.models if m.name == view.name)
    own = view.config.model_dump(mode="json", exclude_defaults=True)
    own.pop("models", None)
    own["placement"] = {**own.get("placement", {}), "reserve_cores": 0}  # the fleet's reserve is outside the share
    return view.config, own, frozenset(share.cpus)


def check_writable(path: Path, flag: str, *, folder: bool) -> None:
    """A VsupError naming `flag` unless `path` (a folder, or a file) can be written, or made in its
    nearest existing folder, by this user."""
    what = "a folder" if folder else "a file"
    if path.exists():
        if path.is_dir() != folder:
            raise VsupError(f"{flag} {path}: exists and is not {what}; give {what} path")
        where, writable = path, os.access(path, os.W_OK | (os.X_OK if folder else 0))
    else:
        where = path.parent
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise VsupError(f"{flag} {path}: {where} is not a folder; give {what} path under a folder you can write")
        writable = os.access(where, os.W_OK | os.X_OK)
    if not writable:
        raise VsupError(f"{flag} {path}: {where} is not writable by this user; choose {what} path you can write")


def _tuple(values):
    return tuple(values) if values is not None else None
