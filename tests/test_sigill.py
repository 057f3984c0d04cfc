"""An instance that dies by SIGILL under a real `vsup run`: the fake vLLM kills itself with SIGILL
as it starts (FAKE_VLLM_SIGILL_AT_START, what vLLM's x86 build does on a CPU without AVX2). It is
described as an illegal instruction with its cause and goes to `failed` at once: no backoff, no
crash loop of restarts, while the other instance serves. The same path runs on the virtual clock
in tests/test_driver.py."""

from __future__ import annotations

import signal
import time

import pytest

from tests.test_supervisor import cli, completion_through_proxy
from vsup.supervisor.lifecycle import describe_exit

pytestmark = pytest.mark.timeout(120)


def test_an_instance_killed_by_sigill_is_failed_at_once_and_the_other_keeps_serving(vsup):
    # restart quickly and never call it a crash loop: only the SIGILL rule can stop the restarts
    run = vsup(faults={0: {"SIGILL_AT_START": "1"}},
               restart={"max_delay": 0.2, "max_failures": 1000})
    status = run.wait_for(lambda s: s["instances"][0]["state"] == "failed" and s["instances"][1]["state"] == "ready",
                          60, "instance 0 failed while instance 1 is ready")
    zero = status["instances"][0]
    assert zero["last_exit"] == describe_exit(-signal.SIGILL)
    assert "illegal instruction" in zero["last_exit"] and "see vsup doctor" in zero["last_exit"]
    path = [(t["from"], t["event"], t["to"]) for t in zero["transitions"]]
    assert path == [("stopped", "start", "starting"), ("starting", "exited", "stopping"), ("stopping", "unrunnable", "failed")]
    assert zero["transitions"][-1]["reason"].startswith("not restarted: killed by SIGILL (illegal instruction)")

    time.sleep(2.0)  # ten restart delays (0.2 s at most): a crash loop would have restarted it by now
    again = run.instance(0)
    assert again["state"] == "failed" and again["restarts"] == 0 and len(again["transitions"]) == 3
    assert run.instance(1)["state"] == "ready" and completion_through_proxy(run.proxy_port)
    shown = cli("status", "--socket", run.socket)
    assert shown.returncode == 0 and "killed by SIGILL (illegal instruction)" in shown.stdout
    assert "killed by SIGILL (illegal instruction)" in run.log()
