"""What `vsup tune` shows and leaves behind: the ranked table (terminal, rich), the chart
(matplotlib PNG: tokens/s against TTFT p50/p99 per candidate and load level, the Pareto front and
the winner marked; and tokens/s against the start's seconds) and the markdown summary.

Across load levels a row shows the geometric mean of tokens/s and of TTFT p50 (the objective's
figures) and the worst p99s; the summary has every level. Beside tokens/s: what the candidate's
start took, from its spawn to ready (its slowest instance, the supervisor's own clock: the status
JSON's `start`), and the torch.compile part of it — what choosing it costs at every (re)start,
which the objective does not weigh; the summary sets --enforce-eager on and off side by side.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vsup.ownfiles import open_binary
from vsup.safetext import printable
from vsup.tune.objective import Objective, _geomean, format_seconds
from vsup.tune.search import Outcome, SearchResult


@dataclass(frozen=True)
class Row:
    rank: int | None
    candidate: str
    layout: str
    stage: str
    status: str  # ok, failed, pruned, skipped
    tok_s: float = float("nan")
    req_s: float = float("nan")
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    itl_p50: float = float("nan")
    itl_p99: float = float("nan")
    roofline: float | None = None  # fraction of the memory-bandwidth limit
    start_s: float = float("nan")  # spawn to ready of its slowest instance
    compile_s: float | None = None  # of which torch.compile's warm-up (its slowest instance's)
    note: str = ""
    levels: tuple = field(default=())


def rows(result: SearchResult, layouts: Mapping[str, str], objective: Objective) -> list[Row]:
    out: list[Row] = []
    for rank, cid in enumerate(result.ranking, 1):
        o = result.ranked(cid)
        lv = o.levels
        roof = (o.extra.get("roofline") or {}).get("fraction")
        note = "; ".join(objective.violations(lv))
        if cid == result.best:
            note = "best" + (f" (misses: {note})" if note else "")
        out.append(Row(rank, cid, layouts.get(cid, ""), o.stage, "ok",
                       tok_s=_geomean([x.output_throughput for x in lv]), req_s=_geomean([x.request_throughput for x in lv]),
                       ttft_p50=_geomean([x.get("ttft", "p50") for x in lv]), ttft_p99=max(x.get("ttft", "p99") for x in lv),
                       itl_p50=_geomean([x.get("itl", "p50") for x in lv]), itl_p99=max(x.get("itl", "p99") for x in lv),
                       roofline=roof, start_s=_start_seconds(o.extra.get("start")),
                       compile_s=(o.extra.get("start") or {}).get("compile_s"), note=note, levels=lv))
    ok = set(result.ranking)
    for o in result.outcomes:
        if not o.ok and o.candidate_id not in ok and all(r.candidate != o.candidate_id for r in out):
            out.append(Row(None, o.candidate_id, layouts.get(o.candidate_id, ""), o.stage, "failed", note=o.error or ""))
    for s in result.skipped:
        if s.candidate_id not in ok and all(r.candidate != s.candidate_id for r in out):
            out.append(Row(None, s.candidate_id, layouts.get(s.candidate_id, ""), s.stage, "skipped", note=s.reason))
    for p in result.pruned:
        out.append(Row(None, p.id, "", "-", "pruned", note=p.reason))
    return out


def start_figures(status: Mapping[str, Any] | None, vsup_s: float) -> dict[str, Any]:
    """What a candidate's start took, for the results file (a run's extra.start): `vsup_s` from
    `vsup run` to every instance in the proxy's rotation (as the tune saw it), `ready_s` the
    slowest instance's spawn to ready and `compile_s` the longest compile (the supervisor's
    clock: the status JSON's `start` of each instance, vsup/supervisor/phases.py; None when
    vsup did not say), and each instance's own {ready_s, took: {phase: seconds}}."""
    known = [inst["start"] for inst in (status or {}).get("instances", [])
             if isinstance(inst.get("start"), dict) and isinstance(inst["start"].get("ready_s"), (int, float))]
    return {"vsup_s": round(vsup_s, 2),
            "ready_s": max((s["ready_s"] for s in known), default=None),
            "compile_s": max((float((s.get("took") or {}).get("compiling", 0.0)) for s in known), default=None),
            "instances": known}


def _start_seconds(start: Mapping[str, Any] | None) -> float:
    """The start figure a row shows: the slowest instance's spawn to ready, else vsup's own."""
    start = start or {}
    value = start.get("ready_s") if start.get("ready_s") is not None else start.get("vsup_s")
    return float(value) if isinstance(value, (int, float)) else float("nan")


def duration(seconds: float | None) -> str:
    """"4.2s", "2m10s"; "-" when not known."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def start_text(start: Mapping[str, Any] | None) -> str:
    """ "2m10s (compiling 1m52s)", "21.0s": a start as one phrase."""
    seconds = _start_seconds(start)
    compiled = (start or {}).get("compile_s")
    return duration(seconds) + (f" (compiling {duration(compiled)})" if compiled and math.isfinite(seconds) else "")


def _compile_cell(value: float | None) -> str:
    return "-" if value is None else ("none" if value == 0 else duration(value))


def _num(value: float, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else "-"


def _pct(value: float | None) -> str:
    return f"{value * 100:.0f}%" if value is not None and math.isfinite(value) else "-"


HEADERS = ("#", "candidate", "layout", "stage", "tok/s", "start", "compile", "req/s", "TTFT p50", "TTFT p99", "ITL p50",
           "ITL p99", "of bandwidth", "note")


def _cells(r: Row) -> list[str]:
    return [str(r.rank) if r.rank else r.status, r.candidate, r.layout, r.stage, _num(r.tok_s), duration(r.start_s),
            _compile_cell(r.compile_s), _num(r.req_s, 2),
            format_seconds(r.ttft_p50), format_seconds(r.ttft_p99), format_seconds(r.itl_p50), format_seconds(r.itl_p99),
            _pct(r.roofline), r.note]


def rich_table(table_rows: Sequence[Row], title: str = "vsup tune"):
    from rich.table import Table
    from rich.text import Text

    # Text, not str: a note quotes a candidate's error ("[/srv/models/x] not found"), which rich
    # would read as markup (a closing tag: MarkupError after the whole search)
    table = Table(title=Text(printable(title)), header_style="bold")
    for header in HEADERS:
        table.add_column(header, justify="right" if header not in ("candidate", "layout", "stage", "note") else "left",
                         overflow="fold")
    for r in table_rows:
        style = "bold green" if r.note.startswith("best") else ("dim" if r.status != "ok" else None)
        table.add_row(*(Text(printable(c)) for c in _cells(r)), style=style)
    return table


def markdown_table(table_rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in table_rows:
        lines.append("| " + " | ".join(_markdown(c) for c in _cells(r)) + " |")
    return "\n".join(lines)


_MARKDOWN = re.compile(r"([\\`*_\[\]<>!])")


def _markdown(cell: str) -> str:
    """A cell as markdown text that reads as written: a candidate's error must not turn into a
    link, an image fetched from elsewhere, HTML or emphasis when the summary is rendered."""
    return _MARKDOWN.sub(r"\\\1", printable(cell)).replace("|", "/")


def levels_table(result: SearchResult) -> str:
    lines = ["| candidate | level | tok/s | req/s | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | ITL p50 | ITL p90 | ITL p99 | "
             "requests | errors |", "|" + "---|" * 13]
    for cid in result.ranking:
        for lv in result.ranked(cid).levels:
            lines.append(f"| {cid} | {lv.level} | {lv.output_throughput:.1f} | {lv.request_throughput:.2f} | "
                         + " | ".join(format_seconds(lv.get(m, s)) for m, s in (("ttft", "p50"), ("ttft", "p90"), ("ttft", "p99"),
                                                                                 ("tpot", "p50"), ("itl", "p50"), ("itl", "p90"),
                                                                                 ("itl", "p99")))
                         + f" | {lv.completed} | {lv.errors} |")
    return "\n".join(lines)


def eager_tradeoff(table_rows: Sequence[Row], pairs: Sequence[tuple[str, str]]) -> list[str]:
    """One line per (on, off) pair of measured candidates that differ only in --enforce-eager:
    each one's start and tokens/s, and what compiling costs at every start for what it gains."""
    by_id = {r.candidate: r for r in table_rows if r.status == "ok"}
    out = []
    for on, off in pairs:
        eager, compiled = by_id.get(on), by_id.get(off)
        if eager is None or compiled is None:
            continue
        text = (f"--enforce-eager on (`{on}`): ready in {duration(eager.start_s)}, {_num(eager.tok_s)} tokens/s; "
                f"off (`{off}`): ready in {duration(compiled.start_s)}"
                + (f", {duration(compiled.compile_s)} of it compiling" if compiled.compile_s else "")
                + f", {_num(compiled.tok_s)} tokens/s.")
        if all(math.isfinite(v) for v in (eager.start_s, compiled.start_s, eager.tok_s, compiled.tok_s)) and eager.tok_s > 0:
            longer = compiled.start_s - eager.start_s
            text += (f" Off costs {duration(abs(longer))} {'more' if longer >= 0 else 'less'} at every start (each restart, "
                     f"reload and added instance) for {(compiled.tok_s / eager.tok_s - 1) * 100:+.0f} % tokens/s.")
        out.append(text)
    return out


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indexes of the points no other point beats on both (more throughput, less latency), by throughput."""
    front = [i for i, (x, y) in enumerate(points)
             if not any((x2 >= x and y2 <= y) and (x2 > x or y2 < y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i][0])


def chart(result: SearchResult, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({lv.level for cid in result.ranking for lv in result.ranked(cid).levels},
                   key=lambda n: (n[0], float(n[1:])))
    starts = [(cid, _start_seconds(result.ranked(cid).extra.get("start")),
               _geomean([x.output_throughput for x in result.ranked(cid).levels])) for cid in result.ranking]
    starts = [(cid, start, tok) for cid, start, tok in starts if math.isfinite(start) and math.isfinite(tok)]
    panels = max(1, len(names)) + (1 if starts else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5), squeeze=False)
    if starts:  # what each candidate costs at start, against what it makes
        ax = axes[0][-1]
        ax.scatter([tok for _, _, tok in starts], [start for _, start, _ in starts], marker="s", color="tab:purple", zorder=2)
        for cid, start, tok in starts:
            ax.annotate(cid, (tok, start), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if cid == result.best:
                ax.scatter([tok], [start], marker="*", s=260, color="tab:red", label=f"best: {cid}", zorder=3)
        ax.set_xlabel("output tokens/s (geometric mean over the levels)")
        ax.set_ylabel("start: spawn to ready (s)")
        ax.set_title("start time against speed")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax, name in zip(axes[0], names or ["-"], strict=False):
        ids, xs, p50, p99 = [], [], [], []
        for cid in result.ranking:
            lv = next((x for x in result.ranked(cid).levels if x.level == name), None)
            if lv is None or not math.isfinite(lv.get("ttft", "p50")):
                continue
            ids.append(cid)
            xs.append(lv.output_throughput)
            p50.append(lv.get("ttft", "p50"))
            p99.append(lv.get("ttft", "p99"))
        for x, a, b in zip(xs, p50, p99, strict=True):
            ax.plot([x, x], [a, b], color="0.75", linewidth=1, zorder=1)
        ax.scatter(xs, p50, marker="o", color="tab:blue", label="TTFT p50", zorder=2)
        ax.scatter(xs, p99, marker="^", color="tab:orange", label="TTFT p99", zorder=2)
        front = pareto(list(zip(xs, p50, strict=True)))
        if front:
            ax.plot([xs[i] for i in front], [p50[i] for i in front], linestyle="--", color="tab:green",
                    label="Pareto front (p50)", zorder=1)
        for i, cid in enumerate(ids):
            ax.annotate(cid, (xs[i], p50[i]), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if cid == result.best:
                ax.scatter([xs[i]], [p50[i]], marker="*", s=260, color="tab:red", label=f"best: {cid}", zorder=3)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"load {name}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title.replace("$", r"\$"))  # a $ would start matplotlib's mathtext
    fig.tight_layout()
    with open_binary(path, "w") as f:  # never through a link planted at its name
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return path


def summary(result: SearchResult, table_rows: Sequence[Row], *, title: str, settings_lines: Sequence[str],
            bandwidth: Mapping[int, float], chart_name: str | None, eager: Sequence[str] = ()) -> str:
    parts = [f"# {title}", "", *[f"- {line}" for line in settings_lines], ""]
    if bandwidth:
        parts.append("Memory bandwidth (STREAM-like triad, pinned like the instances): "
                     + ", ".join(f"node {n}: {b / 1e9:.1f} GB/s" for n, b in bandwidth.items()) + ".")
        parts.append("")
    best = result.latest(result.best) if result.best else None
    if best is None:
        parts += ["**No candidate could be measured.** See the failed rows below and the logs in `logs/`.", ""]
    else:
        row = next(r for r in table_rows if r.candidate == result.best)
        roof = best.extra.get("roofline") or {}
        parts.append(f"**Best: `{result.best}`** ({row.layout}): {row.tok_s:.1f} output tokens/s, TTFT p50 "
                     f"{format_seconds(row.ttft_p50)}, p99 {format_seconds(row.ttft_p99)}, ITL p99 {format_seconds(row.itl_p99)}.")
        if roof.get("fraction") is not None:
            parts.append(f"Its decode streams {roof['achieved_gbs']:.2f} GB/s of the {roof['limit_gbs']:.2f} GB/s the nodes it uses "
                         f"sustain: **{roof['fraction'] * 100:.0f}% of the memory-bandwidth limit**"
                         + ("" if roof.get("kv_counted") else " (weights only: the KV cache size per token is unknown)")
                         + ". " + _headroom(roof["fraction"]))
        parts.append("")
    if eager:
        parts += ["## Start time against speed: --enforce-eager", "",
                  "The objective ranks by what a candidate serves once ready; what a start costs — each restart, "
                  "reload and added instance, torch.compile's warm-up included — is its own column (`start`: spawn to "
                  "ready of the slowest instance; `compile`: the part of it vLLM spent compiling).", "",
                  *[f"- {line}" for line in eager], ""]
    if chart_name:
        parts += [f"![throughput against time to first token]({chart_name})", ""]
    parts += ["## Ranking", "", markdown_table(table_rows), "", "## Every load level", "", levels_table(result), ""]
    return "\n".join(parts)


def _headroom(fraction: float) -> str:
    if fraction >= 0.7:
        return "Close to the limit: another layout cannot gain much; a smaller dtype or model can."
    if fraction >= 0.4:
        return "Some room left: larger batches (more concurrency, --max-num-seqs) may still pay."
    return "Far from the limit: compute, scheduling or the load (too few requests in flight) bound it, not memory."


def outcome_figures(outcome: Outcome) -> list[str]:
    lv = outcome.levels
    roof = (outcome.extra.get("roofline") or {}).get("fraction")
    out = [f"{_geomean([x.output_throughput for x in lv]):.1f} output tokens/s (geometric mean over {', '.join(x.level for x in lv)})",
           f"TTFT p50 {format_seconds(_geomean([x.get('ttft', 'p50') for x in lv]))}, p99 {format_seconds(max(x.get('ttft', 'p99') for x in lv))}; "
           f"ITL p99 {format_seconds(max(x.get('itl', 'p99') for x in lv))}"]
    if roof is not None:
        out.append(f"{roof * 100:.0f}% of the measured memory-bandwidth limit")
    start = outcome.extra.get("start")
    if start:
        out.append(f"start to ready: {start_text(start)}")
    return out
