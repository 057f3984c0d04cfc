"""One `vsup tune` from start to end (the I/O around the pure search): the candidates of this
machine, the bandwidth roofline, one `vsup run` per measurement, the results file, the report and
the winning configuration. commands/tune.py turns the command line into `TuneOptions`.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from rich.text import Text

from vsup.config.planning import settings_from_config
from vsup.config.schema import VsupConfig
from vsup.doctor.libs import IOMP_NAMES, TCMALLOC_NAMES, find_library, ldconfig_paths
from vsup.doctor.vllm_env import probe_python, vllm_python
from vsup.errors import VsupError
from vsup.observe.bandwidth import cpus_per_node, cpus_per_node_of, measure_bandwidth
from vsup.ownfiles import own_folder, write_text
from vsup.safetext import printable
from vsup.supervisor.launch import vllm_command
from vsup.topology.cpulist import format_list
from vsup.topology.fleet import restricted
from vsup.topology.fsroot import FsRoot
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine
from vsup.tune import configs, load, report
from vsup.tune.candidates import Candidate, Planned, Pruned, Space, layouts, plan_tweak, preload_sets, tweak_dimensions
from vsup.tune.metrics import level_name
from vsup.tune.objective import Objective
from vsup.tune.results import ResultsFile, outcome_to_json
from vsup.tune.roofline import decode_roofline, model_facts
from vsup.tune.runner import CandidateFailed, CandidateRun, free_port_run
from vsup.tune.search import Outcome, Search, SearchResult, SearchSettings, Trial
from vsup.tune.workload import WorkItem, load_jsonl, synthetic

VSUP = [sys.executable, "-m", "vsup"]  # the very vsup that runs tune starts the candidates


@dataclass
class TuneOptions:
    config_path: Path
    config: VsupConfig
    data: dict[str, Any]  # the configuration as written (what candidates and the winner are made of)
    space: Space
    objective: Objective
    concurrency: tuple[int, ...]
    request_rate: tuple[float, ...]
    workload: Path | None
    input_len: int
    output_len: int
    budget_s: float
    min_duration_s: float
    max_duration_s: float
    report_dir: Path
    resume: bool = False
    write_config: Path | None = None
    dry_run: bool = False
    roofline: bool = True
    fsroot: str = "/"
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    workload_origin: str = "--workload"  # what errors about the workload file name: the option or the config key
    # One model of a fleet (--model): the CPUs the fleet plan gives it; candidates are planned on them alone
    # and each measured vsup runs with them as its affinity. None: the whole machine.
    cpus: frozenset[int] | None = None
    enforce_eager_origin: str = "--enforce-eager"  # what errors about the --enforce-eager values name: the option or the key


class Tune:
    def __init__(self, opts: TuneOptions, console, out_console) -> None:
        self.o = opts
        self.cfg = opts.config
        self.console = console  # progress and log lines (stderr)
        self.out = out_console  # the ranked table (stdout)
        self.machine = read_machine(opts.fsroot)
        self.base = settings_from_config(self.cfg)
        if opts.cpus is not None:  # the fleet's reserved cores hold its proxy: the model's share is all instances
            self.machine = restricted(self.machine, opts.cpus)
            self.base = replace(self.base, reserve_cores=0)
        configs.check_enforce_eager(self.cfg.vllm.args, opts.space.enforce_eager, opts.enforce_eager_origin)
        self.levels = [level_name(concurrency=c) for c in opts.concurrency] + [level_name(rate=r) for r in opts.request_rate]
        self.items: list[WorkItem] | None = load_jsonl(opts.workload, opts.workload_origin) if opts.workload else None
        self.libraries = self._libraries()
        self.bandwidth: dict[int, float] = {}
        self.results = ResultsFile(opts.report_dir / "results.jsonl")
        self.model = self.cfg.served_model_name or self.cfg.model
        self.api_key = opts.environ.get("VSUP_API_KEY") or self.cfg.proxy.api_key
        self.runtime = Path(tempfile.mkdtemp(prefix="vsup-tune-"))  # short: unix socket paths are limited
        self.kept: list[Planned] = []
        self.layout_text: dict[str, str] = {}
        self.made: dict[str, Candidate] = {}  # tweaks of the best layout, by id

    # ---- what there is to try ------------------------------------------------------------------

    def _libraries(self) -> dict[str, str]:
        """tcmalloc / Intel OpenMP, found the way `vsup doctor` finds them (vLLM's venv first)."""
        fs = FsRoot(self.o.fsroot)
        live = Path(self.o.fsroot).resolve() == Path("/")
        extra: list[str] = []
        cache: dict[str, str] = {}
        if live:
            cache = ldconfig_paths()
            try:
                python = vllm_python(vllm_command(self.cfg, self.o.environ), self.o.environ.get("PATH", os.defpath))
                prefix = probe_python(python).get("prefix")
                extra = [os.path.join(prefix, "lib")] if prefix else []
            except VsupError:
                pass
        found = {"tcmalloc": find_library(TCMALLOC_NAMES, fs, cache, extra),
                 "iomp": find_library(IOMP_NAMES, fs, cache, extra)}
        return {name: path for name, path in found.items() if path}

    def candidates(self) -> tuple[list[Planned], list[Pruned], list[str]]:
        kept, pruned = layouts(self.machine, self.base, self.o.space)
        preloads, refused = preload_sets(self.libraries, self.o.space.preload)
        pruned += [Pruned(None, why, label=f"preload:{name}") for name, why in refused]
        return kept, pruned, preloads

    def tweak_dims(self, preloads: list[str]):
        busiest = max(self.o.concurrency, default=0)

        def dims(best: Planned) -> list[tuple[str, list]]:
            return tweak_dimensions(self.o.space, preloads=preloads,
                                    base_max_num_seqs=configs.flag_value(self.cfg.vllm.args, "--max-num-seqs"),
                                    base_kvcache_gib=self.cfg.placement.kvcache_gib,
                                    busiest_per_instance=math.ceil(busiest / best.candidate.instances) if busiest else None,
                                    base_enforce_eager=configs.enforce_eager(self.cfg.vllm.args))
        return dims

    def make(self, candidate: Candidate) -> Planned | Pruned:
        result = plan_tweak(self.machine, self.base, candidate)
        if isinstance(result, Planned):
            self.layout_text[result.id] = result.describe()
            self.made[result.id] = candidate
        return result

    def fingerprint(self) -> dict[str, Any]:
        return {"model": self.cfg.model, "candidates": [p.id for p in self.kept], "objective": self.o.objective.kind,
                "slo": [str(s) for s in self.o.objective.slos], "levels": self.levels,
                "workload": str(self.o.workload) if self.o.workload else f"synthetic {self.o.input_len}/{self.o.output_len}"}

    # ---- measuring one candidate -----------------------------------------------------------------

    def measure(self, trial: Trial) -> Outcome:
        cand = trial.candidate
        name = f"{cand.id}.{trial.stage}"
        base_port = free_port_run(cand.candidate.instances)
        proxy_port = free_port_run(1)
        while base_port <= proxy_port < base_port + cand.candidate.instances:
            proxy_port = free_port_run(1)
        logs = own_folder(self.o.report_dir / "logs" / name, "--report")
        sock = self.runtime / f"{abs(hash(name)) % 10**8}.sock"
        data = configs.for_measurement(configs.apply_candidate(self.o.data, cand.candidate, self.libraries),
                                       proxy_port=proxy_port, base_port=base_port, log_dir=str(logs), socket=str(sock))
        path = own_folder(self.o.report_dir / "candidates", "--report") / f"{cand.id}.yaml"
        write_text(path, configs.render(data, [f"vsup tune candidate {cand.id}: {cand.describe()}"]), "--report")
        instances = cand.candidate.instances
        start_timeout = self.cfg.health.startup_timeout * (instances if self.cfg.start.mode != "parallel" else 1) + 30  # auto may stagger
        began = time.monotonic()
        load_s = 0.0
        levels = []
        error = None
        run = CandidateRun(VSUP, path, logs / "vsup.log", proxy_port=proxy_port, socket_path=sock, instances=instances,
                           fsroot=self.o.fsroot, env=self.o.environ, stop_timeout=self.cfg.stop.timeout + self.cfg.proxy.drain_timeout + 30,
                           # (a --fsroot machine is not this one: its CPU numbers mean nothing to the scheduler here)
                           cpus=self.o.cpus if self.o.fsroot == "/" else None)
        extra: dict[str, Any] = {"layout": cand.describe(), "log": str(logs)}
        with run:
            try:
                levels, load_s = asyncio.run(self._drive(run, trial, start_timeout, extra))
            except CandidateFailed as exc:
                error = str(exc)
        wall = time.monotonic() - began
        if run.left_behind:
            extra["left_behind"] = run.left_behind
        if error is None:
            facts = model_facts(self.cfg.model, cand.plan.instances[0].weights_bytes,
                                configs.apply_candidate(self.o.data, cand.candidate, self.libraries)["vllm"]["args"])
            roof = decode_roofline(cand.plan, levels, self.bandwidth, facts) if self.bandwidth else None
            if roof is not None:
                extra["roofline"] = roof.to_json()
        outcome = Outcome(cand.id, trial.stage, trial.duration_s, error is None, tuple(levels), error, wall, load_s, extra)
        self.results.append(outcome_to_json(outcome))
        return outcome

    async def _drive(self, run: CandidateRun, trial: Trial, start_timeout: float, extra: dict[str, Any]):
        ready_s = await run.wait_ready(start_timeout)
        extra["start"] = report.start_figures(await run.status(), ready_s)
        async with load.Client(f"{run.proxy_url}/", self.model, api_key=self.api_key,
                               request_timeout=self.cfg.proxy.first_byte_timeout + self.cfg.proxy.idle_timeout) as client:
            if self.items is None:
                count = max(16, 2 * max(self.o.concurrency, default=8))
                try:
                    self.items = await synthetic(count, self.o.input_len, self.o.output_len, client.tokenize)
                except (RuntimeError, OSError, aiohttp.ClientError) as exc:
                    raise CandidateFailed(f"sizing the synthetic prompts with /tokenize failed: {exc}") from None
            try:
                await load.warm_up(client, self.items, 2 * trial.candidate.candidate.instances)
            except RuntimeError as exc:
                raise CandidateFailed(str(exc)) from None
            run.check(await run.status(), "during the warm-up")
            levels, began = [], time.monotonic()
            for concurrency in self.o.concurrency:
                levels.append(await load.closed_loop(client, self.items, concurrency, trial.duration_s))
                run.check(await run.status(), f"under load ({levels[-1].level})")
            for rate in self.o.request_rate:
                levels.append(await load.open_loop(client, self.items, rate, trial.duration_s))
                run.check(await run.status(), f"under load ({levels[-1].level})")
            if all(lv.completed == 0 for lv in levels):
                raise CandidateFailed(f"no request succeeded: {next((s for lv in levels for s in lv.error_samples), '?')}")
            return levels, time.monotonic() - began

    # ---- the whole search ----------------------------------------------------------------------

    def run(self) -> int:
        self.kept, pruned, preloads = self.candidates()
        self.layout_text = {p.id: p.describe() for p in self.kept}
        if self.o.dry_run:
            return self._dry_run(pruned, preloads)
        if not self.kept:
            raise VsupError("no layout of this machine can be tried: " + "; ".join(f"{p.id}: {p.reason}" for p in pruned[:3]))
        replay = self.results.start(self.fingerprint(), self.o.resume)
        if not replay:
            for p in pruned:
                self.results.append({"type": "pruned", "candidate": p.id, "reason": p.reason})
        began = time.monotonic()
        if self.o.roofline:
            self._measure_roofline()
        settings = SearchSettings(budget_s=max(0.0, self.o.budget_s - (time.monotonic() - began)), levels=len(self.levels),
                                  min_duration_s=self.o.min_duration_s, max_duration_s=self.o.max_duration_s)
        search = Search(settings, self.o.objective, self.measure, replay=replay, listener=None)
        with Progress(self.console, search) as progress:
            search.listener = progress.event
            result = search.run(self.kept, self.tweak_dims(preloads), self.make, pruned)
        for s in result.skipped:
            self.results.append({"type": "skipped", "candidate": s.candidate_id, "stage": s.stage, "reason": s.reason})
        self.results.append({"type": "result", "best": result.best, "ranking": result.ranking, "spent_s": round(result.spent_s, 1)})
        return self._report(result)

    def _measure_roofline(self) -> None:
        try:
            groups = cpus_per_node(plan(self.machine, self.base))
        except Exception:  # the configuration's own layout may not plan; the machine's cores still do
            groups = cpus_per_node_of(self.machine)
        self.console.print(f"measuring memory bandwidth (triad) on node(s) {', '.join(map(str, groups))} …")
        try:
            self.bandwidth = measure_bandwidth(groups)
        except (OSError, RuntimeError) as exc:
            self.console.print(Text(printable(f"memory bandwidth not measured: {exc}; no roofline figures"), style="yellow"))
            return
        self.console.print("memory bandwidth: " + ", ".join(f"node {n}: {b / 1e9:.1f} GB/s" for n, b in self.bandwidth.items()))

    def _dry_run(self, pruned: list[Pruned], preloads: list[str]) -> int:
        self.out.print(f"{len(self.kept)} layout(s) to measure on this machine:")
        for p in self.kept:
            self.out.print(f"  {p.id:<24} {p.describe()}")
        if pruned:
            self.out.print(f"{len(pruned)} pruned:")
            for q in pruned:
                self.out.print(f"  {q.id:<24} {q.reason}", markup=False, soft_wrap=True)
        dims = self.tweak_dims(preloads)(self.kept[0]) if self.kept else []
        self.out.print("then on the best layout, one at a time: "
                       + ("; ".join(f"{name} {values}" for name, values in dims) if dims else "no tweaks"), markup=False, soft_wrap=True)
        return 0

    def _report(self, result: SearchResult) -> int:
        title = f"vsup tune: {Path(self.cfg.model).name} on {socket.gethostname()} ({self.o.objective.kind})"
        table_rows = report.rows(result, self.layout_text, self.o.objective)
        self.out.print(report.rich_table(table_rows, title))
        chart_name = None
        if result.ranking:
            report.chart(result, self.o.report_dir / "chart.png", title)
            chart_name = "chart.png"
        settings_lines = [
            f"configuration: `{self.o.config_path}`; objective: {self.o.objective.kind}"
            + (f", SLO {', '.join(map(str, self.o.objective.slos))}" if self.o.objective.slos else ""),
            f"load: {', '.join(self.levels)}; workload: "
            + (f"`{self.o.workload}`" if self.o.workload else f"synthetic, {self.o.input_len} input / {self.o.output_len} output tokens"),
            f"budget {self.o.budget_s:.0f} s, spent {result.spent_s:.0f} s in {len(result.outcomes)} run(s); "
            f"{len(self.kept)} layout(s), {len(result.pruned)} pruned, {len(result.skipped)} skipped",
            f"machine: {len(self.machine.cpus_usable)} usable CPUs, {len(self.machine.cores)} cores, "
            f"{len(self.machine.cpu_nodes)} NUMA node(s)",
        ]
        eager = report.eager_tradeoff(table_rows, self._eager_pairs(result))
        for line in eager:
            self.out.print(Text(printable(line)))
        write_text(self.o.report_dir / "summary.md", report.summary(result, table_rows, title=title, settings_lines=settings_lines,
                                                                    bandwidth=self.bandwidth, chart_name=chart_name, eager=eager), "--report")
        self.console.print(Text(f"report: {self.o.report_dir / 'summary.md'}" + (f", {self.o.report_dir / 'chart.png'}" if chart_name else "")))
        if result.best is None:
            self.console.print("[red]no candidate could be measured[/red] (see the failed rows and the logs)")
            return 1
        if self.o.write_config:
            self._write_config(result, result.best, self.o.write_config)
        return 0

    def _write_config(self, result: SearchResult, best_id: str, path: Path) -> None:
        best = result.ranked(best_id)
        cand = self._candidate(best_id)
        data = configs.apply_candidate(self.o.data, cand, self.libraries)
        comments = [f"Written by `vsup tune` on {time.strftime('%Y-%m-%d %H:%M')} for {socket.gethostname()}, from {self.o.config_path}.",
                    f"Best of {len(self.kept)} layout(s) for {self.o.objective.kind}: {best_id} ({self.layout_text.get(best_id, '')}).",
                    "Measured (" + ", ".join(self.levels) + f", {best.duration_s:.0f} s per level):",
                    *[f"  {line}" for line in report.outcome_figures(best)],
                    f"Report: {self.o.report_dir / 'summary.md'}", ""]
        if self.o.cpus is not None:
            comments[-1:] = [f"Model {self.model!r} alone, tuned on the CPUs the fleet plan gives it ({format_list(self.o.cpus)}):",
                             "copy instances, placement and vllm into its entry of models: (not reserve_cores: machine-wide).", ""]
        path.parent.mkdir(parents=True, exist_ok=True)
        # a configuration to read and deploy: the usual mode (less the umask), but never through a link
        write_text(path, configs.render(data, comments), "--write-config", mode=0o644, private=False)
        self.console.print(Text(f"wrote {path}"))  # a path may hold [brackets]: not markup

    def _eager_pairs(self, result: SearchResult) -> list[tuple[str, str]]:
        """(on, off) ids of the measured candidates that differ only in --enforce-eager: each
        --enforce-eager tweak and the candidate it was tried on (which runs as the config says)."""
        base = configs.enforce_eager(self.cfg.vllm.args)
        pairs = []
        for cid in result.ranking:
            cand = self._candidate(cid)
            if cand.enforce_eager is None or cand.enforce_eager == base:
                continue
            partner = replace(cand, enforce_eager=None).id
            if partner in result.ranking:
                pairs.append((cid, partner) if cand.enforce_eager else (partner, cid))
        return pairs

    def _candidate(self, cid: str) -> Candidate:
        return {**{p.id: p.candidate for p in self.kept}, **self.made}[cid]

    def close(self) -> None:
        shutil.rmtree(self.runtime, ignore_errors=True)


class Progress:
    """A rich progress bar with ETA over the planned seconds, and one line per finished run."""

    def __init__(self, console, search: Search) -> None:
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.console = console
        self.search = search
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)
        self.task = self.bar.add_task("starting", total=max(1.0, search.planned_total))
        self.trial_began: float | None = None
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self) -> Progress:
        self.bar.start()
        self.ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.ticker.join(2)
        self.bar.stop()

    def _tick(self) -> None:
        while not self.stop.wait(0.5):
            running = time.monotonic() - self.trial_began if self.trial_began else 0.0
            self.bar.update(self.task, total=max(1.0, self.search.planned_total), completed=self.search.spent + running)

    def event(self, kind: str, data) -> None:
        if kind == "start":
            self.trial_began = time.monotonic()
            self.bar.update(self.task, description=f"{data.stage} {data.candidate.id} ({data.duration_s:.0f}s per level)")
        elif kind in ("outcome", "replayed"):
            self.trial_began = None
            what = "recorded" if kind == "replayed" else "measured"
            if data.ok:
                lv = data.levels
                text = ", ".join(f"{x.level} {x.output_throughput:.1f} tok/s" for x in lv)
                start = report.start_text(data.extra.get("start"))
                text += f"; ready in {start}" if start != "-" else ""
                self.console.print(Text(printable(f"{what} {data.stage:<7} {data.candidate_id:<24} {text}")))
            else:
                self.console.print(Text(printable(f"{what} {data.stage:<7} {data.candidate_id:<24} FAILED: {data.error}")))
        elif kind == "skipped":
            self.console.print(Text(printable(f"skipped {data.stage:<7} {data.candidate_id:<24} {data.reason}")))
        elif kind == "pruned":
            self.console.print(Text(printable(f"pruned          {data.id:<24} {data.reason}")))
