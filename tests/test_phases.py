"""The start phase parser (vsup/supervisor/phases.py) against vLLM's own lines, and the progress
judge on readings: pure, no process."""

from __future__ import annotations

import pytest

from vsup.supervisor.phases import (
    CPU_MOVING,
    IO_MOVING,
    PATTERNS,
    Output,
    OutputReader,
    Phase,
    Progress,
    StartWatch,
    match,
)

# A start of vLLM CPU 0.32 as its processes write it (the format strings of cpu_model_runner.py,
# weight_utils.py's tqdm bar, default_loader.py, cpu_worker.py, kv_cache_utils.py, core.py,
# entrypoints/launchers/api_server/entry.py and uvicorn), in order, with the phase each line starts.
START_0_32 = [
    ("(APIServer pid=4100) INFO 12-01 10:00:01 [api_utils.py:347]  version 0.32.0", None),
    ("(EngineCore pid=4180) INFO 12-01 10:00:30 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
     "model='/srv/m', load_format=auto, compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>}", None),
    ("(Worker pid=4190) INFO 12-01 10:00:41 [cpu_model_runner.py:68] Starting to load model /srv/m...", Phase.LOADING),
    ("(Worker pid=4190) INFO 12-01 10:00:41 [weight_utils.py:1104] Filesystem type for checkpoints: EXT4. "
     "Checkpoint size: 4.92 GiB. Available RAM: 20.10 GiB.", None),
    ("Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]", Phase.LOADING),
    ("Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:14<00:14, 14.51s/it]", Phase.LOADING),
    ("Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:29<00:00, 14.60s/it]", Phase.LOADING),
    ("(Worker pid=4190) INFO 12-01 10:01:11 [default_loader.py:502] Loading weights took 29.87 seconds", Phase.PROFILING),
    ("(Worker pid=4190) INFO 12-01 10:01:11 [cpu_model_runner.py:87] Warming up model for the compilation...", Phase.COMPILING),
    ("(Worker pid=4190) INFO 12-01 10:01:20 [backends.py:1167] Dynamo bytecode transform time: 8.80 s", Phase.COMPILING),
    ("(Worker pid=4190) INFO 12-01 10:02:40 [backends.py:399] Compiling a graph for compile range (1, 8192) takes 79.10 s",
     Phase.COMPILING),
    ("(Worker pid=4190) INFO 12-01 10:03:30 [cpu_model_runner.py:91] Warming up done.", Phase.PROFILING),
    ("(Worker pid=4190) INFO 12-01 10:03:30 [cpu_worker.py:260] Explicitly set (4.0/23.50) GiB for KV cache on node 0.",
     Phase.PROFILING),
    ("(EngineCore pid=4180) INFO 12-01 10:03:31 [kv_cache_utils.py:1879] GPU KV cache size: 149,776 tokens, "
     "Maximum concurrency for 8,192 tokens per request: 18.28x", Phase.PROFILING),
    ("(EngineCore pid=4180) INFO 12-01 10:03:31 [core.py:396] init engine (profile, create kv cache, warmup model) took "
     "170.41 s (compilation: 139.02 s)", Phase.OPENING),
    ("(APIServer pid=4100) INFO 12-01 10:03:33 [entry.py:140] Starting vLLM server on unix:/run/vsup/i0.sock", Phase.OPENING),
    ("(APIServer pid=4100) INFO:     Application startup complete.", Phase.OPENING),
]

# The same steps as 0.30-0.31 spell them (older `init engine` and API-server wording, pt checkpoints,
# the model runner's "Model loading took %.4f GiB and"), and a compile taken from vLLM's cache.
START_0_30 = [
    ("INFO 10-02 09:00:05 [cpu_model_runner.py:77] Starting to load model /srv/m...", Phase.LOADING),
    ("Loading pt checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]", Phase.LOADING),
    ("Loading pt checkpoint shards: 100% Completed | 1/1 [00:01<00:00,  1.62s/it]", Phase.LOADING),
    ("INFO 10-02 09:00:07 [default_loader.py:267] Loading weights took 1.62 seconds", Phase.PROFILING),
    ("INFO 10-02 09:00:07 [gpu_model_runner.py:2653] Model loading took 0.2389 GiB and 1.853301 seconds", Phase.PROFILING),
    ("INFO 10-02 09:00:07 [cpu_model_runner.py:150] Warming up model for the compilation...", Phase.COMPILING),
    ("INFO 10-02 09:00:08 [backends.py:548] Directly load the compiled graph(s) for dynamic shape from the cache, took 0.9 s",
     Phase.COMPILING),
    ("INFO 10-02 09:00:09 [cpu_model_runner.py:154] Warming up done.", Phase.PROFILING),
    ("INFO 10-02 09:00:09 [cpu_worker.py:255] Auto set (1.2/15.51) GiB for KV cache on node 0, with 12.0 GiB requested memory",
     Phase.PROFILING),
    ("INFO 10-02 09:00:10 [core.py:210] init engine (profile, create kv cache, warmup model) took 4.55 seconds", Phase.OPENING),
    ("INFO 10-02 09:00:11 [api_server.py:1885] Starting vLLM API server 0 on http://127.0.0.1:8100", Phase.OPENING),
]

SHM_WAIT = ("(EngineCore pid=4180) INFO 12-01 10:02:11 [shm_broadcast.py:466] No available shared memory broadcast block "
            "found in 60 seconds. This typically happens when some processes are hanging or doing some time-consuming "
            "work (e.g. compilation, weight/kv cache quantization).")


@pytest.mark.parametrize("lines", [START_0_32, START_0_30], ids=["0.32", "0.30-0.31"])
def test_each_line_of_a_real_start_names_its_phase(lines):
    for line, phase in lines:
        found = match(line)
        assert (found[0].phase if found else None) is phase, line


@pytest.mark.parametrize("lines", [START_0_32, START_0_30], ids=["0.32", "0.30-0.31"])
def test_the_reader_follows_a_start_through_its_phases_and_keeps_the_load_progress(lines):
    reader = OutputReader()
    seen = []
    for line, _ in lines:
        reader.feed([line])
        if reader.phase is not None and (not seen or seen[-1] is not reader.phase):
            seen.append(reader.phase)
    assert seen == [Phase.LOADING, Phase.PROFILING, Phase.COMPILING, Phase.PROFILING, Phase.OPENING]
    out = reader.snapshot()
    assert out.lines == len(lines)  # every line counted: none of them is a waiting line
    assert out.percent == 100 and out.shards in ((2, 2), (1, 1))
    assert dict(out.took)["weights_loaded"] in (29.87, 1.62)
    assert dict(out.took)["engine_ready"] in (170.41, 4.55)


def test_shard_progress_lines_of_every_loader_count():
    for desc in ("Loading safetensors checkpoint shards (eager)", "Multi-thread loading shards",
                 "Multi-thread loading pt checkpoint shards", "Loading np_cache checkpoint shards",
                 "Loading safetensors using Runai Model Streamer"):
        reader = OutputReader()
        reader.feed([f"{desc}:  33% Completed | 1/3 [00:01<00:02,  1.00s/it]"])
        assert (reader.phase, reader.shards, reader.percent) == (Phase.LOADING, (1, 3), 33), desc


def test_a_waiting_line_is_not_progress_and_is_explained_by_the_phase_it_came_in():
    reader = OutputReader()
    reader.feed([START_0_32[8][0], SHM_WAIT, SHM_WAIT])  # compiling, then the engine waits twice
    out = reader.snapshot()
    assert out.lines == 1 and out.phase is Phase.COMPILING
    assert out.waiting is not None and out.waiting.count == 2 and out.waiting.phase is Phase.COMPILING
    watch = StartWatch(0.0)
    watch.update(1.0, Progress(out, 1.0, 0, 0))
    shown = watch.to_json(2.0)["waiting"]
    assert shown["line"] == SHM_WAIT and shown["count"] == 2 and shown["note"].startswith("normal while compiling")
    # a later phase: the note goes with the phase it explained
    reader.feed([START_0_32[11][0]])
    watch.update(3.0, Progress(reader.snapshot(), 2.0, 0, 0))
    assert watch.phase is Phase.PROFILING and watch.to_json(3.0)["waiting"] is None
    # the same line in another phase reads as a possible hang
    reader.feed([SHM_WAIT])
    watch.update(4.0, Progress(reader.snapshot(), 3.0, 0, 0))
    assert "a hang only if" in watch.to_json(4.0)["waiting"]["note"]


def test_lines_that_only_look_alike_do_not_change_the_phase():
    reader = OutputReader()
    for line in ("INFO [loggers.py:123] Engine 000: Avg prompt throughput: 0.0 tokens/s",
                 "INFO [utils.py:305] Using LBHNC KV cache layout.",
                 "a user prompt echoed: Loading weights took forever",
                 "INFO: 127.0.0.1 - \"GET /health HTTP/1.1\" 200 OK",
                 "Warming up model for the compilation" [:20]):
        reader.feed([line])
    assert reader.phase is None and reader.lines == 5


def test_every_pattern_has_a_needle_its_regex_needs():
    # the needle is a fast pre-check: a line the regex matches always contains one of them
    samples = {p.name: [line for line, _ in START_0_32 + START_0_30 if p.regex.search(line)] for p in PATTERNS}
    samples["shm_wait"] = [SHM_WAIT]
    for pattern in PATTERNS:
        assert samples[pattern.name], f"no sample line for {pattern.name}"
        for line in samples[pattern.name]:
            assert any(n in line for n in pattern.needles), (pattern.name, line)


# ---- the progress judge ---------------------------------------------------------------------------

def reading(phase=None, lines=0, cpu=0.0, read=0, waiting=None) -> Progress:
    return Progress(Output(phase=phase, lines=lines, waiting=waiting), cpu, read, 0)


def test_cpu_output_io_and_phase_changes_each_count_as_moving_and_nothing_else_does():
    watch = StartWatch(0.0)
    assert watch.update(2.0, reading()) == [] and watch.moved_at == 2.0  # the first reading is the baseline
    assert watch.update(4.0, reading(cpu=CPU_MOVING * 2 * 0.9)) == []  # under 2 % of a core
    assert watch.moved_at == 2.0 and watch.idle(10.0) == 8.0
    assert watch.update(6.0, reading(cpu=1.0)) == ["cpu"]
    assert watch.update(8.0, reading(cpu=1.0, read=IO_MOVING)) == ["io"]
    assert watch.update(10.0, reading(cpu=1.0, read=IO_MOVING, lines=1)) == ["output"]
    assert watch.update(12.0, reading(Phase.LOADING, cpu=1.0, read=IO_MOVING, lines=1)) == ["phase"]
    assert watch.update(14.0, reading(Phase.LOADING, cpu=1.0, read=IO_MOVING, lines=1)) == []
    assert watch.moved_at == 12.0 and watch.moved_by == "phase" and watch.judged


def test_a_tree_whose_counters_cannot_be_read_is_never_judged():
    watch = StartWatch(0.0)
    watch.update(1.0, Progress(Output(), None, None, None))
    assert not watch.judged


def test_the_load_is_measured_in_bytes_against_the_weights_and_each_phase_is_timed():
    gib = 1024**3
    watch = StartWatch(0.0, weights_bytes=5 * gib)
    watch.update(2.0, reading(cpu=1.0, read=gib // 4))  # booting: Python's own files
    watch.update(4.0, reading(Phase.LOADING, lines=3, cpu=2.0, read=gib))
    watch.update(6.0, reading(Phase.LOADING, lines=4, cpu=3.0, read=3 * gib))
    shown = watch.to_json(6.0)
    assert shown["name"] == "loading" and shown["for"] == 2.0
    assert shown["read_bytes"] == 3 * gib - gib // 4 and shown["weights_bytes"] == 5 * gib
    watch.update(8.0, reading(Phase.COMPILING, lines=5, cpu=5.0, read=5 * gib))
    watch.enter(Phase.WARMING, 20.0)
    assert watch.to_json(20.0)["read_bytes"] is None  # only while loading
    assert watch.took(21.0) == [(Phase.BOOTING, 4.0), (Phase.LOADING, 4.0), (Phase.COMPILING, 12.0), (Phase.WARMING, 1.0)]
    assert watch.summary(21.0) == "booting 4s, loading 4s, compiling 12s, warming 1s"
    # warming is the lifecycle's: a reading that still says compiling does not take it back
    watch.update(22.0, reading(Phase.COMPILING, lines=5, cpu=5.0, read=5 * gib))
    assert watch.phase is Phase.WARMING


def test_a_finished_start_keeps_its_times_and_later_readings_change_nothing():
    watch = StartWatch(10.0)
    assert watch.record() is None  # not ready yet
    watch.update(14.0, reading(Phase.LOADING, lines=1, cpu=1.0))
    watch.update(20.0, reading(Phase.COMPILING, lines=2, cpu=5.0))
    watch.enter(Phase.WARMING, 50.0)
    watch.finish(51.5)
    record = watch.record()
    assert record == {"ready_s": 41.5, "took": {"booting": 4.0, "loading": 6.0, "compiling": 30.0, "warming": 1.5}}
    # ready for a while: neither time nor a late reading nor a second finish moves it
    watch.update(90.0, reading(Phase.OPENING, lines=3, cpu=6.0))
    watch.enter(Phase.OPENING, 95.0)
    watch.finish(99.0)
    assert watch.record() == record and watch.summary(120.0) == "booting 4s, loading 6s, compiling 30s, warming 1s"
