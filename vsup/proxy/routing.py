"""Routing by model: which ready instances may answer a request, and which balancer picks one.

A fleet (`vsup run` with `models:`) serves several models behind one port. Each backend carries
its served model name (`Backend.model`); each model has its own balancer, built from its own
ProxyConfig (policy and affinity settings), so round_robin's rotation, least_outstanding's counts
and prefix_affinity's hashing all run over that model's instances only, and retries stay in it.

What a request asks for is the `model` of its JSON body (the forwarder has parsed it already:
routing costs a dict lookup, not a second parse), an upload's form field `model` (codec.py), else
the `model` query parameter (a GET), else the only model when there is one, else 400 naming the
models. A model's aliases (vsup/config/names.py) route to every instance of it. Besides the
configured names, every id an instance's `/v1/models` lists routes to that instance: its LoRA
adapters (`--lora-modules`, or loaded through the admin route) and further served names. They are
learned when the instance becomes ready and whenever a client asks `/v1/models` (the server does
the fetching; this module only keeps them).

Each name belongs to one model (`owner`): its served name and aliases to it, a name its vllm.args
load to it, a learned name to the model whose instance listed it first. An instance that lists
a name another model owns (an adapter loaded as `b` onto model a's instance) has that name
ignored: never routed there, left out of the merged /v1/models, logged (escaped); loading such
an adapter through the admin route is refused with 409 before it reaches the instance
(`adapter_refused`).

Without models given, or with no backend that has a model (a standalone `vsup proxy`'s
upstreams), `pick()` answers None and the forwarder does exactly what it did before: one balancer
over every ready backend, the body forwarded untouched (vLLM answers its own 404).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from vsup.config.names import ALIAS, Name
from vsup.config.schema import ProxyConfig
from vsup.proxy import errors
from vsup.proxy.affinity import PrefixAffinity
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.balancer import LeastLoaded, make_balancer
from vsup.proxy.messages import Response

log = logging.getLogger("vsup.proxy")

# Longest client-given model name quoted back in an error (it is client data).
SHOWN_CHARS = 100
# At most this many served names listed in an error message.
LISTED = 20
# pick()'s answer when the name is unknown but some instance's model list is still being fetched.
WAIT = object()


def shown(name: str) -> str:
    """A client-given name fit to quote: escaped (repr) and cut."""
    return repr(name if len(name) <= SHOWN_CHARS else name[:SHOWN_CHARS] + "...")


class Route:
    """One name requests may ask for: the model that owns it, the balancer of that model and its
    ready backends, kept up to date in place when the pool changes."""

    __slots__ = ("name", "model", "balancer", "ready")

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = name
        self.balancer: Any = None
        self.ready: tuple[Backend, ...] = ()


class ModelRouter:
    def __init__(self, pool: BackendPool, default: ProxyConfig, models: Mapping[str, ProxyConfig],
                 names: Mapping[str, Name] | None = None) -> None:
        self.pool = pool
        self.default = default  # the balancer settings of a model the pool names but `models` does not
        self.configs: dict[str, ProxyConfig] = dict(models)
        self.names: dict[str, Name] = dict(names or {})  # aliases and vllm.args adapters -> their model
        self.ignored: set[tuple[str, str]] = set()  # (backend, name) another model owns, logged once
        self.probe: Any = None  # the server's load.LoadProbe, handed to each balancer that scores by load
        self.balancers = {name: self._make(config, name) for name, config in self.configs.items()}
        self.learned: dict[str, frozenset[str]] = {}  # backend name -> the ids its /v1/models listed
        self.learning: dict[str, asyncio.Task] = {}  # backend name -> its fetch in progress (server.py)
        self.refused: dict[tuple[str, str], int] = {}  # (model, reason) -> requests refused (/metrics)
        self._version = -1  # the pool version the tables below were built from
        self._tagged = False
        self._routes: dict[str, Route] = {}  # every known name -> its Route

    # -- configuration
    def configure(self, default: ProxyConfig, models: Mapping[str, ProxyConfig], names: Mapping[str, Name] | None = None) -> None:
        """A reload: a model whose policy is unchanged keeps its balancer (and its counts), with
        the new affinity settings; a new policy gets a fresh one; a removed model's goes."""
        balancers = {}
        for name, config in models.items():
            balancer = self.balancers.get(name)
            if balancer is None or balancer.name != config.policy:
                balancer = self._make(config, name)
            elif isinstance(balancer, PrefixAffinity):  # the same policy: its counts kept
                balancer.prefix_chars = config.affinity_prefix_chars
                balancer.load_factor = config.affinity_load_factor
            elif balancer.name == "kv_aware":  # its index kept (kv_aware.py: imported only when chosen)
                balancer.load_factor = config.affinity_load_factor
            balancers[name] = balancer
        kept = {id(b) for b in balancers.values()}
        for old in self.balancers.values():  # kv_aware's subscriber thread stops with its balancer
            if id(old) not in kept and hasattr(old, "close"):
                old.close()
        self.default, self.configs, self.balancers = default, dict(models), balancers
        if names is not None:
            self.names = dict(names)
        for backend, ids in list(self.learned.items()):  # a name a new model owns now leaves the others
            self.learned[backend] = self._accepted(backend, ids)
        self._version = -1

    def _make(self, config: ProxyConfig, model: str | None = None) -> Any:
        balancer = make_balancer(config.policy, config, self.pool, model)
        if isinstance(balancer, LeastLoaded):
            balancer.probe = self.probe
        return balancer

    def learn(self, backend: str, ids: Iterable[str]) -> frozenset[str]:
        """What `backend`'s /v1/models listed (its base names and adapters); answers the names
        kept: those no other model owns."""
        accepted = self._accepted(backend, frozenset(ids))
        if self.learned.get(backend) != accepted:
            self.learned[backend] = accepted
            self._version = -1
        return accepted

    def owner(self, name: str, besides: str = "") -> str | None:
        """The model that owns `name` (None: no model does); learned names as listed by backends
        other than `besides`."""
        if name in self.configs:
            return name
        claimed = self.names.get(name)
        if claimed is not None:
            return claimed.model
        for backend, ids in self.learned.items():
            if backend != besides and name in ids:
                model = self._model_of(backend)
                if model:
                    return model
        return None

    def _model_of(self, backend: str) -> str:
        found = self.pool.get(backend)
        return found.model if found is not None else ""

    def _accepted(self, backend: str, ids: frozenset[str]) -> frozenset[str]:
        model = self._model_of(backend)
        if not model or not self.configs:  # no model to own names: nothing to check
            return ids
        refused = {name for name in ids if (owner := self.owner(name, besides=backend)) is not None and owner != model}
        for name in refused:
            if (backend, name) not in self.ignored:
                self.ignored.add((backend, name))
                log.warning("instance %s (model %s) lists the model name %s, which belongs to the model %s: not routed there "
                            "and left out of /v1/models", backend, shown(model), shown(name), shown(self.owner(name, besides=backend) or ""))
        return ids - refused if refused else ids

    def adapter_refused(self, route: Route | None, name: object) -> Response | None:
        """The 409 for loading an adapter called `name` onto `route`'s model when the name is a
        model's served name or alias, or another model's adapter; None: let it through."""
        if route is None or not isinstance(name, str):
            return None
        owner = self.owner(name)
        base = name in self.configs or (name in self.names and self.names[name].kind == ALIAS)
        if owner is None or (owner == route.model and not base):
            return None
        self._refuse(route.model, "name_taken")
        what = "the name of the model" if name in self.configs else "an alias of the model" if base else "an adapter of the model"
        return errors.error_response(
            409, f"the adapter name {shown(name)} is {what} {owner!r}: each name clients send belongs to one model, so an"
            " adapter needs a name no model uses", "invalid_request_error", "model_name_taken", param="lora_name")

    def forget(self, backend: str) -> None:
        if self.learned.pop(backend, None) is not None:
            self._version = -1

    # -- per request
    def pick(self, model: object, waited: bool):
        """Where a request asking for `model` (its body's or query's; None: neither) goes: its
        Route, None (no backend has a model: route as before), WAIT (an unknown name while a
        model list is still being fetched: settle() first, then ask again) or the refusal."""
        if self.pool.version != self._version:
            self._rebuild()
        if type(model) is str:  # the common case first: one dict lookup
            route = self._routes.get(model)
            if route is not None:
                return route if self._tagged else None
        if not self._tagged:
            return None
        if model is None or model == "":
            if len(self.configs) == 1:
                return self._routes[next(iter(self.configs))]
            self._refuse("", "no_model")
            return errors.error_response(
                400,
                f"the request names no model and this endpoint serves several: send \"model\" (one of {self.served()}); a"
                " request without a JSON body takes the `model` query parameter",
                "invalid_request_error", "model_required", param="model")
        if not isinstance(model, str):
            self._refuse("", "no_model")
            return errors.bad_request(f"\"model\" must be a string (one of {self.served()}), got {type(model).__name__}", "model")
        if self.learning and not waited:
            return WAIT
        self._refuse("", "unknown_model")
        return errors.error_response(
            404, f"the model {shown(model)} does not exist here: this endpoint serves {self.served()}",
            "invalid_request_error", "model_not_found", param="model")

    def current(self, route: Route) -> tuple[Backend, ...]:
        """`route`'s ready backends now (a retry: the pool may have changed since pick())."""
        if self.pool.version != self._version:
            self._rebuild()
        return route.ready

    def ready(self, model: str) -> tuple[Backend, ...]:
        if self.pool.version != self._version:
            self._rebuild()
        route = self._routes.get(model)
        return route.ready if route is not None else ()

    def route_of(self, name: str) -> Route | None:
        """The Route of a name (a model, an alias, a learned adapter), or None: no refusal counted (batch lines)."""
        if self.pool.version != self._version:
            self._rebuild()
        return self._routes.get(name)

    @property
    def tagged(self) -> bool:
        """Some backend names its model: requests are routed by model (else as without a router)."""
        if self.pool.version != self._version:
            self._rebuild()
        return self._tagged

    def serves(self, name: str) -> bool:
        """Whether a request for `name` has a model here (ready or not): the batch runner's check."""
        return name in self.configs or self.route_of(name) is not None

    def balancer(self, model: str):
        if self.pool.version != self._version:
            self._rebuild()
        return self._routes[model].balancer

    async def settle(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the model lists being fetched."""
        if self.learning:
            await asyncio.wait(list(self.learning.values()), timeout=timeout)

    def none_ready(self, model: str) -> Response:
        self._refuse(model, "no_ready_instance")
        return errors.unavailable(
            f"no ready instance of the model {model!r}: its instances are starting, restarting or unhealthy (the other"
            " models are served as usual); retry shortly", errors.RETRY_AFTER_SECONDS)

    def served(self) -> str:
        names = sorted(self._routes)
        listed = ", ".join(map(repr, names[:LISTED]))
        return listed + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "") if names else "no model yet"

    def _refuse(self, model: str, reason: str) -> None:
        key = (model, reason)
        self.refused[key] = self.refused.get(key, 0) + 1

    def _rebuild(self) -> None:
        """The per-model tables, from the pool's backends and what they listed: run when the
        pool changed (readiness, an ejection, a reload), not per request."""
        pool = self.pool
        self._version = pool.version
        backends = pool.all()
        self._tagged = bool(self.configs) and any(b.model for b in backends)
        balancer_of = dict(self.balancers)
        for backend in backends:  # a model the pool names before a reload told us its settings
            if backend.model and backend.model not in balancer_of:
                balancer_of[backend.model] = self.balancers[backend.model] = self._make(self.default, backend.model)
        owner_of = {name: name for name in balancer_of}
        aliases: dict[str, list[str]] = {}  # model -> its aliases
        for name, claimed in self.names.items():  # an adapter's route comes when an instance lists it
            if claimed.kind == ALIAS and claimed.model in balancer_of and name not in balancer_of:
                owner_of[name] = claimed.model
                aliases.setdefault(claimed.model, []).append(name)
        for backend in backends:  # a learned name: the model it runs on (learn() kept only its own)
            for name in self.learned.get(backend.name, ()):
                if name not in owner_of and backend.model in balancer_of:
                    owner_of[name] = backend.model
        table: dict[str, list[Backend]] = {name: [] for name in owner_of}
        for backend in pool.ready():
            answers = {backend.model, *aliases.get(backend.model, ()), *self.learned.get(backend.name, ())}
            for name in answers:
                if name in table and owner_of[name] == backend.model:
                    table[name].append(backend)
        routes = {}
        for name, ready in table.items():  # Routes updated in place: a request holding one sees the change
            route = routes[name] = self._routes.get(name) or Route(name)
            route.model, route.balancer, route.ready = owner_of[name], balancer_of[owner_of[name]], tuple(ready)
        for name, route in self._routes.items():
            if name not in routes:
                route.ready = ()
        self._routes = routes
