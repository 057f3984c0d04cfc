"""`vsup proxy`: the proxy alone, in front of OpenAI-compatible servers started elsewhere.

Each --upstream is health-checked on GET /health (the `health` section of --config: interval,
timeout, failures) and is in rotation only while healthy; an upstream that is another vsup is
checked on GET /ready instead and weighted by the instances ready behind it (0: out of rotation). SIGTERM/SIGINT drain: stop accepting,
let in-flight requests finish for proxy.drain_timeout, then abort the rest.

`--upstream MODEL=URL` says which model an upstream serves (the front of a fleet export: one
model's vsups behind each name); then requests go by the body's `model` (vsup/proxy/routing.py),
each model balanced by its own policy: a fleet --config's `models[i].proxy`, else the proxy's.
Either every upstream names its model or none does.

`--batch-dir DIR` serves the OpenAI Batch API (/v1/files, /v1/batches) from a store in DIR, its
lines run on what interactive requests leave of the upstreams (the `batch` section of --config
sets its other keys): the front proxy of an export holds the batches of every node.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import get_args
from urllib.parse import urlsplit

import click

from vsup.config.admission import resolved
from vsup.config.fleet import is_fleet, models_of
from vsup.config.names import Name, model_names
from vsup.config.schema import BatchConfig, HealthConfig, ProxyConfig, VsupConfig, load_config
from vsup.errors import VsupError
from vsup.proxy.backends import Backend, BackendPool
from vsup.safetext import PrintableFormatter

log = logging.getLogger("vsup.proxy")


def parse_upstream(url: str) -> str:
    """A base URL `http://HOST:PORT` (optionally with a trailing slash) -> normalised. Plain http
    only: the proxy's upstream client speaks no TLS (instances listen on loopback or a private net)."""
    hint = "expected a base URL like http://127.0.0.1:8100 (scheme, host and port; no path)"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise VsupError(f"--upstream {url!r}: {exc}; {hint}") from None
    if parts.scheme != "http" or not parts.hostname:
        raise VsupError(f"--upstream {url!r}: {hint}")
    if port is None:
        raise VsupError(f"--upstream {url!r}: no port; {hint}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise VsupError(f"--upstream {url!r}: {hint} (the proxy appends /v1/... itself)")
    return f"{parts.scheme}://{parts.netloc}"


def parse_spec(raw: str) -> tuple[str, str]:
    """`[MODEL=]URL` -> (model or "", normalised URL). A model name may hold '/' (org/name), a URL
    never holds '=' (no query), so the first '=' before any '://' splits them."""
    model, sep, url = raw.partition("=")
    if not sep or "://" in model:
        return "", parse_upstream(raw)
    if not model.strip():
        raise VsupError(f"--upstream {raw!r}: no model before '='; give MODEL=URL, e.g. chat=http://127.0.0.1:8100")
    return model.strip(), parse_upstream(url)


def build_pool(urls: tuple[str, ...]) -> BackendPool:
    pool = BackendPool()
    specs = [(raw, *parse_spec(raw)) for raw in urls]
    named = [raw for raw, model, _ in specs if model]
    if named and len(named) != len(specs):
        bare = next(raw for raw, model, _ in specs if not model)
        raise VsupError(f"--upstream {bare!r}: names no model while {named[0]!r} does; give every upstream as "
                        "MODEL=URL, or none")
    for raw, model, url in specs:
        if url in {b.url for b in pool.all()}:
            raise VsupError(f"--upstream {raw!r} is given twice")
        pool.add(Backend(name=url, url=url, model=model))
    return pool


def model_configs(pool: BackendPool, proxy_config: ProxyConfig, config: VsupConfig | None) -> dict[str, ProxyConfig]:
    """Each upstream model's balancer settings: its entry's in a fleet --config (a model that file
    does not serve is an error), else the proxy's own. Empty: no upstream names a model."""
    models = sorted({b.model for b in pool.all() if b.model})
    views = {v.name: v for v in models_of(config)} if config is not None and is_fleet(config) else None
    out = {}
    for model in models:
        if views is None:
            out[model] = proxy_config
        elif model in views:
            out[model] = resolved(views[model].config)  # max_in_flight_per_instance: max_num_seqs read from its vllm.args
        else:
            raise VsupError(f"--upstream {model}=...: --config serves no model {model!r}; it serves "
                            + ", ".join(repr(name) for name in views))
    return out


async def serve(proxy_config: ProxyConfig, health: HealthConfig, pool: BackendPool, api_key: str | None,
                models: dict[str, ProxyConfig] | None = None, names: dict[str, Name] | None = None, *,
                forward_key: bool = False, batch: BatchConfig | None = None, batch_dir: Path | None = None) -> None:
    from vsup.proxy import ProxyServer
    from vsup.proxy.healthcheck import HealthChecker

    server = ProxyServer(proxy_config, pool, api_key=api_key, models=models or None, names=names,
                         forward_key=forward_key, batch=batch, batch_dir=batch_dir)
    checker = HealthChecker(pool, interval=health.interval, timeout=health.timeout, failures=health.failures,
                            on_weight=server.set_weight)
    await server.start()
    await checker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    click.echo(f"vsup proxy: listening on http://{proxy_config.host}:{server.port} for {len(pool.all())} upstream(s)", err=True)
    try:
        await stop.wait()
        click.echo(f"vsup proxy: draining ({server.total_in_flight()} in flight, up to {proxy_config.drain_timeout:g} s)", err=True)
        await server.drain_and_stop(proxy_config.drain_timeout)
    finally:
        await checker.stop()
        await server.drain_and_stop(0)  # no-op after a drain; closes after an error


@click.command("proxy")
@click.option("--upstream", "upstreams", multiple=True, required=True, metavar="[MODEL=]URL",
              help="An OpenAI-compatible server, e.g. http://127.0.0.1:8100 (repeat for each); MODEL=URL: it serves "
                   "MODEL, and requests go by their model.")
@click.option("--host", default=None, help="Listen address [default: proxy.host, 127.0.0.1].")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Listen port [default: proxy.port, 8000].")
@click.option("--api-key", envvar="VSUP_API_KEY", default=None,
              help="Bearer token clients must send (env VSUP_API_KEY) [default: proxy.api_key, none].")
@click.option("--policy", type=click.Choice(get_args(ProxyConfig.model_fields["policy"].annotation)), default=None,
              help="How to pick an instance; prefix_affinity: by the prompt's prefix or session, for vLLM's "
                   "prefix cache (docs/proxy.md) [default: proxy.policy, round_robin].")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML file whose `proxy` and `health` sections are used (`model` may be absent).")
@click.option("--forward-key", is_flag=True, default=False,
              help="Pass each client's Authorization on to the upstreams once checked: they are vsups that check the "
                   "same keys (the front of an export); --batch-dir's lines go with an admin key of those keys when "
                   "there is one, else their owner's (docs/batch.md). Without it a proxy with keys drops it.")
@click.option("--batch-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Serve the OpenAI Batch API (/v1/files, /v1/batches) from a store in this folder (vsup's own, "
                   "0700; kept across restarts): batches run on what interactive requests leave of the upstreams "
                   "(--config's batch section sets the rest) [default: off].")
def proxy_command(upstreams, host, port, api_key, policy, config_path, forward_key, batch_dir) -> None:
    """The proxy alone, in front of servers started elsewhere (health-checked on /health; other
    vsups on /ready, weighted by their ready instances)."""
    pool = build_pool(upstreams)
    config = None
    if config_path is not None:
        config = load_config(config_path, require_model=False)
        # a single-model file's max_in_flight_per_instance: max_num_seqs is read from its vllm.args
        proxy_config, health = (config.proxy if is_fleet(config) else resolved(config)), config.health
    else:
        proxy_config, health = ProxyConfig(), HealthConfig()
    overrides = {k: v for k, v in {"host": host, "port": port, "policy": policy}.items() if v is not None}
    if overrides:
        proxy_config = proxy_config.model_copy(update=overrides)
    models = model_configs(pool, proxy_config, config)
    handler = logging.StreamHandler()  # upstreams' text in the log lines shown as plain text
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    from vsup.proxy.runloop import run

    names = model_names(config) if config is not None and is_fleet(config) else None  # its models' aliases
    batch = (config.batch if config is not None else BatchConfig()) if batch_dir is not None else None
    if batch is not None and not batch.enabled:
        raise VsupError("--batch-dir serves the Batch API, which --config turns off (batch.enabled: false): drop one of them")
    run(serve(proxy_config, health, pool, api_key or proxy_config.api_key, models, names, forward_key=forward_key,
              batch=batch, batch_dir=batch_dir))
