"""Every measured number in README.md and docs/*.md comes from a checked-in result file.

The benches write docs/bench/<name>.json (bench/result.py); scripts/published_numbers.py renders
the figures between `<!-- BEGIN published:NAME -->` markers from them. Here: the blocks match the
files, every file says how and where it was measured, no measurement is quoted outside a block,
and the tune report's figures match the report's own files (docs/tune-report/).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "docs" / "bench"


def _script():
    spec = importlib.util.spec_from_file_location("published_numbers", ROOT / "scripts" / "published_numbers.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["published_numbers"] = module
    spec.loader.exec_module(module)
    return module


pn = _script()


@pytest.mark.parametrize("path", pn.documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_published_blocks_match_the_result_files(path):
    text = path.read_text()
    assert pn.render(path, text) == text, f"{path.relative_to(ROOT)} is out of date: run scripts/published_numbers.py"


def test_every_block_is_published_somewhere():
    names = {m["name"] for path in pn.documents() for m in pn.BLOCK.finditer(path.read_text())}
    assert names == set(pn.RENDERERS), f"blocks never used: {set(pn.RENDERERS) - names}"


def test_a_stale_block_is_rewritten():
    """The check can fail: a block with a made-up figure is replaced by the file's."""
    text = "x\n<!-- BEGIN published:plan (made up) -->\nplans in 0.001 ms\n<!-- END published:plan -->\ny\n"
    out = pn.render(ROOT / "README.md", text)
    assert "0.001 ms" not in out and "docs/bench/plan_bench.json" in out and out.startswith("x\n") and out.endswith("y\n")


def test_an_unknown_block_is_refused():
    with pytest.raises(SystemExit, match="unknown published block 'nope'"):
        pn.render(ROOT / "README.md", "<!-- BEGIN published:nope (x) -->\n<!-- END published:nope -->\n")


@pytest.mark.parametrize("path", sorted(BENCH_DIR.glob("*.json")), ids=lambda p: p.name)
def test_result_files_say_how_and_where_they_were_measured(path):
    data = json.loads(path.read_text())
    assert data["command"].startswith(".venv/bin/python bench/"), data["command"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["date"])
    assert data["commit"] and data["commit"] != "?"
    machine = data["machine"]
    assert machine["cpus"] >= 1 and machine["cpus_allowed"] >= 1 and machine["cpu_model"]
    assert len(machine["load_average_start"]) == 3 and len(machine["load_average_end"]) == 3
    assert data["figures"]


# ---- nothing measured outside a block ---------------------------------------------------------------

# A figure with one of these units is a measurement unless it states a target or a setting.
MEASUREMENT = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:µs|tok/s|tokens/s|req/s|requests/s|GB/s)(?!\w)|"
                         r"(?<![\w.])\d+(?:\.\d+)?×(?!\s?\d)")
TARGET = re.compile(r"(≤|≥|<|>|target|floor|bar)\s*$")
TARGET_AFTER = re.compile(r"^\s*(floor|target|budget)")


def unbacked(text: str) -> list[str]:
    text = pn.BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found = []
    for line in text.splitlines():
        for match in MEASUREMENT.finditer(line):
            if not TARGET.search(line[: match.start()][-12:]) and not TARGET_AFTER.match(line[match.end():]):
                found.append(f"{match.group(0)!r} in: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("path", pn.documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measurement_outside_a_published_block(path):
    assert unbacked(path.read_text()) == []


def test_the_scan_finds_a_quoted_measurement():
    assert unbacked("the proxy costs 90 µs per request and gives 2.1× the throughput")
    assert not unbacked("a target of ≤ 150 µs per request, under the 150 µs floor")


# ---- docs/tune-report: its figures against its own files ---------------------------------------------

REPORT = ROOT / "docs" / "tune-report"


def runs(objective: str) -> dict[str, dict]:
    out = {}
    for line in (REPORT / objective / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "run":
            out[record["candidate"]] = record
    return out


def level(run: dict) -> dict:
    return run["levels"][0]


def bench_means() -> dict[str, tuple[float, float]]:
    """(tok/s, TTFT p50 ms) of vllm_bench.md's table over all rounds."""
    out = {}
    for line in (REPORT / "vllm_bench.md").read_text().split("| mean tok/s |")[1].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0][:3]] = (float(cells[1]), float(cells[3].removesuffix(" ms")))
    return out


def crosscheck() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (REPORT / "crosscheck.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("figure", "---"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def seconds(text: str) -> float:
    return float(text[:-2]) / 1000 if text.endswith("ms") else float(text.removesuffix("s"))


def test_tune_report_figures_come_from_its_files():
    readme = (REPORT / "README.md").read_text()
    thr, lat = runs("throughput"), runs("latency")
    quoted = {
        f"{thr['i2']['extra']['roofline']['limit_gbs']:.1f} GB/s before the throughput search",
        f"{lat['i2']['extra']['roofline']['limit_gbs']:.1f} GB/s before the latency one",
        f"1 × 2 cores: {level(thr['i1'])['output_throughput']:.1f} tok/s | 1 × 2 cores: {level(lat['i1'])['output_throughput']:.1f} tok/s",
    }
    means = bench_means()
    quoted.add(f"(a) 2 × 1 core: {means['(a)'][0]:.1f} tok/s, TTFT p50 {means['(a)'][1] / 1000:.2f} s")
    quoted.add(f"(c) 1 × 2 cores: {means['(c)'][0]:.1f} tok/s, TTFT p50 {means['(c)'][1] / 1000:.2f} s")
    gain = level(thr["i2-seqs16"])["output_throughput"] / level(thr["i2"])["output_throughput"] - 1
    ttft = level(lat["i2-seqs16"])["latency"]["ttft"]["p50"] / level(lat["i2"])["latency"]["ttft"]["p50"] - 1
    quoted.add(f"{gain * 100:+.1f} % tok/s, not kept (needs > 5 %) | TTFT p50 +{ttft * 100:.0f} %, not kept")
    cc = crosscheck()
    tokens = cc["output tokens/s"]
    quoted.add(f"output tokens/s\n{float(tokens[0]):.1f} vs {float(tokens[1]):.1f}")
    worst = max(abs(seconds(cc[f"TTFT {p}"][0]) / seconds(cc[f"TTFT {p}"][1]) - 1) for p in ("p50", "p90", "p99"))
    assert worst < 0.04
    quoted.add("TTFT p50/p90/p99 within 4 % of `vllm bench serve`'s")
    flat = readme.replace("\n", " ")
    missing = [q for q in quoted if q.replace("\n", " ") not in flat]
    assert missing == [], missing
    # and nothing else measured is quoted there
    numbers = set(re.findall(r"\d+\.\d+", flat))
    backed = {n for q in quoted for n in re.findall(r"\d+\.\d+", q)} | {"0.32"}  # vLLM CPU 0.32: the version
    assert numbers <= backed, f"figures without a source: {numbers - backed}"


def test_the_fleet_block_says_when_two_models_miss_the_bound(monkeypatch):
    """The fleet block's verdict follows the file: a run over the goal reads "missed"."""
    real = pn.load

    def over(file: str) -> dict:
        data = real(file)
        if file == "fleet_bench.json":
            data["figures"]["ratios"]["two models / one model, us_per_request"] = 1.25
            data["figures"]["within_goal"] = False
        return data

    monkeypatch.setattr(pn, "load", over)
    text = pn.fleet("docs/bench")
    assert "two models / one model 1.25 per small request" in text and "(bound ≤ 1.10: missed)" in text
    monkeypatch.setattr(pn, "load", real)
    verdict = "met" if real("fleet_bench.json")["figures"]["within_goal"] else "missed"
    assert f"(bound ≤ 1.10: {verdict})" in pn.fleet("docs/bench")
