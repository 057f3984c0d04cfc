"""The proxy's /metrics parses whatever the instances send (issue 20 §4): instances on real sockets
serve clashing, duplicated or huge metrics text, a Collector scrapes them, a ProxyServer serves
the merged text, and Prometheus's own parser (`promtool check metrics`) reads it."""

from __future__ import annotations

import contextlib
import logging
import random
import subprocess

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.proxy_support import metric_value, metrics_text, ready_pool, running_proxy, start_fakes
from tests.tools import need_tool
from vsup.observe import scrape
from vsup.observe.collector import Collector, Target

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def instances(texts: list[str]):
    """One aiohttp server per text, on a real loopback socket, answering GET /metrics with it."""
    runners = []
    urls = []
    try:
        for text in texts:
            async def metrics(request: web.Request, text: str = text) -> web.Response:
                return web.Response(text=text, content_type="text/plain")

            app = web.Application()
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")  # an instance address (the collector asks /metrics)
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


async def proxy_metrics(urls: list[str], max_series: int = 20000, rounds: int = 1) -> str:
    """The proxy's /metrics after `rounds` collections of the instances at `urls` (named 0, 1, ...)."""
    targets = [Target(str(i), u, (0,)) for i, u in enumerate(urls)]
    async with aiohttp.ClientSession() as session, running_proxy(ready_pool([])) as proxy:
        collector = Collector(lambda: targets, session, interval=1.0, timeout=5.0, pids=lambda t: [], max_series=max_series)
        for _ in range(rounds):
            await collector.collect()
        proxy.extra_metrics = collector.text
        return await metrics_text(proxy)


def promtool_parses(text: str) -> None:
    """`promtool check metrics` exits 1 with "error while linting: text format parsing error ..." when
    Prometheus cannot parse the text. Its lint findings (exit 3: "counter metrics should have _total
    suffix", "no help text", ...) are about how the instances name their metrics, which vsup passes on
    as they are: the requirement is that the text parses, so those are not failures here."""
    promtool = need_tool("promtool", package="prometheus")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert "error while linting" not in done.stdout + done.stderr, done.stdout + done.stderr + "\n" + text[:4000]
    assert done.returncode in (0, 3), done.stdout + done.stderr


def own_families_intact(text: str) -> None:
    assert "# TYPE vsup_proxy_requests_total counter" in text
    assert "# TYPE vsup_metrics_collected_timestamp_seconds gauge" in text
    assert text.count("# TYPE vsup_metrics_dropped_families_total counter") == 1


HISTOGRAM_FOO = """# HELP foo a histogram
# TYPE foo histogram
foo_bucket{le="1.0"} 1
foo_bucket{le="+Inf"} 2
foo_count 2
foo_sum 3
"""


async def test_a_gauge_named_like_a_histograms_count_is_dropped_counted_and_warned(caplog):
    gauge = "# HELP foo_count a gauge\n# TYPE foo_count gauge\nfoo_count 7\n"
    caplog.set_level(logging.WARNING, "vsup.observe")
    async with instances([HISTOGRAM_FOO, gauge]) as urls:
        text = await proxy_metrics(urls, rounds=2)
    promtool_parses(text)
    own_families_intact(text)
    assert 'foo_bucket{instance="0",le="+Inf"} 2.0' in text and "foo_count 7" not in text and 'foo_count{instance="1"' not in text
    assert metric_value(text, "vsup_metrics_dropped_families_total", instance="1", reason="clash") == 2  # two rounds
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warnings == ["instance 1: /metrics families left out of the proxy's /metrics: foo_count (its names clash with another family's)"]


async def test_vsups_own_names_and_duplicate_series_are_dropped():
    # an instance that is itself a vsup: vsup_x is renamed instance_vsup_x, which it also has
    upstream_vsup = ("# TYPE vsup_x gauge\nvsup_x 1\n# TYPE instance_vsup_x gauge\ninstance_vsup_x 2\n"
                     "# TYPE vsup histogram\nvsup_bucket{le=\"+Inf\"} 1\nvsup_count 1\nvsup_sum 1\n")
    duplicated = "# TYPE dup gauge\ndup{a=\"1\"} 1\ndup{a=\"1\"} 2\n# TYPE fine gauge\nfine 1\n"
    async with instances([upstream_vsup, duplicated]) as urls:
        text = await proxy_metrics(urls)
    promtool_parses(text)
    own_families_intact(text)
    assert metric_value(text, "vsup_metrics_dropped_families_total", instance="0", reason="duplicate") == 1
    assert metric_value(text, "vsup_metrics_dropped_families_total", instance="0", reason="vsup_name") == 1
    assert metric_value(text, "vsup_metrics_dropped_families_total", instance="1", reason="duplicate") == 1
    assert 'instance_vsup_x{instance="0"} 1.0' in text and "dup{" not in text and 'fine{instance="1"} 1.0' in text


LE_INF = 'le="+Inf"'


def _family(rng: random.Random, name: str) -> str:
    """One family of Prometheus text, of a random type, with random (sometimes clashing) samples."""
    kind = rng.choice(["counter", "gauge", "histogram", "summary", "untyped"])
    bound = rng.choice(["1.0", "1.0", "1.0", "abc", "1_0", "NaN", "-Inf"])  # some no number: Prometheus refuses those
    le, quantile = 'le="%s"' % bound, 'quantile="%s"' % bound
    labels = rng.choice(['', '{instance="x"}', '{a="1"}', '{a="1",exported_instance="y"}', '{a="2"}'])
    lines = [f"# HELP {name} help of {name}", f"# TYPE {name} {kind}"]
    inner = labels[1:-1]
    def with_label(extra: str) -> str:
        return "{" + ",".join(p for p in (inner, extra) if p) + "}"
    if kind == "counter":
        lines.append(f"{name if name.endswith('_total') else name + '_total'}{labels} {rng.randint(0, 9)}")
    elif kind == "histogram":
        lines += [f"{name}_bucket{with_label(le)} 1", f"{name}_bucket{with_label(LE_INF)} 2",
                  f"{name}_count{labels} 2", f"{name}_sum{labels} 1.5"]
    elif kind == "summary":
        lines += [f"{name}{with_label(quantile)} 1", f"{name}_count{labels} 2", f"{name}_sum{labels} 1.5"]
    else:
        lines.append(f"{name}{labels} {rng.random()}")
    if rng.random() < 0.15:
        lines.append(lines[-1])  # the same series twice
    return "\n".join(lines) + "\n"


# Names that clash in every way the text format allows: a histogram's/summary's derived names, a
# counter's _total, _created, vsup's namespace and its renamed form, names that escape alike.
NAMES = ["foo", "foo_count", "foo_sum", "foo_bucket", "foo_total", "foo_created", "bar", "bar_total",
         "vsup_proxy_requests", "vsup_proxy_requests_total", "instance_vsup_proxy_requests", "vsup",
         "vsup_metrics_dropped_families", "vllm:num_requests_running", "vllm:num_requests_running_count",
         "process_cpu_seconds", "up"]


async def test_random_clashing_instances_always_give_text_promtool_parses():
    need_tool("promtool", package="prometheus")
    rng = random.Random(20)
    (fake,) = start_fakes(["v"])  # a real fake vLLM's /metrics in the mix (histograms, _created, process_*)
    try:
        for _ in range(25):
            texts = ["".join(_family(rng, rng.choice(NAMES)) for _ in range(rng.randint(1, 6))) for _ in range(3)]
            async with instances(texts) as urls:
                text = await proxy_metrics([fake.url, *urls])
            promtool_parses(text)
            own_families_intact(text)
            families = list(text_string_to_metric_families(text))  # and prometheus_client's parser too
            seen = [f.name for f in families]
            assert sorted({n for n in seen if seen.count(n) > 1}) == []
            assert metric_value(text, "vsup_metrics_dropped_families_total", instance="0") == 0  # the fake's all kept
            assert 'vllm:time_to_first_token_seconds_count{engine="0",instance="0"' in text
    finally:
        fake.cleanup()


def _many_series(count: int) -> str:
    lines = ["# HELP big_a many", "# TYPE big_a gauge"]
    lines += [f'big_a{{i="{i}"}} {i}' for i in range(count // 2)]
    lines += ["# HELP big_b many more", "# TYPE big_b gauge"]
    lines += [f'big_b{{i="{i}"}} {i}' for i in range(count - count // 2)]
    lines += ["# HELP small the last", "# TYPE small gauge", "small 1"]
    return "\n".join(lines) + "\n"


async def test_an_instance_over_the_series_cap_keeps_its_first_families_only(caplog):
    caplog.set_level(logging.WARNING, "vsup.observe")
    async with instances([_many_series(200_000), HISTOGRAM_FOO]) as urls:
        text = await proxy_metrics(urls, max_series=150_000)
    promtool_parses(text)
    own_families_intact(text)
    # big_a (100,000) fits; big_b would pass the cap: it and what follows are left out
    assert text.count('big_a{') == 100_000 and "big_b" not in text and "small" not in text
    assert metric_value(text, "vsup_metrics_dropped_families_total", instance="0", reason="series_cap") == 2
    assert 'foo_count{instance="1"} 2.0' in text
    assert any("instance 0" in r.getMessage() and "max_series_per_instance (150000 series)" in r.getMessage() for r in caplog.records)


def test_cap_cuts_before_the_family_that_passes_it_or_inside_it():
    text = "# TYPE a gauge\na 1\n# TYPE b gauge\nb{x=\"1\"} 1\nb{x=\"2\"} 2\n# TYPE c gauge\nc 1\n"
    assert scrape.cap(text, 10) == scrape.Cut(text, 0, False)
    assert scrape.cap(text, 1) == scrape.Cut("# TYPE a gauge\na 1\n", 2, False)  # b and c left out, a whole
    assert scrape.cap(text, 2) == scrape.Cut("# TYPE a gauge\na 1\n# TYPE b gauge\nb{x=\"1\"} 1\n", 2, True)  # b cut: partial
    assert scrape.cap(text, 10, whole=False) == scrape.Cut(text, 1, True)  # cut off at a byte limit


async def test_a_huge_body_is_read_only_up_to_the_byte_limit():
    """200,000 series of ~30 bytes: 20 series' worth of bytes at a cap of 20 series reads ~8 KB, and
    the family cut off by it is left out, not half-kept."""
    async with instances([_many_series(200_000)]) as urls:
        text = await proxy_metrics(urls, max_series=20)
    promtool_parses(text)
    assert "big_a{" not in text  # big_a is over the cap and was cut: left out whole
    assert metric_value(text, "vsup_metrics_dropped_families_total", instance="0", reason="series_cap") == 1


async def test_names_that_render_alike_are_one_name():
    """generate_latest writes a UTF-8 name (`{"a.b"}`) with underscores: beside a_b it would be a
    second TYPE line for a_b, and labels x.y and x_y would be one label twice."""
    text = '# TYPE a_b gauge\na_b 1\n# TYPE "a.b" gauge\n{"a.b"} 2\n# TYPE g gauge\ng{"x.y"="1",x_y="2"} 3\n# TYPE ok gauge\nok 1\n'
    async with instances([text]) as urls:
        merged = await proxy_metrics(urls)
    promtool_parses(merged)
    assert 'a_b{instance="0"} 1.0' in merged and 'ok{instance="0"} 1.0' in merged and "g{" not in merged
    assert metric_value(merged, "vsup_metrics_dropped_families_total", instance="0", reason="clash") == 1
    assert metric_value(merged, "vsup_metrics_dropped_families_total", instance="0", reason="duplicate") == 1


async def test_bucket_bounds_that_are_no_number_are_dropped():
    """Prometheus's parser wants a float in a bucket's le and a summary's quantile; prometheus_client's takes any string."""
    text = ('# TYPE h histogram\nh_bucket{le="abc"} 1\nh_count 1\nh_sum 1\n'
            '# TYPE s summary\ns{quantile="1_0"} 1\ns_count 1\ns_sum 1\n'
            '# TYPE fine histogram\nfine_bucket{le="+Inf"} 1\nfine_bucket{le="1e3"} 1\nfine_count 1\nfine_sum 1\n')
    async with instances([text]) as urls:
        merged = await proxy_metrics(urls)
    promtool_parses(merged)
    lines = merged.splitlines()
    assert not any(line.startswith(("h_", "s{", "s_")) for line in lines) and 'fine_bucket{instance="0",le="1e3"} 1.0' in lines
    assert metric_value(merged, "vsup_metrics_dropped_families_total", instance="0", reason="invalid") == 2
