"""Write the measured figures of README.md and docs/*.md from the benches' result files.

Every bench in bench/ writes docs/bench/<name>.json (bench/result.py: command line, date, commit,
the machine's CPUs and load average, the figures). The markdown quotes them only between markers

    <!-- BEGIN published:NAME (scripts/published_numbers.py writes it from docs/bench/FILE) -->
    ...
    <!-- END published:NAME -->

and this script rewrites what is between them from the JSON. Run it after a bench:

    .venv/bin/python scripts/published_numbers.py           # rewrite the blocks
    .venv/bin/python scripts/published_numbers.py --check   # exit 1 when a block is out of date

tests/test_published_numbers.py fails until the blocks match the files.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vsup.proxy.batch_share import lines_beside

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "docs" / "bench"
# A block may be indented (inside a list item): its lines get the BEGIN marker's indentation.
BLOCK = re.compile(r"^(?P<indent>[ \t]*)(?P<begin><!-- BEGIN published:(?P<name>[\w-]+) [^\n]*-->\n)(?P<body>.*?)"
                   r"^(?P=indent)(?P<end><!-- END published:(?P=name) -->)", re.S | re.M)


def load(file: str) -> dict[str, Any]:
    return json.loads((BENCH_DIR / file).read_text())


def conditions(data: dict[str, Any], link: str = "docs/bench") -> str:
    """Where, when and under what load: every block says it, with the command that repeats it."""
    m = data["machine"]
    start, end = m["load_average_start"][0], m["load_average_end"][0]
    busy = "loaded" if max(start, end) >= 0.5 * m["cpus"] else "quiet"
    return (f"Measured {data['date'][:10]} on a {busy} {m['cpus']}-CPU machine ({m['cpu_model']}; load average "
            f"{start:.1f} at the start, {end:.1f} at the end{': other work shared the CPUs' if busy == 'loaded' else ''}), "
            f"commit {data['commit']}; "
            f"`{data['command']}` repeats it ([{Path(data['_file']).name}]({link}/{Path(data['_file']).name})).")


def with_file(file: str) -> dict[str, Any]:
    data = load(file)
    data["_file"] = file
    return data


def fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def than(mine: float, other: float, less: str, more: str) -> str:
    """`mine` against `other` as a factor ≥ 1 with its direction: "3.2× shorter", "1.4× longer"."""
    return f"{other / mine:.1f}× {less}" if mine <= other else f"{mine / other:.1f}× {more}"


# ---- bench/vllm_bench.py --------------------------------------------------------------------------

def vllm_layouts(link: str) -> str:
    data = with_file("vllm_bench.json")
    f, s = data["figures"], data["figures"]["settings"]
    lay = f["layouts"]
    base = lay.get("b")
    lines = [conditions(data, link), "",
             f"{s['streams']} concurrent streams × {s['max_tokens']} tokens, random-weight Llama (hidden {s['hidden']}, "
             f"{s['layers']} layers, fp32), {s['duration_s']:g} s per layout, {s['rounds']} round(s):", "",
             "| layout | tok/s | vs (b) | TTFT p50 | TTFT p90 | requests | errors |", "|---|---|---|---|---|---|---|"]
    for key, row in lay.items():
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base and base["tokens_per_s"] else "–"
        lines.append(f"| ({key}) {row['name']} | {row['tokens_per_s']:.1f} | {ratio} | {fmt_s(row['ttft_p50_s'])} | "
                     f"{fmt_s(row['ttft_p90_s'])} | {row['requests']} | {row['errors']} |")
    waves = min(row["requests"] for row in lay.values()) / (s["streams"] * s["rounds"])
    if waves < 3:
        lines += ["", f"**Few requests per layout** (the fewest: {waves:.1f}× the {s['streams']} streams): each layout saw "
                  "the machine under a different load, so these ratios show the load at least as much as the layout."]
    if {"a", "b", "c"} <= set(lay):
        a, b, c = lay["a"], lay["b"], lay["c"]
        lines += ["", f"In this run the pinned instances (a) had {a['tokens_per_s'] / b['tokens_per_s']:.2f}× the throughput of "
                  f"vLLM's default layout for two instances (b) and a "
                  f"{than(a['ttft_p50_s'], b['ttft_p50_s'], 'shorter', 'longer')} median time to first token; one big "
                  f"instance (c) had {c['tokens_per_s'] / a['tokens_per_s']:.2f}× the throughput of (a) with a "
                  f"{than(c['ttft_p50_s'], a['ttft_p50_s'], 'shorter', 'longer')} median time to first token."]
    return "\n".join(lines)


def vllm_runs(link: str) -> str:
    data = with_file("vllm_bench.json")
    runs = data["figures"]["runs"]
    lines = [conditions(data, link), "",
             "| layout | round | Worker CPUs | tok/s | TTFT p50 | TTFT p90 | requests | errors | start-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| ({r['layout']}) {r['name']} | {r['round']} | {' / '.join(r['worker_cpus']) or '?'} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p90_s'] * 1000:.0f} ms | "
                     f"{r['requests']} | {r['errors']} | {r['startup_s']:.0f} s |")
    return "\n".join(lines)


def layout_sentence(link: str) -> str:
    data = with_file("vllm_bench.json")
    lay = data["figures"]["layouts"]
    a, c = lay["a"], lay["c"]
    more = c["tokens_per_s"] / a["tokens_per_s"] - 1
    numbers = "measured.md" if link == "bench" else "docs/measured.md"  # from docs/, or from the top
    return (f"On this project's 2-core machine, loaded by other work, in one run of `bench/vllm_bench.py` "
            f"([numbers]({numbers})), one instance on both cores gave {abs(more) * 100:.1f} % "
            f"{'more' if more >= 0 else 'fewer'} tokens/s than two pinned instances of one core, which answered the "
            f"first token {than(a['ttft_p50_s'], c['ttft_p50_s'], 'sooner', 'later')} (median).")


# ---- bench/proxy_bench.py -------------------------------------------------------------------------

UNIX_ROW = "vsup proxy, unix"  # bench/proxy_bench.py's row of this tree over Unix sockets


def _row(data: dict[str, Any], target: str) -> dict[str, Any]:
    return next(r for r in data["figures"]["summary"] if r["target"] == target)


def proxy_readme(link: str) -> str:
    pinned, floating = with_file("proxy_bench-pin.json"), with_file("proxy_bench.json")
    lines = [conditions(pinned, link), conditions(floating, link), "",
             "| target | req/s | added p50 | CPU µs / request | CPU µs / chunk |", "|---|---|---|---|---|"]
    rows = []
    for data, label in ((pinned, "pinned"), (floating, "not pinned")):
        for r in data["figures"]["summary"][1:]:
            rows.append((label, r))
    for label, r in rows:
        if "us_per_request" in r:  # the direct row has no proxy CPU
            lines.append(f"| {r['target']}, {label} | {r['rps']:.0f} | {r['added_p50_ms']:.2f} ms | {r['us_per_request']:.0f} | "
                         f"{r['us_per_chunk']:.1f} |")
    p = _row(pinned, "vsup proxy")
    floors = [("≤ 150 µs CPU per request", p["us_per_request"] <= 150), ("≤ 15 µs per chunk", p["us_per_chunk"] <= 15),
              ("added p50 ≤ 1 ms", p["added_p50_ms"] <= 1.0)]
    met = [what for what, ok in floors if ok]
    missed = [what for what, ok in floors if not ok]
    lines += ["", "Floors from the issue, for the proxy on its own core in this run: "
              + (f"met: {', '.join(met)}" if met else "none met")
              + (f"; missed: {', '.join(missed)}." if missed else ".")]
    if not pinned["figures"]["settings"]["nginx"]:
        lines.append("nginx was not installed on the machine: no nginx rows.")
    return "\n".join(lines)


def front_door(link: str) -> str:
    """Issue 20's bounds, from one pinned run: this tree against main before the issue (the
    baseline, at most 10 % more CPU per small request and per streamed request) and against the
    Rust vllm-router (a streamed request at most its CPU), all measured in turn; with the
    transport each proxy uses to reach the upstreams."""
    data = with_file("proxy_bench-pin.json")
    f, s = data["figures"], data["figures"]["settings"]
    rows = {r["target"]: r for r in f["summary"]}
    shown = []
    if UNIX_ROW in rows:
        shown.append(("vsup (this tree), as `vsup run` ships (vllm.listen: unix)", "Unix sockets", rows[UNIX_ROW]))
    shown.append(("vsup (this tree), `vsup proxy --upstream http://…`", "TCP loopback", rows["vsup proxy"]))
    if "vsup (baseline)" in rows:
        shown.append((f"vsup at {s['baseline']} (baseline, before Unix sockets)", "TCP loopback", rows["vsup (baseline)"]))
    for name in ("vllm-router", "nginx"):
        if name in rows:
            label = f"vllm-router ({s['vllm_router']}; speaks TCP only)" if name == "vllm-router" else name
            shown.append((label, "TCP loopback", rows[name]))
    lines = [conditions(data, link), "",
             f"Concurrency {s['concurrency']}, {s['upstreams']} upstreams; each proxy pinned to one CPU, the client and the "
             f"upstreams to the other (the box's other processes are not pinned); streams of {s['chunks'] + 1} events (an event every {s['pace'] * 1e3:g} ms); "
             f"medians of {s['runs']} runs, the proxies measured in turn in every run. The client reaches every proxy over "
             "TCP; the column says how each proxy reaches the same upstream processes.", "",
             "| proxy | to the upstreams | CPU µs / small request | CPU µs / streamed request | CPU µs / chunk |",
             "|---|---|---|---|---|"]
    for name, transport, r in shown:
        lines.append(f"| {name} | {transport} | {r['us_per_request']:.0f} | {r['us_per_stream']:.0f} | {r['us_per_chunk']:.1f} |")
    verdicts = []
    ratios = f["ratios"]
    if "this tree / baseline" in ratios:
        q = ratios["this tree / baseline"]
        req, stream = q["us_per_request"]["median"], q["us_per_stream"]["median"]
        verdicts.append(f"this tree / baseline, both over TCP: {req:.2f} per small request, {stream:.2f} per streamed request "
                        f"(bound ≤ 1.10: {'met' if max(req, stream) <= 1.10 else 'missed'})")
    for key, what in (("unix / vllm-router", "this tree over Unix sockets / vllm-router over TCP, each as it ships"),
                      ("this tree / vllm-router", "this tree / vllm-router, both over TCP")):
        if key in ratios:
            q = ratios[key]
            stream = q["us_per_stream"]["median"]
            runs = q["us_per_stream"]["runs"]
            verdicts.append(f"{what}: {q['us_per_request']['median']:.2f} per small request, {stream:.2f} "
                            f"per streamed request (runs {min(runs):.2f}–{max(runs):.2f}; bound ≤ 1.00: "
                            f"{'met' if stream <= 1.0 else 'missed'})")
    if "unix / tcp" in ratios:
        q = ratios["unix / tcp"]
        verdicts.append(f"this tree over Unix sockets / over TCP: {q['us_per_request']['median']:.2f} per small request, "
                        f"{q['us_per_stream']['median']:.2f} per streamed request")
    if verdicts:
        lines += ["", "Medians of the per-run ratios: " + "; ".join(verdicts) + "."]
    if not s["nginx"]:
        lines.append("nginx was not installed on the machine: no nginx row.")
    return "\n".join(lines)


def proxy_tables(link: str) -> str:
    out = []
    for file, title in (("proxy_bench.json", "Not pinned"), ("proxy_bench-pin.json", "`--pin` (proxy on the first CPU, client + upstreams on the others)")):
        data = with_file(file)
        out += [f"{title}. {conditions(data, link)}", "",
                "| target | req/s | p50 ms | p99 ms | added p50 | added p99 | CPU µs / request (user+sys) | CPU µs / chunk (user+sys) |",
                "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(data["figures"]["summary"]):
            added = ("– | –" if i == 0 else f"{r['added_p50_ms']:.2f} ms | {r['added_p99_ms']:.2f} ms")
            cpu = ("– | –" if "us_per_request" not in r else
                   f"{r['us_per_request']:.0f} ({r['us_per_request_user']:.0f}+{r['us_per_request_sys']:.0f}) | "
                   f"{r['us_per_chunk']:.1f} ({r['us_per_chunk_user']:.1f}+{r['us_per_chunk_sys']:.1f})")
            out.append(f"| {r['target']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added} | {cpu} |")
        out.append("")
    return "\n".join(out).rstrip()


def scrape(link: str) -> str:
    data = with_file("proxy_bench-pin-scrape.json")
    rows = data["figures"]["summary"]
    off = next(r for r in rows if r["target"] == "proxy, no scrape")
    on = next(r for r in rows if r["target"].startswith("proxy, scrape"))
    interval = data["figures"]["settings"]["scrape"]
    return "\n".join([
        conditions(data, link), "",
        "| proxy process | req/s | added p50 | CPU µs / request | CPU µs / chunk |", "|---|---|---|---|---|",
        f"| no collection | {off['rps']:.0f} | {off['added_p50_ms']:.2f} ms | {off['us_per_request']:.0f} | {off['us_per_chunk']:.1f} |",
        f"| collection every {interval:g} s, `/metrics` scraped every {interval:g} s | {on['rps']:.0f} | "
        f"{on['added_p50_ms']:.2f} ms | {on['us_per_request']:.0f} | {on['us_per_chunk']:.1f} |",
        "",
        f"Collection over none, in the same run: {on['us_per_request'] / off['us_per_request']:.2f}× the CPU per request, "
        f"{on['us_per_chunk'] / off['us_per_chunk']:.2f}× per chunk.",
    ])


def policy_cost(link: str) -> str:
    data = with_file("proxy_bench-pin-policy.json")
    f = data["figures"]
    rr = _row(data, "vsup round_robin")
    parts = []
    for policy in f["settings"]["policies"]:
        if policy == "round_robin":
            continue
        row = _row(data, f"vsup {policy}")
        ratios = f["ratios"][f"vsup {policy} / vsup round_robin"]
        runs = ratios["us_per_request"]["runs"]
        parts.append(f"{policy} {row['us_per_request']:.0f} µs, {ratios['us_per_request']['median']:.2f}× round_robin's (median "
                     f"of the per-run ratios {min(runs):.2f}–{max(runs):.2f}; per chunk {ratios['us_per_chunk']['median']:.2f}×)")
    return (f"{conditions(data, link)} Every request carries a {f['settings']['system_chars']:,}-character system prompt "
            f"(prefix_affinity's longest key): round_robin {rr['us_per_request']:.0f} µs CPU per request; "
            + "; ".join(parts) + " (a policy runs once per request, not per chunk).")


# ---- bench/fleet_bench.py -------------------------------------------------------------------------

def fleet(link: str) -> str:
    """Issue 21's bound: two models behind the proxy cost it at most `goal` × one model's CPU per
    request; the rows side by side, then the medians of the per-run ratios against that bound."""
    data = with_file("fleet_bench.json")
    f = data["figures"]
    where = f"the proxy pinned to CPU {f['proxy_cpus']}, the client and the fakes on the others" if f["pin"] else "nothing pinned"
    lines = [conditions(data, link), "",
             f"Fake vLLM processes; {f['requests']:,} small requests (a chat completion and an embedding in turn) and "
             f"{f['streams']} streams of {f['chunks']} tokens per row and run, concurrency {f['concurrency']}, {where}; "
             f"medians of {f['runs']} runs, the rows measured in turn in every run.", "",
             "| the proxy in front of | req/s | CPU µs / small request | CPU µs / streamed request |", "|---|---|---|---|"]
    labels = {"one model": "one model, two instances (no routing by model)",
              "one model, routed": "a fleet of one model, two instances (routing by model on)",
              "two models": "two models, an instance each (chat, embed)"}
    for row, r in f["rows"].items():
        lines.append(f"| {labels.get(row, row)} | {r['rps']:.0f} | {r['us_per_request']:.0f} | {r['us_per_stream']:.0f} |")
    q = f["ratios"]
    if "two models / one model, us_per_request" in q:
        req, stream = q["two models / one model, us_per_request"], q["two models / one model, us_per_stream"]
        lines += ["", f"Medians of the per-run ratios: two models / one model {req:.2f} per small request, {stream:.2f} per "
                  f"streamed request (bound ≤ {f['goal']:.2f}: {'met' if f['within_goal'] else 'missed'})"
                  + (f"; a fleet of one / one model {q['one model, routed / one model, us_per_request']:.2f} and "
                     f"{q['one model, routed / one model, us_per_stream']:.2f}" if "one model, routed / one model, us_per_request" in q else "")
                  + "."]
    if f["skipped"]:
        lines += ["", f["skipped"]]
    return "\n".join(lines)


# ---- bench/affinity_bench.py ----------------------------------------------------------------------

def affinity_fake(link: str) -> str:
    return affinity(link, "affinity_bench-fake.json")


def affinity_fake_hot(link: str) -> str:
    return affinity(link, "affinity_bench-fake-hot.json")


def affinity_line(link: str) -> str:
    """The README's sentence: the default prefix_affinity against round robin on real vLLM."""
    data = with_file("affinity_bench.json")
    f = data["figures"]
    st = f["settings"]
    q = {(r["workload"], r["what"].split()[1] if "TTFT" in r["what"] else "tok/s"): r
         for r in f["ratios"] if r["policy"] == "prefix_affinity"}
    met = all(r.get("met") for r in q.values())
    return (f"prefix_affinity at its defaults against round robin, real vLLM, {st['instances']} instances, "
            f"{st['sessions']} sessions each with a prefix of ≥ {st['prefix_tokens_min']:,} tokens: TTFT p50 "
            f"{q[('shared', 'p50')]['value']:.2f}× lower, p90 {q[('shared', 'p90')]['value']:.2f}× round robin's; "
            f"{st['few_sessions']} sessions that hashing would split 3 : 1: {q[('few', 'p50')]['value']:.2f}× lower, p90 "
            f"{q[('few', 'p90')]['value']:.2f}×; prompts that share nothing: {q[('distinct', 'tok/s')]['value']:.2f}× "
            f"its tok/s (bar: ≥ 3× lower p50, p90 ≤ 1×, ≥ 0.95× tok/s; {'met' if met else 'not met'}). {conditions(data, link)}")


def affinity(link: str, name: str = "affinity_bench.json") -> str:
    data = with_file(name)
    f, s = data["figures"], data["figures"]["settings"]
    lines = [conditions(data, link), "",
             f"{s['instances']} instances (KV cache {' / '.join(s['kv_cache'])}); {s['api']} API; shared: {s['sessions']} sessions × "
             f"{s['questions']} questions, prefixes ≥ {s['prefix_tokens_min']:,} tokens, interleaved; "
             + (f"few: {s['few_sessions']} sessions, as many requests, split 3 : 1 by hashing; " if "few_sessions" in s else "")
             + "distinct: "
             f"{s['sessions'] * s['questions']} prompts of {s['distinct_tokens']} tokens; {s['max_tokens']} tokens per answer; "
             f"concurrency {s['concurrency']}; {s['rounds']} round(s)"
             + (f"; prefix_affinity with its proxy.affinity_load_factor ε = {s['affinity_load_factor']:g}, prefix_affinity@E "
                f"with ε = E" if "affinity_load_factor" in s else "") + ".", "",
             "| workload | policy | TTFT p50 | TTFT p90 | output tok/s | prefix-cache hit rate | per instance: requests, hit rate | the proxy's decisions |",
             "|---|---|---|---|---|---|---|---|"]

    def pct(rate: float | None) -> str:
        return "n/a" if rate is None else f"{rate * 100:.0f} %"

    for r in f["rows"]:
        per = ", ".join(f"{name} {i['requests']} / {pct(i['hit_rate'])}" for name, i in r["instances"].items())
        lines.append(f"| {r['workload']} | {r['policy']} | {fmt_s(r['ttft_p50_s'])} | {fmt_s(r['ttft_p90_s'])} | "
                     f"{r['tokens_per_s']:.1f} | {pct(r['hit_rate'])} | {per} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(r.get('decisions', {}).items())) or '-'} |")
    if isinstance(f.get("ratios"), list):  # issue 22: each policy against round_robin
        lines += ["", "Issue 22's bar, each policy against round_robin in this run (**bold**: met):", "",
                  "| policy | shared: TTFT p50 round_robin / policy (≥ 3) | shared: TTFT p90 policy / round_robin (≤ 1) | "
                  "few: TTFT p50 (≥ 3) | few: TTFT p90 (≤ 1) | distinct: output tok/s policy / round_robin (≥ 0.95) | all met |",
                  "|---|---|---|---|---|---|---|"]
        order = [("shared", "TTFT p50"), ("shared", "TTFT p90"), ("few", "TTFT p50"), ("few", "TTFT p90"), ("distinct", "tok/s")]
        for policy in dict.fromkeys(q["policy"] for q in f["ratios"]):
            mine = {(q["workload"], next(w for _, w in order if w in q["what"])): q for q in f["ratios"] if q["policy"] == policy}
            cells, met_all = [], True
            for spot in order:
                q = mine.get(spot)
                if q is None or q["value"] is None:
                    cells.append("n/a")
                    met_all = False
                    continue
                direction, bar = q["bar"].split()
                met = q["met"] if q.get("met") is not None else (q["value"] >= float(bar) if direction == ">=" else q["value"] <= float(bar))
                met_all = met_all and met
                cells.append(f"**{q['value']:.2f}**" if met else f"{q['value']:.2f}")
            lines.append(f"| {policy} | {' | '.join(cells)} | {'yes' if met_all else 'no'} |")
    elif "ratios" in f:
        q = f["ratios"]
        lines += ["", f"Ratios of this run: shared, TTFT p50 round_robin / prefix_affinity "
                  f"**{q['shared_ttft_p50_rr_over_pa']:.2f}** (bar ≥ 1.5), output tok/s prefix_affinity / round_robin "
                  f"{q['shared_tokens_per_s_pa_over_rr']:.2f} (bar ≥ 1.0); distinct, output tok/s prefix_affinity / "
                  f"round_robin {q['distinct_tokens_per_s_pa_over_rr']:.2f} (bar ≥ 0.95)."]
    return "\n".join(lines)


def load_probe(link: str) -> str:
    data = with_file("load_probe_bench.json")
    f = data["figures"]
    return (f"{conditions(data, link)} One sample of a {f['body_bytes'] / 1024:.0f} KiB vLLM-shaped /metrics costs the proxy "
            f"{f['proxy_cpu_ms_per_sample']:.2f} ms CPU (the GET and the byte scan; the scan alone {f['scan_ms']:.2f} ms, where a "
            f"Prometheus parse of the same text, the collector's, takes {f['prometheus_parse_ms']:.1f} ms) and the instance "
            f"{f['instance_cpu_ms_per_sample']:.1f} ms CPU to render it: at proxy.load_interval 1 s, "
            f"{f['proxy_cpu_percent_per_instance_at_1s']:.2f} % of one core in the proxy per instance and "
            f"{f['instance_cpu_percent_at_1s']:.2f} % in each instance's API server.")


# ---- the others ---------------------------------------------------------------------------------

def plan(link: str) -> str:
    data = with_file("plan_bench.json")
    f = data["figures"]
    counts = [r["planned"] for r in f["rows"]]
    ratios = [r["ratio"] for r in f["rows"]]
    return (f"A generated {f['machine_planned']['cpus']}-CPU, {f['machine_planned']['nodes']}-node, SMT2 machine plans in "
            f"{f['fastest_ms']:.1f}–{f['slowest_ms']:.1f} ms for {min(counts)} to {max(counts)} instances (target ≤ "
            f"{f['target_ms']:.0f} ms), {min(ratios):.0f}–{max(ratios):.0f}× a naive round-robin split of the same "
            f"cores. {conditions(data, link)}")


def warmup(link: str) -> str:
    data = with_file("warmup_bench.json")
    f, s = data["figures"], data["figures"]["settings"]

    def median(values: list[float]) -> float:
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    by = {mode: [r for r in f["runs"] if r["warmup"] == mode] for mode in ("on", "off")}
    first = {m: median([r["first_ttft_s"] for r in rs]) for m, rs in by.items()}
    steady = {m: median([r["steady_ttft_s"] for r in rs]) for m, rs in by.items()}
    restart = {m: median([r["restart_s"] for r in rs if r["restart_s"] is not None]) for m, rs in by.items()}
    return (f"Measured with real vLLM CPU, the bench model with `--enforce-eager`, {s['max_tokens']}-token streams, "
            f"{s['restarts']} (re)starts per mode: the first request after a (re)start had a median TTFT of "
            f"{first['off'] * 1000:.0f} ms with the warm-up off and {first['on'] * 1000:.0f} ms with it on, against "
            f"{steady['off'] * 1000:.0f} / {steady['on'] * 1000:.0f} ms steady (first / steady: "
            f"{first['off'] / steady['off']:.2f}× off, {first['on'] / steady['on']:.2f}× on); `vsup restart` took "
            f"{restart['off']:.1f} s off, {restart['on']:.1f} s on. {cold_start(first['off'] / steady['off'])} "
            f"{conditions(data, link)}")


def cold_start(first_over_steady: float) -> str:
    """What the warm-up-off ratio says; within 25 % of steady is inside this loaded box's noise."""
    if first_over_steady <= 1.25:
        return "**With the warm-up off this eager-mode model showed no cold start in this run** (first within 25 % of steady)."
    return f"With the warm-up off the first request paid {first_over_steady:.1f}× the steady TTFT."



def systemd(link: str) -> str:
    data = with_file("systemd_security.json")
    f = data["figures"]
    return (f"The generated unit's hardening is rated {f['exposure']} by `systemd-analyze security --offline=true` "
            f"({f['systemd']}; `bench/systemd_security.py` measures it into "
            f"[systemd_security.json]({link}/systemd_security.json), `tests/test_systemd.py` checks the unit still rates "
            f"the same), with `/dev/shm` and the NUMA syscalls left usable.")


def soak(link: str) -> str:
    data = with_file("soak.json")
    f = data["figures"]
    r, v = f["requests"], f["vsup"]
    told = ", ".join(f"{n} {why}" for why, n in sorted(r["told_by"].items())) or "none"
    rows = "\n".join(f"| {what} | {v[key]['start']:.{p}f}{unit} | {v[key]['end']:.{p}f}{unit} | {v[key]['max']:.{p}f}{unit} |"
                     for what, key, unit, p in (("RSS", "rss_mib", " MiB", 1), ("open file descriptors", "fds", "", 0),
                                                ("threads", "threads", "", 0)) if key in v)
    left = "nothing" if not f["left_behind"] else "; ".join(f["left_behind"])
    return (f"{f['duration_s'] / 60:.0f} minutes of `vsup run` over fake vLLM instances (real processes, real ports), "
            f"a `kill -9` of an instance's API server {f['kills']} times:\n\n"
            f"| vsup's own | start | end | max |\n|---|---|---|---|\n{rows}\n\n"
            f"{r['ok']:,} requests answered, {r['told']} told ({told}), **{r['lost']} lost**; RSS "
            f"{f['rss_mib_after_10_min']:.2f} MiB after 10 minutes and {f['rss_mib_end']:.2f} MiB at the end "
            f"({f['rss_mib_end'] - f['rss_mib_after_10_min']:+.2f} MiB); left behind after SIGTERM: {left}. "
            f"{conditions(data, link)}")


def metrics_cap(link: str) -> str:
    data = with_file("metrics_cap_bench.json")
    f = data["figures"]
    rows = "\n".join(f"| {r['setting']} ({r['max_series_per_instance']:,}) | {r['series_kept']:,} | {r['rss_before_mib']:.0f} MiB | "
                     f"{r['rss_peak_mib']:.0f} MiB | {fmt_s(r['round_s'])} |" for r in f["rows"])
    return (f"One instance serving {f['series']:,} series ({f['body_bytes'] / 2**20:.1f} MiB of text), one collection round in a "
            f"fresh process:\n\n| metrics.max_series_per_instance | series kept | RSS before | peak RSS | round |\n"
            f"|---|---|---|---|---|\n{rows}\n\n{conditions(data, link)}")


def flood(link: str) -> str:
    data = with_file("flood_bench.json")
    f = data["figures"]
    runs = [("this vsup", f["this"])] + ([(f"before: {f.get('baseline_label', 'baseline')}", f["baseline"])] if "baseline" in f else [])
    h = runs[0][1]["header_flood"]

    def trickled(seconds: float | None, cap: float) -> str:
        return f"open at {cap:g} s" if seconds is None else f"closed after {seconds:g} s"

    rows = [
        ("vsup's RSS before", lambda r: f"{r['header_flood']['rss_mib_before']:.0f} MiB"),
        (f"… peak, {h['connections']} clients × {h['header_kib_each']} KiB of header lines never ended",
         lambda r: f"{r['header_flood']['rss_mib_peak']:.0f} MiB (+{r['header_flood']['rss_mib_rise_peak']:.0f})"),
        ("… while they stay connected", lambda r: f"{r['header_flood']['rss_mib_while_held']:.0f} MiB"),
        ("… after they closed", lambda r: f"{r['header_flood']['rss_mib_after_close']:.0f} MiB"),
        ("those clients answered 431", lambda r: f"{r['header_flood']['answered_431']} of {r['header_flood']['connections']}"),
        (f"`GET /health` answered 200 while {runs[0][1]['idle_flood']['idle_connections']} idle connections are open",
         lambda r: f"{r['idle_flood']['health_200']} of {r['idle_flood']['health_polls']}"),
        (f"headers trickled, a line every {runs[0][1]['trickle']['every_s']:g} s",
         lambda r: trickled(r["trickle"]["headers_closed_after_s"], r["trickle"]["cap_s"])),
        (f"a body trickled, a byte every {runs[0][1]['trickle']['every_s']:g} s",
         lambda r: trickled(r["trickle"]["body_closed_after_s"], r["trickle"]["cap_s"])),
    ]
    # issue 29's cases (bench/flood_bench.py's bodies and json), where every run in the file has them
    if all("bodies" in r and "chunked_413" in r for _, r in runs):
        b = runs[0][1]["bodies"]

        def answers(r: dict) -> str:
            got = r["bodies"]["answers"]
            return ", ".join(f"{n} {'unanswered' if status == 'none' else status}" for status, n in got.items())

        def chunked(r: dict) -> str:
            c = r["chunked_413"]
            more = c["bytes_sent_after_answer"]
            if more is None:
                return f"{c['status']}, {c['ended']}"
            if c["ended"] == "read on":  # the bench stopped sending at its cap
                return f"{c['status']}, then still read: {more / 2**20:.0f} MiB more"
            return f"{c['status']}, then {c['ended']} ({more / 2**20:.1f} MiB more sent)"

        rows += [
            (f"{b['connections']} clients each send a body of {b['declared_bytes'] / 2**20:g} MiB but its last byte "
             f"(proxy.body_timeout {b['proxy_settings']['body_timeout']:g} s): peak RSS",
             lambda r: f"{r['bodies']['rss_mib_peak']:.0f} MiB (+{r['bodies']['rss_mib_rise_peak']:.0f})"),
            ("… after they closed", lambda r: f"{r['bodies']['rss_mib_after_close']:.0f} MiB"),
            ("… their answers", answers),
            ("a chunked upload past proxy.max_body_bytes", chunked),
        ]
    if all("json" in r for _, r in runs):
        j = runs[0][1]["json"]
        rows += [
            (f"`GET /health` p99 / max while one client posts {j['json_mib']:g} MiB JSON {j.get('json_shape', 'array')}s "
             "back to back", lambda r: f"{r['json']['loaded']['health']['p99_ms']:.0f} / {r['json']['loaded']['health']['max_ms']:.0f} ms"),
            ("… another client's small request p95, loaded / unloaded",
             lambda r: f"{r['json']['loaded']['small']['p95_ms']:.0f} / {r['json']['unloaded']['small']['p95_ms']:.0f} ms"),
        ]
    head = "| `bench/flood_bench.py`, default settings | " + " | ".join(name for name, _ in runs) + " |"
    table = "\n".join([head, "|---" * (len(runs) + 1) + "|"]
                      + [f"| {what} | " + " | ".join(cell(r) for _, r in runs) + " |" for what, cell in rows])
    this = runs[0][1]
    bars = [f"{case}: {'met' if this[case]['met'] else 'missed'} ({this[case]['bar']})"
            for case in ("bodies", "chunked_413", "json") if case in this]
    verdicts = f"\n\nIssue 29's bars, {runs[0][0]}: " + "; ".join(bars) + "." if bars else ""
    return f"{table}{verdicts}\n\n{conditions(data, link)}"


def priority(link: str, file: str = "priority_bench.json") -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.0f} ms" if seconds < 1 else fmt_s(seconds)

    data = with_file(file)
    f = data["figures"]
    sc, ratio, st = f["scenarios"], f["ttft_p50_ratio_to_unloaded"], f["settings"]
    names = {"unloaded": "unloaded (the chat alone)", "none": "batch, no admission",
             "priority": f"batch, priority admission (reserved_slots {st['reserved']})",
             "priority_no_reserve": "batch, priority admission (reserved_slots 0)"}
    rows = "\n".join(
        f"| {names[name]} | {ms(r['ttft_p50_s'])} | {ms(r['ttft_p90_s'])} | "
        f"{'-' if name == 'unloaded' else format(ratio[name], '.2f') + 'x'} | {r['batch_completions_per_s']:.2f} | "
        f"{r['batch_tokens_per_s']:.0f} |" for name, r in sc.items())
    backend = (f"{st['instances']} fake vLLM instances (tests/fakevllm: its batched engine model)" if f["backend"] == "fake"
               else f"{st['instances']} real vLLM CPU instances of {st['model']}")
    goal = f["goal"]
    return (f"{backend}, --max-num-seqs {st['max_num_seqs']}; one "
            f"interactive chat client ({st['chat_tokens']} tokens, streamed) behind {st['batch']} batch clients "
            f"(summarization: {st['batch_words']}-word prompts, {st['batch_tokens']} tokens), {st['duration']:g} s per row:\n\n"
            "| scenario | chat TTFT p50 | p90 | p50 / unloaded | batch done/s | batch tok/s |\n|---|---|---|---|---|---|\n"
            f"{rows}\n\nGoal (priority's p50 at most {goal['priority_ttft_p50_ratio_at_most']:g}x unloaded, the batch still "
            f"progressing): {'met' if goal['met'] else 'not met'}. {conditions(data, link)}")


# ---- bench/batch_bench.py -------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else fmt_s(seconds)


def _per_s(rate: float) -> str:
    """Lines a second: three figures at least (a real-size model runs about one a second)."""
    return f"{rate:.2f}" if rate < 10 else f"{rate:.1f}"


def _batch_backend(f: dict[str, Any]) -> str:
    st = f["settings"]
    kind = "fake vLLM" if f["backend"] == "fake" else "real vLLM CPU"
    seqs = f"--max-num-seqs {st['max_num_seqs']}"
    if st.get("slots_per_instance"):
        seqs += f", batch.slots_per_instance {st['slots_per_instance']}"
    if st.get("vllm_priority") is not None:
        seqs += f", vLLM's priority scheduler with the lines at priority {st['vllm_priority']}"
    if st.get("quiet_after") is not None:
        seqs += f", batch.quiet_after {st['quiet_after']:g} s"
    if st.get("beside_interactive") is not None:
        seqs += f", batch.beside_interactive {st['beside_interactive']:g}"
    model = ("the real-shape random Llama (1.3 B parameters)" if "real-shape" in str(st.get("model_dir"))
             else "the tiny random Llama")
    if st["endpoint"] == "/v1/embeddings":
        return (f"one `vsup run`: {st['chat_instances']} {kind} chat instance(s) of {model} and {st['instances']} "
                f"embedding instance(s) of the same weights, {seqs}; embeddings batches of "
                f"{st['lines']:,} lines ({st['prompt_words']}-word inputs)")
    return (f"one `vsup run` of {st['instances']} {kind} instances of {model}, {seqs}; "
            f"chat batches of {st['lines']:,} lines ({st['prompt_words']}-word prompts, {st['batch_tokens']} tokens each)")


def _against(value: float, bar: float, at_least: bool) -> str:
    """A ratio to two decimals, or three where two would round a miss onto the bar (0.896 is not 0.90)."""
    shown = f"{value:.2f}"
    missed = value < bar if at_least else value > bar
    return f"{value:.3f}" if missed and float(shown) == bar else shown


def batch_line(link: str, file: str = "batch_bench.json") -> str:
    """One sentence: the issue's three bars from one run of bench/batch_bench.py."""
    data = with_file(file)
    f = data["figures"]
    r, k = f["ratios"], f.get("kill")
    kill = (f"; vsup killed with -9 at {k['lines_done_at_kill']:,} of {k['lines']:,} lines and started again: "
            f"{k['output_results']:,} results for {k['custom_ids']:,} custom_ids, {k['duplicates']} twice, {k['missing']} missing"
            if k else "")
    turns = f" (medians of {len(f['turns'])} turns)" if f.get("turns") else ""
    again = " measured again right after the batch" if "again" in f else ""
    return (f"{_batch_backend(f)}{turns}: a chat's TTFT p50 beside a batch {_against(r['ttft_p50_beside_over_alone'], 1.5, False)}× "
            f"its p50 alone (bar ≤ 1.5), a batch alone {_against(r['batch_over_best_loop'], 0.9, True)}× the lines/s of the best "
            f"client loop{again} (bar ≥ 0.9){kill}; "
            f"{'every bar met' if f['met'] else 'not every bar met'}. {conditions(data, link)}")


BESIDE_FILES = "batch_bench-beside-*.json"


def batch_beside(link: str) -> str:
    """bench/batch_bench.py at each batch.beside_interactive tried: a chat's TTFT beside a batch
    against the batch's speed while the chats go on."""
    runs = sorted((with_file(path.name) for path in BENCH_DIR.glob(BESIDE_FILES)),
                  key=lambda data: -data["figures"]["settings"]["beside_interactive"])
    rows = ["| batch.beside_interactive | lines beside the chats, per instance at most | chat TTFT p50 beside / alone, each turn "
            "| the batch's lines/s beside the chats, each turn |", "|---|---|---|---|"]
    for data in runs:
        f = data["figures"]
        st, turns = f["settings"], f.get("turns") or [f]
        share = st["beside_interactive"]
        ratios = ", ".join(f"{t['ratios']['ttft_p50_beside_over_alone']:.2f}" for t in turns)  # (the bench's own)
        speeds = ", ".join(_per_s(t["beside"]["batch_lines_per_s"]) for t in turns)
        slots = st["max_num_seqs"]
        most = min(lines_beside(slots, share), slots - 1)  # (one slot kept for the next chat)
        rows.append(f"| {share:g} | {most} of {slots} | {ratios} | {speeds} |")
    first = runs[0]["figures"]
    first = {**first, "settings": {**first["settings"], "beside_interactive": None}}  # (each row's own)
    notes = "\n".join(f"- {data['figures']['settings']['beside_interactive']:g}: {conditions(data, link)}" for data in runs)
    return (f"{_batch_backend(first)}; a batch of {first['settings']['beside_lines']:,} lines with "
            f"{first['settings']['chats']} chats beside it, one after another (the lines/s count the whole batch: "
            f"the chats end before it does).\n\n" + "\n".join(rows) + "\n\n" + notes)


def batch(link: str, file: str = "batch_bench.json") -> str:
    """bench/batch_bench.py: the chat alone and beside a batch, the loops, the batch, the kill."""
    data = with_file(file)
    f = data["figures"]
    alone, near, best = f["alone"], f["beside"], f["best_loop"]
    rows = [f"| a chat alone ({alone['requests']} chats) | TTFT p50 {_ms(alone['ttft_p50_s'])}, p90 {_ms(alone['ttft_p90_s'])} | |",
            f"| a chat beside a batch of {near['batch_lines']:,} lines ({near['requests']} chats) | TTFT p50 "
            f"{_ms(near['ttft_p50_s'])}, p90 {_ms(near['ttft_p90_s'])}; the batch {_per_s(near['batch_lines_per_s'])} lines/s | "
            f"p50 {_against(f['ratios']['ttft_p50_beside_over_alone'], 1.5, False)}× alone (bar ≤ 1.5) |"]
    for row in f["loop"]:
        mark = " (the best)" if row == best else ""
        rows.append(f"| a client loop, {row['concurrency']} in flight{mark} | {_per_s(row['lines_per_s'])} lines/s | |")
    again = f.get("again")
    if again is None:  # (a result of the bench before it measured the best loop again)
        rows.append(f"| the batch alone (openai SDK, to `completed`) | {_per_s(f['batch']['lines_per_s'])} lines/s | "
                    f"{_against(f['ratios']['batch_over_best_loop'], 0.9, True)}× the best loop (bar ≥ 0.9) |")
    else:
        rows.append(f"| the batch alone (openai SDK, to `completed`) | {_per_s(f['batch']['lines_per_s'])} lines/s | "
                    f"{_against(f['ratios']['batch_over_best_loop'], 0.9, True)}× the best loop measured again (bar ≥ 0.9); "
                    f"{f['ratios']['batch_over_sweep_best']:.2f}× its figure in the sweep |")
        rows.append(f"| the best loop again, {again['concurrency']} in flight, right after the batch | "
                    f"{_per_s(again['lines_per_s'])} lines/s | the bar's baseline |")
    k = f.get("kill")
    if k:
        rows.append(f"| kill -9 of vsup at {k['lines_done_at_kill']:,} of {k['lines']:,} lines, started again (ready in "
                    f"{fmt_s(k['restart_ready_s'])}) | {k['status']}: {k['output_results']:,} results for {k['custom_ids']:,} "
                    f"custom_ids, {k['duplicates']} twice, {k['missing']} missing, {k['error_results']} errors | "
                    f"{'one result each' if k['met'] else 'NOT one result each'} |")
    verdicts = "; ".join(f"{b['what']}: {'met' if b['met'] else 'not met'}" for b in f["bars"])
    return (f"{_batch_backend(f)}:\n\n| what | measured | against the bar |\n|---|---|---|\n" + "\n".join(rows)
            + _turns(f) + f"\n\n{verdicts}. {conditions(data, link)}")


def _turns(f: dict[str, Any]) -> str:
    """With --repeat: what each turn measured, and which the table shows."""
    turns = f.get("turns")
    if not turns:
        return ""
    ttft = ", ".join(f"{t['ratios']['ttft_p50_beside_over_alone']:.2f}×" for t in turns)
    rate = ", ".join(f"{t['ratios']['batch_over_best_loop']:.2f}×" for t in turns)
    if all("again" in t for t in turns):
        swept = ", ".join(f"{t['ratios']['batch_over_sweep_best']:.2f}×" for t in turns)
        return (f"\n\n{len(turns)} turns, each against its own baselines (the chats alone at its start, the best loop "
                f"measured again just after its batch): TTFT p50 beside / alone {ttft}; the batch / the best loop {rate} "
                f"(against the sweep's best figure: {swept}). The bars take the median of each; the rows above are the "
                "turn of the median throughput.")
    return (f"\n\n{len(turns)} turns, each against its own baselines (the chats alone and the loops just before its "
            f"batch): TTFT p50 beside / alone {ttft}; the batch / the best loop {rate}. The bars take the median of each; "
            "the rows above are the turn of the median throughput.")


# ---- bench/start_bench.py -------------------------------------------------------------------------

GIB = 1024**3


def start_line(link: str, file: str = "start_bench-eager.json") -> str:
    """Issue 31's bound, one sentence: all ready against the slowest instance's own start."""
    data = with_file(file)
    f = data["figures"]
    st = f["settings"]
    own = ", ".join(fmt_s(i["own_start_s"]) for i in f["instances"])
    weights = f["plan"]["weights_bytes"]
    peak = {k: max(i["load_peak_bytes"][k] for i in f["instances"]) for k in ("anon", "file")}
    return (f"{st['instances']} real vLLM CPU instances of a real-shape model (1.3 B parameters, fp32, "
            f"{f['plan']['weights_bytes'] / 1e9:.1f} GB of weights each{', --enforce-eager' if st['eager'] else ', compiled'}) "
            f"started {f['start']['mode']} (`start.mode: {f['start']['asked']}`): `vsup run` to all ready "
            f"{fmt_s(f['all_ready_s'])}, their own starts {own}: {f['ratio']:.2f}× the slowest (bar ≤ {f['bound']:g}×, "
            f"{'met' if f['met'] else 'not met'}). While loading, an instance's process tree held at most "
            f"{peak['anon'] / GIB:.2f} GiB of its own memory (its {weights / GIB:.2f} GiB of weights and "
            f"{(peak['anon'] - weights) / GIB:.2f} GiB more) and "
            f"{peak['file'] / GIB:.2f} GiB of mapped checkpoint pages. {conditions(data, link)}")


def start_table(link: str, file: str = "start_bench-eager.json") -> str:
    """The start's phases per instance, the ratio, what auto picked, the memory while loading."""
    data = with_file(file)
    f = data["figures"]
    phases = [p for p in ("booting", "loading", "profiling", "compiling", "opening", "warming")
              if any(p in i["phases_s"] for i in f["instances"])]
    weights = f["plan"]["weights_bytes"]
    lines = [start_line(link, file), "",
             "| instance | own start | " + " | ".join(phases) + " | load peak: anon | + file pages | once ready: anon |",
             "|---" * (len(phases) + 5) + "|"]
    for i in f["instances"]:
        peak, ready = i["load_peak_bytes"], i["ready_bytes"] or {"anon": 0}
        lines.append(f"| {i['index']} | {fmt_s(i['own_start_s'])} | "
                     + " | ".join(fmt_s(i["phases_s"][p]) if p in i["phases_s"] else "–" for p in phases)
                     + f" | {peak['anon'] / GIB:.2f} GiB ({peak['anon'] / weights:.2f}× weights) | {peak['file'] / GIB:.2f} GiB"
                     f" | {ready['anon'] / GIB:.2f} GiB |")
    lines += ["", f"`start.mode: {f['start']['asked']}` picked **{f['start']['mode']}**: {f['start']['reason']}. "
              f"Load average when all were ready: {f['load_average_at_ready'][0]:.1f}."]
    return "\n".join(lines)


# ---- the blocks -----------------------------------------------------------------------------------

def kv_oracle(link: str, file: str = "kv_bench.json") -> str:
    """bench/kv_bench.py: every policy's prefix-cache hit rate per cache size, kv_aware over the oracle."""
    data = with_file(file)
    f = data["figures"]
    names = ("round_robin", "prefix_affinity", "kv_aware", "oracle")
    rows = []
    for scenario in f["scenarios"]:
        rates = " | ".join(f"{scenario['policies'][n]['hit_rate']:.1%}" for n in names)
        ratio = scenario["kv_aware_over_oracle_hit_rate"]
        rows.append(f"| {scenario['cache_blocks']:,} blocks | {rates} | {ratio:.2f} ({'met' if scenario['goal_met'] else 'not met'}) |")
    st = f["settings"]
    what = f"{st['instances']} fake vLLM instances" if isinstance(f["instances"], str) else \
        f"{len(f['instances'])} real vLLM instances (`vsup run`, kv_aware, the tiny random Llama)"
    return (f"{what}, {st['conversations']} chats x {st['turns']} turns, a {st['system_words']}-word "
            f"system prompt, {st['concurrency']} turns in flight, {st['rounds']} rounds; prefix-cache hit rate (the instances' "
            f"own counters):\n\n| cache per instance | round_robin | prefix_affinity | kv_aware | oracle | kv_aware / oracle (goal >= 0.9) |\n"
            f"|---|---|---|---|---|---|\n" + "\n".join(rows) + f"\n\n{conditions(data, link)}")


def kv_tokenize(link: str) -> str:
    """bench/kv_tokenize_bench.py: the token ids of a chat request, two ways."""
    data = with_file("kv_tokenize_bench.json")
    f = data["figures"]
    remote, local = f["tokenize_route"], f["local_tokenizer_and_chat_template"]
    return (f"A {f['prompt_tokens']}-token chat request, {remote['requests']} times each way: the instance's `/tokenize` "
            f"{remote['p50_ms']:.2f} ms p50 ({remote['p90_ms']:.2f} ms p90) of wall time, the work in the instance's API server; "
            f"the tokenizer and chat template in the calling process {local['p50_ms']:.2f} ms p50 ({local['p90_ms']:.2f} ms p90) "
            f"of its own CPU; the same token ids {f['same_token_ids']}. {conditions(data, link)}")


RENDERERS: dict[str, Callable[[str], str]] = {
    "kv-oracle": kv_oracle,
    "kv-tokenize": kv_tokenize,
    "kv-oracle-vllm": lambda link: kv_oracle(link, "kv_bench-vllm.json"),
    "vllm-layouts": vllm_layouts,
    "vllm-runs": vllm_runs,
    "layout-sentence": layout_sentence,
    "proxy-overhead": proxy_readme,
    "proxy-front-door": front_door,
    "proxy-tables": proxy_tables,
    "proxy-scrape": scrape,
    "proxy-policy-cost": policy_cost,
    "affinity": affinity,
    "affinity-line": affinity_line,
    "fleet": fleet,
    "affinity-fake": affinity_fake,
    "affinity-fake-hot": affinity_fake_hot,
    "load-probe": load_probe,
    "plan": plan,
    "warmup": warmup,
    "systemd-exposure": systemd,
    "soak": soak,
    "metrics-cap": metrics_cap,
    "flood": flood,
    "start": start_line,
    "start-table": start_table,
    "start-compiled": lambda link: start_line(link, "start_bench.json"),
    "start-table-compiled": lambda link: start_table(link, "start_bench.json"),
    "priority": priority,
    "priority-vllm": lambda link: priority(link, "priority_bench-vllm.json"),
    "batch": batch,
    "batch-embeddings": lambda link: batch(link, "batch_bench-embeddings.json"),
    "batch-line": batch_line,
    "batch-beside": batch_beside,
    "batch-slots32": lambda link: batch(link, "batch_bench-slots32.json"),
    "batch-real-shape": lambda link: batch(link, "batch_bench-real-shape.json"),
    "batch-vllm-priority": lambda link: batch(link, "batch_bench-vllm-priority.json"),
}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(path: Path, text: str) -> str:
    """`text` with every published block rewritten; an unknown block name is an error."""
    link = "docs/bench" if path.parent == ROOT else "bench"

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise SystemExit(f"{path.relative_to(ROOT)}: unknown published block {name!r} (known: {', '.join(RENDERERS)})")
        indent = match["indent"]
        body = "".join(f"{indent}{line}\n" if line else "\n" for line in RENDERERS[name](link).split("\n"))
        return f"{indent}{match['begin']}{body}{indent}{match['end']}"

    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = []
    for path in documents():
        text = path.read_text()
        new = render(path, text)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
                print(f"{path.relative_to(ROOT)}: rewritten")
    if check and stale:
        print("out of date (run scripts/published_numbers.py): " + ", ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
