"""`vsup export slurm` of a fleet under a real Slurm (22.05, scripts/slurm-sim: two hosts on this
machine): two models, each with its step on every host; the front proxy answers each model from
that model's vsups only, an unknown model with 404 model_not_found, and a `scancel --batch --signal=TERM` leaves
nothing running. Marked `slurm`; needs root and Debian's slurmctld slurmd slurm-client munge."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.fakevllm.fixtures import fake_command
from tests.test_slurm_real import (
    ADDR,
    PORT,
    STOPS,
    front,
    job_output,
    sh,
    slurm,  # noqa: F401  (the cluster fixture, used by name)
    submit,
    wait_gone,
    wait_until,
)

pytestmark = pytest.mark.slurm

FLEET = {
    "placement": {"model_size_gib": 0.01, "kvcache_gib": 0.01, "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
    "vllm": {"command": fake_command()},
    "proxy": {"port": PORT, "drain_timeout": 5},
    "health": {"interval": 0.3, "timeout": 2, "failures": 2, "startup_timeout": 60},
    "stop": {"timeout": 5},
    "models": [{"model": "fake-model", "served_model_name": name, "instances": 1} for name in ("chat", "embed")],
}
READY = re.compile(r'vsup_instance_ready\{instance="http://(h\d):(\d+)",model="(\w+)"\} 1\.0')


def chat(model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://{ADDR['h1']}:{PORT}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def requests_by_upstream(metrics: str) -> dict[tuple[str, str], float]:
    """Requests the front sent to each (upstream port, model)."""
    counts: dict[tuple[str, str], float] = {}
    for line in metrics.splitlines():
        match = re.match(r'vsup_proxy_requests_total\{.*instance="http://h\d:(\d+)".*model="(\w+)".*\} (\S+)', line)
        if match:
            key = (match[1], match[2])
            counts[key] = counts.get(key, 0) + float(match[3])
    return counts


@pytest.mark.parametrize("slurm", ["cgroup"], indirect=True)
def test_two_models_on_two_hosts_route_by_model(slurm, tmp_path):  # noqa: F811
    job = submit(tmp_path, FLEET)
    try:
        wait_until(lambda: len(READY.findall(front("/metrics")[1])) == 4, 150, "both models' vsups ready on both hosts")
    except AssertionError:
        print(job_output(job))
        raise
    ports = {model: {port for _, port, m in READY.findall(front("/metrics")[1]) if m == model} for model in ("chat", "embed")}
    assert len(ports["chat"]) == len(ports["embed"]) == 1 and ports["chat"] != ports["embed"]  # a step each
    for model in ("chat", "embed") * 3:
        status, reply = chat(model)
        assert status == 200 and reply["model"] == model, reply
    status, reply = chat("rerank")
    assert status == 404 and reply["error"]["code"] == "model_not_found", reply
    counts = requests_by_upstream(front("/metrics")[1])
    assert {model for (port, model) in counts if port in ports["chat"]} == {"chat"}, counts
    assert {model for (port, model) in counts if port in ports["embed"]} == {"embed"}, counts
    sh(*STOPS["batch"], job)
    wait_gone(job)
