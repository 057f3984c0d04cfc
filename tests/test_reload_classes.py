"""How each key reloads: one table (the reload class in every key's Field, vsup/config/schema.py),
and a running vsup doing what it says: every `live` key takes effect through a real
`Supervisor.reload` (the in-process fleet of tests/test_supervisor_inprocess.py: real proxy,
fake processes on a virtual clock; the proxy's own keys: tests/test_reload_proxy.py), a `fixed`
key is refused, a `relaunch` key replaces instances, `start` keys are reported as
not applied."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
import yaml
from pydantic import BaseModel, Field

from tests import test_reload_proxy
from tests.test_reload_proxy import black_hole
from tests.test_supervisor_inprocess import Fleet as InProcessFleet
from tests.test_supervisor_inprocess import fleet_fixture, reload_config
from vsup.config.example import example_yaml
from vsup.config.planning import CONFIG_KEYS
from vsup.config.reloading import LIVE, Reload, reload_table
from vsup.config.schema import RELOAD, VsupConfig
from vsup.errors import VsupError
from vsup.supervisor import rollout
from vsup.supervisor.lifecycle import State
from vsup.systemd.notify import Notifier
from vsup.topology.plan_model import PlanSettings

pytestmark = pytest.mark.timeout(120)

LIVE_KEYS = {key for key, entry in RELOAD.items() if entry.reload is Reload.LIVE}


def leaf_keys(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    keys: dict[str, object] = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.update(leaf_keys(field.annotation, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = field.json_schema_extra
    return keys


# ---- the table ---------------------------------------------------------------------------------------

def test_every_key_names_its_reload_class_in_its_field():
    fields = leaf_keys(VsupConfig)
    assert set(fields) == set(RELOAD)
    for key, extra in fields.items():
        assert isinstance(extra, dict) and extra["reload"] in {kind.value for kind in Reload}, key
        assert RELOAD[key].reload.value == extra["reload"]


def test_a_key_without_a_class_is_refused():
    class Section(BaseModel):
        known: int = Field(1, json_schema_extra=LIVE)
        forgotten: int = Field(2)

    with pytest.raises(ValueError, match="forgotten: every config key needs a reload class"):
        reload_table(Section)


def test_what_reload_refuses_replans_and_maps_to_the_planner_comes_from_the_table():
    assert set(rollout.FIXED_KEYS) == {k for k, e in RELOAD.items() if e.reload is Reload.FIXED}
    assert all(rollout.FIXED_KEYS.values())  # each refusal says why
    assert {"proxy.port", "proxy.max_connections", "control.socket", "log.dir"} <= set(rollout.FIXED_KEYS)
    assert set(rollout.LAUNCH_SECTIONS) == {"model", "served_model_name", "aliases", "instances", "placement", "vllm", "models"}
    assert not any(k.startswith("tune.") for k in RELOAD)  # `vsup tune --settings FILE`: vsup/config/tune_settings.py
    assert {k for k, e in RELOAD.items() if e.reload is Reload.START} == {"start.mode"}
    # every planner setting named comes from a relaunch key and is a real PlanSettings field
    assert set(CONFIG_KEYS) <= set(PlanSettings.__dataclass_fields__)
    assert all(RELOAD[key].reload is Reload.RELAUNCH for key in CONFIG_KEYS.values())
    assert CONFIG_KEYS["base_port"] == "vllm.base_port" and CONFIG_KEYS["model_size_bytes"] == "placement.model_size_gib"


def test_the_configuration_reference_tags_every_key_with_its_class():
    text = example_yaml(full=True)
    path: list[str] = []
    seen = set()
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name, rest = line.strip().split(":", 1)
        path[depth:] = [name]
        key = ".".join(path)
        if key in RELOAD:
            assert rest.split("#", 1)[1].startswith(f" [{RELOAD[key].reload.value}] "), line
            seen.add(key)
    assert seen == set(RELOAD)
    for kind in Reload:
        assert f"#   [{kind.value}] " in text  # the legend


# ---- a running vsup doing what the table says ------------------------------------------------------------

class Fleet(InProcessFleet):
    """The in-process fleet, its file taking any section (restart:, metrics:, notify:, ...)."""

    def write(self, **sections) -> None:
        base = reload_config(self.tmp_path)
        config = reload_config(self.tmp_path, **{k: v for k, v in sections.items() if k in base})
        config.update({k: v for k, v in sections.items() if k not in base})
        self.path.write_text(yaml.safe_dump(config))


fleet = fleet_fixture(Fleet)


async def reload(f: Fleet, **sections) -> dict:
    f.write(**sections)
    return await f.run(f.sup.reload("vsup reload"))


def reasons(inst) -> list[str]:
    return [t.reason for t in inst.history]


FIXED_CHANGES = {"proxy.host": {"proxy": {"host": "127.0.0.2"}}, "proxy.port": {"proxy": {"port": 8999}},
                 "proxy.max_body_bytes": {"proxy": {"max_body_bytes": 4096}},
                 "proxy.max_body_buffer": {"proxy": {"max_body_buffer": 64 * 1024 * 1024}},
                 "proxy.max_connections": {"proxy": {"max_connections": 3}},
                 "log.max_bytes": {"log": {"max_bytes": 8192}}, "log.backups": {"log": {"backups": 1}},
                 "log.echo": {"log": {"echo": True}}, "log.group": {"log": {"group": "65534"}},
                 "vllm.listen": {"vllm": {"listen": "tcp"}}}


async def test_fixed_keys_are_refused_and_start_keys_are_reported_not_applied(fleet, tmp_path):
    f = await fleet()
    before = [(i, i.child) for i in f.sup.instances]
    changes = {**FIXED_CHANGES, "log.dir": {"log": {"dir": str(tmp_path / "other")}},
               "batch.dir": {"batch": {"dir": str(tmp_path / "other-batches")}}, "batch.enabled": {"batch": {"enabled": False}},
               "control.socket": {"control": {"socket": str(tmp_path / "other.sock")}}}
    assert set(changes) == set(rollout.FIXED_KEYS)
    for key, sections in changes.items():
        with pytest.raises(VsupError, match="reload refused, nothing was changed") as err:
            await reload(f, **sections)
        assert f"{key} (" in str(err.value) and "restart vsup to apply" in str(err.value)
    record = await reload(f, start={"mode": "staggered"})
    assert record["state"] == "done" and record["applied"] == [] and record["steps"] == []
    assert record["not_applied"] == ["start.mode (read when `vsup run` starts; a reload leaves the change for the next start)"]
    # `vsup tune`'s settings have a file of their own: a run file with them is refused, saying where they went
    with pytest.raises(VsupError, match="reload refused, nothing was changed: .*: tune: `vsup tune`'s settings left the run file"):
        await reload(f, tune={"concurrency": [4]})
    assert [(i, i.child) for i in f.sup.instances] == before


async def test_admin_routes_without_a_key_are_refused_by_a_reload(fleet):
    f = await fleet()
    with pytest.raises(VsupError, match="reload refused, nothing was changed: proxy.admin_routes opens /start_profile, which need an API key"):
        await reload(f, proxy={"admin_routes": ["/start_profile"], "retries": 5})
    assert f.sup.proxy.config.retries == 2  # nothing of that file was applied


async def test_a_relaunch_key_replaces_the_instances(fleet):
    f = await fleet()
    old = [i.child for i in f.sup.instances]
    record = await reload(f, vllm={"env": {"EXTRA": "1"}})
    assert record["applied"] == [] and [(s["action"], s["why"]) for s in record["steps"]] == [("replace", "environment EXTRA")] * 2
    assert all(i.child is not o for i, o in zip(f.sup.instances, old, strict=True))


async def test_connect_and_drain_timeouts_apply_through_a_reload(tmp_path):
    with black_hole() as port:  # instance 0's port: the proxy's connects to it never complete
        f = Fleet(tmp_path, instances=1, vllm={"listen": "tcp", "base_port": port}, proxy={"connect_timeout": 30, "drain_timeout": 5})
        await f.start()
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{f.sup.proxy.port}/v1/completions"

                async def post(timeout: float | None = None) -> tuple[int, str]:
                    async with session.post(url, json={"prompt": "hi"}, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                        return r.status, await r.text()

                stuck = asyncio.ensure_future(post())  # in flight, connecting with the 30 s its pool was built with
                await f.until(lambda: f.sup.proxy.total_in_flight() == 1, "a request in flight")
                record = await reload(f, instances=1, vllm={"listen": "tcp", "base_port": port}, proxy={"connect_timeout": 30, "drain_timeout": 2})
                assert record["applied"] == ["proxy.drain_timeout"]
                await f.run(f.sup.restart([0], rolling=True))  # the drain waits for the stuck request
                assert any("proxy.drain_timeout of 2s passed with 1 request(s)" in r for r in reasons(f.sup.instances[0]))
                stuck.cancel()

                record = await reload(f, instances=1, vllm={"listen": "tcp", "base_port": port}, proxy={"connect_timeout": 0.3, "drain_timeout": 2})
                assert record["applied"] == ["proxy.connect_timeout"]
                await f.until(lambda: f.sup.pool.is_ready("0"), "instance 0 back in the rotation")
                status, text = await f.run(post(timeout=10))
                assert status == 503 and "within 0.3 s" in text, text
        finally:
            await f.stop()


async def test_health_keys_apply_to_the_running_instances(fleet):
    f = await fleet()
    health = {"interval": 7.0, "timeout": 3.0, "failures": 1, "startup_timeout": 50}
    record = await reload(f, health=health)
    assert record["applied"] == ["health.failures", "health.interval", "health.startup_timeout", "health.timeout"]
    probes = f.ops.probes
    await f.ops.clock.advance(70)
    assert 2 * 9 <= f.ops.probes - probes <= 2 * 11  # every 7 s, not every 1 s
    zero = f.sup.instances[0]
    f.ops.load_time = 10_000  # its next start never loads
    f.ops.process_at(zero.url).health = "hang"
    await f.until(lambda: any("startup timeout" in r for r in reasons(zero)), "instance 0's failed start")
    assert any("unhealthy: 1 failed /health polls in a row (last: timeout after 3s)" in r for r in reasons(zero))
    assert any("not healthy after the startup timeout of 50s" in r for r in reasons(zero))


async def test_the_stall_time_applies_to_the_next_start(fleet):
    f = await fleet()
    record = await reload(f, health={"startup_stall": 20})  # below the fixture's startup_timeout (30)
    assert record["applied"] == ["health.startup_stall"]
    zero = f.sup.instances[0]
    f.ops.load_time = 10_000  # its next start never loads, and its tree does nothing
    f.ops.process_at(zero.url).exit(1)
    await f.until(lambda: any(r.startswith("stalled in booting for 20 s") for r in reasons(zero)), "instance 0's stalled start")


async def test_warm_up_keys_apply_to_the_next_warm_up(fleet):
    f = await fleet()
    record = await reload(f, health={"warmup": {"prompt": "Hi", "max_tokens": 2, "timeout": 9}})
    assert record["applied"] == ["health.warmup.max_tokens", "health.warmup.prompt", "health.warmup.timeout"]
    spawn = f.ops.spawn

    async def hanging_warm_up(*args):
        process = await spawn(*args)
        process.warmup = "hang"
        return process

    f.ops.spawn = hanging_warm_up  # type: ignore[method-assign]
    await f.run(f.sup.restart([0], rolling=False))
    zero = f.sup.instances[0]
    await f.until(lambda: any("timeout after 9s" in r for r in reasons(zero)), "instance 0's warm-up timeout")
    body = f.ops.warmups[-1][1]
    assert body["prompt"] == "Hi" and body["max_tokens"] == 2
    f.ops.spawn = spawn  # type: ignore[method-assign]
    warmups = len(f.ops.warmups)
    record = await reload(f, health={"warmup": {"enabled": False, "prompt": "Hi", "max_tokens": 2, "timeout": 9}})
    assert record["applied"] == ["health.warmup.enabled"]
    one = f.sup.instances[1]
    await f.run(f.sup.restart([1], rolling=False))
    await f.until(lambda: one.state is State.READY, "instance 1 ready again")
    assert any("warm-up off" in r for r in reasons(one))
    assert all(pid != one.pid for pid, _ in f.ops.warmups[warmups:])


async def test_restart_policy_keys_apply_to_the_next_failures(fleet):
    f = await fleet()
    policy = {"max_delay": 3, "max_failures": 4, "stable_after": 100_000}
    record = await reload(f, restart=policy)
    assert record["applied"] == [f"restart.{k}" for k in sorted(policy)]
    zero = f.sup.instances[0]

    async def crash(ready_for: float = 0.0) -> None:
        await f.until(lambda: zero.state is State.READY, "instance 0 ready")
        await f.ops.clock.advance(ready_for)
        f.ops.process_at(zero.url).exit(1)
        await f.until(lambda: zero.state in (State.BACKOFF, State.FAILED), "instance 0's failure handled")

    for _ in range(4):
        await crash()
    got = [r for r in reasons(zero) if r.startswith(("next start in", "crash loop"))]
    waits = [float(r.split()[3].removesuffix("s")) for r in got[:3]]
    assert [r.split("(")[1] for r in got[:3]] == ["failure 1)", "failure 2)", "failure 3)"]
    assert 1.0 <= waits[0] <= 2.0 and 2.0 <= waits[1] <= 3.0 and waits[2] == 3.0, got  # 1, 2, 4 s + jitter, capped at 3
    assert got[3].startswith("crash loop: 4 failures in a row, no start ready for 100000s")

    record = await reload(f, restart={**policy, "stable_after": 1})
    assert record["applied"] == ["restart.stable_after"]
    await f.run(f.sup.restart([0], rolling=False))
    for _ in range(2):
        await crash(ready_for=5)
    delays = [r for r in reasons(zero) if r.startswith("next start in")][-2:]
    assert all(r.endswith("(failure 1)") for r in delays), delays  # ready longer than stable_after: counted anew
    assert all(1.0 <= float(r.split()[3].removesuffix("s")) <= 2.0 for r in delays), delays


async def test_the_memory_watchdog_keys_apply_at_once(fleet):
    f = await fleet()
    record = await reload(f, restart={"max_rss": "200MiB", "max_rss_for": 30})
    assert record["applied"] == ["restart.max_rss", "restart.max_rss_for"]
    zero = f.sup.instances[0]
    f.ops.process_at(zero.url).rss = 300 * 2**20
    await f.until(lambda: any("memory watchdog" in r for r in reasons(zero)), "the watchdog")
    why = next(r for r in reasons(zero) if "memory watchdog" in r)
    assert "above restart.max_rss 200MiB" in why and "for 3" in why, why


async def test_stop_timeout_and_log_level_apply_at_once(fleet):
    f = await fleet()
    stop_tree = f.ops.stop_tree
    timeouts: list[float] = []

    async def recording(process, timeout):
        timeouts.append(timeout)
        return await stop_tree(process, timeout)

    f.ops.stop_tree = recording  # type: ignore[method-assign]
    record = await reload(f, stop={"timeout": 0.2}, log={"level": "debug"})
    assert record["applied"] == ["log.level", "stop.timeout"]
    await f.run(f.sup.restart([0], rolling=False))
    assert timeouts == [0.2]
    assert logging.getLogger("vsup").isEnabledFor(logging.DEBUG)
    record = await reload(f, stop={"timeout": 0.2}, log={"level": "error"})
    assert not logging.getLogger("vsup").isEnabledFor(logging.WARNING)


async def test_metrics_keys_apply_to_the_collection(tmp_path):
    with black_hole() as port:  # instance 0's /metrics never answers
        f = Fleet(tmp_path, instances=1, vllm={"listen": "tcp", "base_port": port}, metrics={"interval": 0.5, "timeout": 2})
        await f.start()
        try:
            def error() -> str:
                return str(f.sup.status()["instances"][0]["metrics"])

            await f.until(lambda: "no answer within 2s" in error(), "a timed-out scrape")
            record = await reload(f, instances=1, vllm={"listen": "tcp", "base_port": port}, metrics={"interval": 0.5, "timeout": 0.3})
            assert record["applied"] == ["metrics.timeout"]
            await f.until(lambda: "no answer within 0.3s" in error(), "a scrape with the new timeout")
            assert f.sup.metrics.collector.max_series == 20000
            record = await reload(f, instances=1, vllm={"listen": "tcp", "base_port": port},
                                  metrics={"interval": 0.5, "timeout": 0.3, "max_series_per_instance": 7})
            assert record["applied"] == ["metrics.max_series_per_instance"]
            assert f.sup.metrics.collector.max_series == 7  # the next round reads and keeps at most 7 series
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{f.sup.proxy.port}/metrics") as response:
                    assert "vsup_metrics_collected_timestamp_seconds" in await f.run(response.text())
            record = await reload(f, instances=1, vllm={"listen": "tcp", "base_port": port}, metrics={"interval": 0, "timeout": 0.3, "max_series_per_instance": 7})
            assert record["applied"] == ["metrics.interval"]
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{f.sup.proxy.port}/metrics") as response:
                    text = await f.run(response.text())
            assert "vsup_metrics_collected_timestamp_seconds" not in text  # the collection stopped: the proxy's own only
        finally:
            await f.stop()


class Recording(Notifier):
    def __init__(self) -> None:
        super().__init__(None)
        self.readies: list[str | None] = []

    def ready(self, status: str | None = None) -> None:
        self.readies.append(status)


async def test_ready_when_applies_to_a_vsup_still_starting(tmp_path):
    f = Fleet(tmp_path)  # notify.ready_when: all
    f.sup.notifier = f.sup.readiness.notifier = notifier = Recording()
    spawn = f.ops.spawn
    spawned = 0

    async def second_never_healthy(*args):
        nonlocal spawned
        process = await spawn(*args)
        spawned += 1
        if spawned == 2:
            process.health = 500
        return process

    f.ops.spawn = second_never_healthy  # type: ignore[method-assign]
    f.task = asyncio.create_task(f.sup.run())
    await f.until(lambda: any(i.state is State.READY for i in f.sup.instances), "one instance ready")
    await f.ops.clock.advance(5)
    assert notifier.readies == []  # all: instance 1 is not ready
    record = await reload(f, notify={"ready_when": "any"})
    assert record["applied"] == ["notify.ready_when"]
    await f.until(lambda: notifier.readies != [], "READY=1")
    await f.stop()


BATCH_LIVE = {"max_file_bytes": "1MiB", "max_total_bytes": "2MiB", "retention": 60.0, "priority": -50, "max_attempts": 5,
              "slots_per_instance": 7, "quiet_after": 3600.0, "beside_interactive": 1.0}


async def test_batch_keys_apply_at_once(fleet):
    from vsup.batch.store import Limits

    f = await fleet()
    proxy = f.sup.proxy
    # auto: no admission limit, no --max-num-seqs: vLLM's CPU default, twice over while the model is quiet
    assert proxy.batch_room("m") == 2 * 2 * 128
    record = await reload(f, batch=BATCH_LIVE)
    assert sorted(record["applied"]) == sorted(f"batch.{key}" for key in BATCH_LIVE)
    assert proxy._store.limits == Limits(1024**2, 2 * 1024**2, 60.0, 5)
    assert proxy._forwarder.lowest_priority() == -50
    assert proxy.batch_room("m") == 2 * 2 * 7  # slots_per_instance: 7, still quiet
    assert proxy._forwarder.share.quiet_after == 3600.0
    proxy._forwarder.share.interactive("m")  # a chat now: recent for the reloaded quiet_after (an hour)
    assert proxy.batch_room("m") == 2 * (7 - 1)  # each of the 2 instances keeps one slot
    await f.stop()


def test_every_live_key_has_a_behaviour_test_here_or_in_test_reload_proxy():
    covered = set(test_reload_proxy.COVERED) | {
        "proxy.drain_timeout", "health.interval", "health.timeout", "health.failures", "health.startup_timeout",
        "health.startup_stall", "health.warmup.enabled", "health.warmup.prompt", "health.warmup.max_tokens", "health.warmup.timeout",
        *(f"restart.{k}" for k in ("max_delay", "max_failures", "stable_after", "max_rss", "max_rss_for")),
        "stop.timeout", "log.level", "metrics.interval", "metrics.timeout", "metrics.max_series_per_instance",
        "notify.ready_when", *(f"batch.{key}" for key in BATCH_LIVE)}
    assert covered == LIVE_KEYS
