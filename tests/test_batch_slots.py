"""Each model's slots per instance for the batch lines' share (vsup/batch/slots.py), auto and as
written, and the supervisor's per-model table (a pooling model queues a second set in vLLM)."""

from __future__ import annotations

from vsup.batch.slots import CPU_DEFAULT_SLOTS, POOLING_QUEUE, slots_of
from vsup.config.schema import BatchConfig, parse_config
from vsup.supervisor.reloading import batch_slots


def config(text: str):
    return parse_config("model: /m\n" + text, require_model=False)


def test_auto_is_the_admission_limit_else_max_num_seqs_else_the_cpu_default():
    assert slots_of(config("proxy: {max_in_flight_per_instance: 6}\nvllm: {args: [--max-num-seqs, '16']}\n"), BatchConfig()) == 6
    assert slots_of(config("vllm: {args: [--max-num-seqs, '16']}\n"), BatchConfig()) == 16
    assert slots_of(config(""), BatchConfig()) == CPU_DEFAULT_SLOTS
    assert slots_of(config(""), BatchConfig(slots_per_instance=3), pooling=True) == 3  # as written, pooling or not


def test_a_pooling_model_without_an_admission_limit_queues_a_second_set_in_vllm():
    seqs = config("vllm: {args: [--max-num-seqs, '16']}\n")
    assert slots_of(seqs, BatchConfig(), pooling=True) == 16 * POOLING_QUEUE
    # with an admission limit the proxy admits no more than it: batch lines above it would keep
    # interactive requests waiting in the proxy, so the limit stands
    limited = config("proxy: {max_in_flight_per_instance: 16}\nvllm: {args: [--max-num-seqs, '16']}\n")
    assert slots_of(limited, BatchConfig(), pooling=True) == 16


def test_the_supervisor_reads_which_models_pool_from_their_flags():
    fleet = parse_config(
        "models:\n"
        "  - {model: /chat, served_model_name: chat, vllm: {args: [--max-num-seqs, '16']}}\n"
        "  - {model: /embed, served_model_name: embed, vllm: {args: [--max-num-seqs, '16', --runner, pooling, --convert, embed]}}\n",
        require_model=False)
    assert batch_slots(fleet) == {"chat": 16, "embed": 32}
