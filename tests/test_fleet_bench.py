"""bench/fleet_bench.py: a small run over real fake-vLLM processes and real proxy processes writes
its result file; with the fleet proxy (ProxyServer(..., models=)) the two-model row is measured
and each model's requests reached its own fakes (the bench checks the answering fake), without
it the routed rows are skipped with a line that says why."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vsup.proxy import ProxyServer

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "fleet_bench.py"

pytestmark = pytest.mark.timeout(180)


def test_a_small_run_measures_two_models_against_one(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH), "--pin", "--runs", "2", "--requests", "60", "--streams", "6",
                          "--chunks", "3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads((tmp_path / "fleet_bench.json").read_text())
    assert data["command"].startswith(".venv/bin/python bench/fleet_bench.py --pin")
    figures = data["figures"]
    one = figures["rows"]["one model"]
    assert one["us_per_request"] > 0 and one["us_per_stream"] > 0 and one["chunks_read"] >= 6  # reads: at least one per stream (chunks may coalesce)
    if "models" in inspect.signature(ProxyServer).parameters:
        assert set(figures["rows"]) == {"one model", "one model, routed", "two models"}
        ratio = figures["ratios"]["two models / one model, us_per_request"]
        assert ratio > 0 and figures["within_goal"] is (ratio <= 1.1 and
                                                       figures["ratios"]["two models / one model, us_per_stream"] <= 1.1)
        assert "two models / one model, us_per_request: " in run.stdout and figures["skipped"] is None
    else:  # before the fleet proxy: measured alone, and said so
        assert set(figures["rows"]) == {"one model"} and figures["ratios"] == {} and figures["within_goal"] is None
        assert "skipped: this checkout's ProxyServer takes no models=" in figures["skipped"]
        assert figures["skipped"] in run.stdout
