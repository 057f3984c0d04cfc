"""vsup tune's parts: metrics (vllm bench serve's definitions), workload, configs, roofline, report."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from tests.machines import GiB, make_machine
from vsup.config.schema import parse_config
from vsup.errors import VsupError
from vsup.topology.plan_model import PlanSettings
from vsup.topology.planner import plan
from vsup.tune import configs, load
from vsup.tune.candidates import KV_MAX, Candidate
from vsup.tune.metrics import LevelMetrics, RequestRecord, level_metrics
from vsup.tune.report import pareto
from vsup.tune.roofline import ModelFacts, decode_roofline, model_facts
from vsup.tune.workload import load_jsonl, synthetic

# ---- metrics ------------------------------------------------------------------------------------

def test_metrics_follow_vllm_bench_serve_definitions():
    records = [
        RequestRecord(sent=0.0, chunks=[0.5, 0.6, 0.8, 1.1], output_tokens=4, prompt_tokens=10),
        RequestRecord(sent=1.0, chunks=[1.2, 1.3], output_tokens=2, prompt_tokens=6),
        RequestRecord(sent=1.0, error="HTTP 503: no instance ready"),
    ]
    m = level_metrics("c2", records, duration_s=2.0)
    assert (m.completed, m.errors, m.output_tokens, m.input_tokens) == (2, 1, 6, 16)
    assert m.output_throughput == pytest.approx(3.0) and m.request_throughput == pytest.approx(1.0)
    assert m.get("ttft", "mean") == pytest.approx((0.5 + 0.2) / 2)
    # TPOT per request: (latency - ttft) / (tokens - 1) -> 0.2 and 0.1
    assert m.get("tpot", "p50") == pytest.approx(0.15)
    # ITL: every gap between chunks of every request: .1 .2 .3 .1, numpy's linear percentiles
    assert m.get("itl", "p50") == pytest.approx(0.15) and m.get("itl", "p99") == pytest.approx(0.297)
    assert m.get("e2el", "mean") == pytest.approx((1.1 + 0.3) / 2)
    assert m.error_samples == ("HTTP 503: no instance ready",)
    assert LevelMetrics.from_json(json.loads(json.dumps(m.to_json()))) == LevelMetrics.from_json(m.to_json())


# ---- the workload --------------------------------------------------------------------------------

def test_workload_file_of_prompts_and_chat_messages(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "Hello", "max_tokens": 8}\n\n'
                    '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}\n')
    items = load_jsonl(path)
    assert items[0].path == "/v1/completions" and items[0].body("m")["prompt"] == "Hello"
    assert items[1].path == "/v1/chat/completions" and items[1].body("m")["messages"][0]["content"] == "Hi"
    assert all(i.body("m")["stream"] and i.body("m")["ignore_eos"] for i in items)
    path.write_text('{"messages": "Hi", "max_tokens": 4}\n')
    with pytest.raises(VsupError, match=r"w.jsonl:1: needs \"prompt\""):
        load_jsonl(path)


def test_synthetic_prompts_are_distinct_and_sized_by_the_servers_tokenizer():
    async def two_tokens_per_word(text: str) -> int:
        return 2 * len(text.split())

    items = asyncio.run(synthetic(4, 64, 16, two_tokens_per_word))
    assert len({i.prompt for i in items}) == 4  # no shared prefix for vLLM's prefix cache to answer
    assert all(2 * len(i.prompt.split()) == 64 and i.max_tokens == 16 for i in items)


def test_the_load_generator_against_the_fake_measures_every_streamed_token(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.01"}).wait_ready()

    async def go():
        async with load.Client(srv.url, "fake-model") as client:
            items = await synthetic(4, 12, 5, client.tokenize)
            assert [await client.tokenize(i.prompt) for i in items] == [12] * 4
            await load.warm_up(client, items, 2)
            closed = await load.closed_loop(client, items, 3, 0.5)
            opened = await load.open_loop(client, items, 20.0, 0.5)
            return closed, opened

    closed, opened = asyncio.run(go())
    assert closed.level == "c3" and closed.completed >= 3 and closed.errors == 0
    assert closed.output_tokens == 5 * closed.completed and closed.input_tokens == 12 * closed.completed
    assert 0.005 < closed.get("itl", "p50") < 0.5
    assert opened.level == "r20" and opened.completed >= 1 and opened.errors == 0


# ---- configs -------------------------------------------------------------------------------------

def test_a_candidate_config_replaces_placement_flags_and_preload_and_nothing_else():
    base = {"model": "/m", "instances": 2, "placement": {"kvcache_gib": 2, "smt": True},
            "vllm": {"args": ["--dtype", "float32", "--max-num-seqs=32"], "env": {"HF_HUB_OFFLINE": "1"}}}
    cand = Candidate(instances=1, omp_threads=3, preload="tcmalloc", max_num_seqs=8, kvcache_gib=KV_MAX)
    data = configs.apply_candidate(base, cand, {"tcmalloc": "/usr/lib/libtcmalloc_minimal.so.4"})
    assert data["instances"] == 1
    assert data["placement"] == {"kvcache_gib": None, "smt": False, "omp_threads": 3, "housekeeping_core": False}
    assert data["vllm"]["args"] == ["--dtype", "float32", "--max-num-seqs", "8"]
    assert data["vllm"]["env"] == {"HF_HUB_OFFLINE": "1"}  # the user's own
    assert data["vllm"]["preload"] == ["/usr/lib/libtcmalloc_minimal.so.4"]
    # the "none" set is measured without any preload, not with vllm.preload's default (auto)
    assert configs.apply_candidate(base, Candidate(instances=1), {"tcmalloc": "/x.so"})["vllm"]["preload"] == "none"
    assert base["placement"] == {"kvcache_gib": 2, "smt": True}  # the user's data is not touched
    runtime = configs.for_measurement(data, proxy_port=9000, base_port=9100, log_dir="/r/logs", socket="/tmp/s.sock")
    parsed = parse_config(configs.render(runtime, ["a comment"]))
    assert parsed.proxy.port == 9000 and parsed.vllm.base_port == 9100 and parsed.control.socket.name == "s.sock"
    assert parsed.vllm.listen == "unix"  # a tuned config with listen: tcp still measures on private sockets
    assert parsed.batch.enabled is False  # a measurement never opens the user's batch store
    assert configs.flag_value(base["vllm"]["args"], "--max-num-seqs") == 32


# ---- roofline ------------------------------------------------------------------------------------

def test_model_facts_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "num_attention_heads": 16,
                                                      "num_key_value_heads": 4, "hidden_size": 1024,
                                                      "torch_dtype": "bfloat16"}))
    facts = model_facts(str(tmp_path), 1000, ["--dtype", "float32"])
    assert facts.weights_bytes == 2000  # bf16 on disk, fp32 in memory
    assert facts.kv_bytes_per_token == 2 * 8 * 4 * 64 * 4
    assert model_facts(str(tmp_path / "missing"), 1000, []) == ModelFacts(1000, None)


def test_decode_roofline_is_steps_times_bytes_over_bandwidth():
    the_plan = plan(make_machine(cores_per_node=4), PlanSettings(instances=2, reserve_cores=0, model_size_bytes=GiB, kvcache_gib=1))
    stats = lambda v: {"mean": v, "p50": v, "p90": v, "p99": v}  # noqa: E731
    lv = LevelMetrics("c8", 10, 40, 0, 4000, 4000, 400.0, 4.0,
                      {"ttft": stats(0.1), "tpot": stats(0.02), "itl": stats(0.02), "e2el": stats(2.0)})
    roof = decode_roofline(the_plan, [lv], {0: 200e9}, ModelFacts(GiB, 1000))
    # 2 instances / 20 ms = 100 steps/s; 400 tok/s × 20 ms / 2 = 4 sequences per step, each 100 + 50 tokens of KV
    assert roof.steps_per_s == pytest.approx(100)
    assert roof.bytes_per_step == pytest.approx(GiB + 1000 * 4 * 150)
    assert roof.fraction == pytest.approx(100 * (GiB + 600_000) / 200e9)
    assert decode_roofline(the_plan, [lv], {0: 200e9}, ModelFacts(None, None)) is None


# ---- report --------------------------------------------------------------------------------------

def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    points = [(100, 1.0), (80, 0.5), (90, 2.0), (50, 0.4), (100, 1.5)]
    assert pareto(points) == [3, 1, 0]


def test_written_yaml_round_trips_through_yaml():
    text = configs.render({"model": "/m", "instances": 1}, ["line one", ""])
    assert text.startswith("# line one\n#\n") and yaml.safe_load(text) == {"model": "/m", "instances": 1}


@pytest.mark.parametrize(("args", "on", "expected"), [
    (["--dtype", "float32"], True, ["--dtype", "float32", "--enforce-eager"]),
    (["--enforce-eager", "--dtype", "float32"], False, ["--dtype", "float32"]),
    (["--enforce_eager", "--no-enforce-eager", "--max-num-seqs", "8"], True, ["--max-num-seqs", "8", "--enforce-eager"]),
    (["--no_enforce_eager"], False, []),
])
def test_a_candidate_turns_enforce_eager_on_or_off_whatever_the_config_spelled(args, on, expected):
    data = {"model": "m", "vllm": {"args": args}}
    out = configs.apply_candidate(data, Candidate(1, enforce_eager=on), {})
    assert out["vllm"]["args"] == expected and configs.enforce_eager(out["vllm"]["args"]) is on
    assert configs.apply_candidate(data, Candidate(1), {})["vllm"]["args"] == args  # None: as the config says


@pytest.mark.parametrize(("args", "culprit"), [
    (["-O0"], "-O0"), (["-O", "0"], "-O 0"), (["--optimization_level=0"], "--optimization_level=0"),
    (["-cc", '{"mode": 0}'], '-cc {"mode": 0}'), (['--compilation-config={"mode": "NONE"}'], '--compilation-config={"mode": "NONE"}'),
    (["-cc.mode=none"], "-cc.mode=none"), (["--compilation-config", '{"level": 0}'], '--compilation-config {"level": 0}'),
    (["-O3"], None), (["-O", "3", "-cc", '{"mode": 3}'], None), (["--enforce-eager"], None),
])
def test_a_config_that_turns_compile_off_another_way_cannot_measure_enforce_eager_off(args, culprit):
    assert configs.compile_off(args) == culprit
    data = {"model": "m", "vllm": {"args": args}}
    if culprit is None:
        configs.check_enforce_eager(args, (True, False), "--enforce-eager")
        assert "--enforce-eager" not in configs.apply_candidate(data, Candidate(1, enforce_eager=False), {})["vllm"]["args"]
        return
    configs.check_enforce_eager(args, (True,), "--enforce-eager")  # on alone is what the config does anyway
    with pytest.raises(VsupError) as refused:
        configs.check_enforce_eager(args, (True, False), "tune.yaml:2: enforce_eager")
    assert str(refused.value) == (f"tune.yaml:2: enforce_eager: off (a compiled start) cannot be measured: vllm.args has "
                                  f"{culprit!r}, which turns torch.compile off as --enforce-eager does; take it out of "
                                  "vllm.args, or try only on")
    with pytest.raises(VsupError, match="turns torch.compile off"):
        configs.apply_candidate(data, Candidate(1, enforce_eager=False), {})


def test_start_figures_take_the_slowest_instance_and_the_rows_show_them_beside_tokens():
    from vsup.tune.report import Row, eager_tradeoff, markdown_table, start_figures

    status = {"instances": [
        {"index": 0, "start": {"ready_s": 130.0, "took": {"booting": 20.0, "compiling": 100.0, "warming": 10.0}}},
        {"index": 1, "start": {"ready_s": 125.5, "took": {"booting": 25.5, "compiling": 92.0, "warming": 8.0}}},
    ]}
    start = start_figures(status, 140.04)
    assert (start["vsup_s"], start["ready_s"], start["compile_s"]) == (140.04, 130.0, 100.0)
    assert len(start["instances"]) == 2
    assert start_figures({"instances": [{"index": 0, "start": None}]}, 3.0) == {"vsup_s": 3.0, "ready_s": None,
                                                                              "compile_s": None, "instances": []}
    eager = Row(1, "i1-eager", "1 × 2 cores", "tweak", "ok", tok_s=20.0, start_s=30.0, compile_s=0.0)
    compiled = Row(2, "i1", "1 × 2 cores", "rung1", "ok", tok_s=25.0, start_s=130.0, compile_s=100.0)
    table = markdown_table([eager, compiled]).splitlines()
    assert table[0].startswith("| # | candidate | layout | stage | tok/s | start | compile |")
    assert "| 20.0 | 30.0s | none |" in table[2] and "| 25.0 | 2m10s | 1m40s |" in table[3]
    [line] = eager_tradeoff([eager, compiled], [("i1-eager", "i1")])
    assert line == ("--enforce-eager on (`i1-eager`): ready in 30.0s, 20.0 tokens/s; off (`i1`): ready in 2m10s, 1m40s of it "
                    "compiling, 25.0 tokens/s. Off costs 1m40s more at every start (each restart, reload and added "
                    "instance) for +25 % tokens/s.")
