"""Kubernetes manifests for a fleet (a config with `models:`): one StatefulSet per model, each pod
one model's share of a NUMA node (export/pod.py, restricted to the CPUs the fleet plan gave that
model, its KV cache the fleet plan's), and one front `vsup proxy` that routes by the body's model
to every pod of that model. Pure: data in, objects and YAML text out.

- per model: a ConfigMap with the pod's single-model vsup.yaml, the StatefulSet `<name>-<slug>`
  (the slug: the served name as a DNS label) and its headless Service, which publishes not-ready
  pods too: the front health-checks each pod on /ready itself and weights it by its ready instances;
- the front: a ConfigMap with its front.yaml (the proxy and health sections, and each model's
  balancer settings), a Deployment of `vsup proxy --forward-key --upstream MODEL=http://POD.SERVICE:PORT ...`
  (one upstream per pod: the front balances requests, not kube-proxy connections) and the
  Service `<name>` clients connect to. The front checks the keys and passes the client's on to
  the pods, which check the same keys; every key comes from the Secrets, none from a ConfigMap;
- the Batch API's store: the front's, on the PersistentVolumeClaim `<name>-batches` (the pods
  have theirs off and place the front's lines below their interactive requests); one writer (the
  store is locked to one process), so the Deployment is `Recreate`, never two fronts at once.
The kubelet configuration is the single-model export's: it depends on the machine alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from vsup.config.fleet import ModelView
from vsup.config.schema import VsupConfig, bytes_of
from vsup.errors import VsupError
from vsup.export import yamltext
from vsup.export.fleet import front_batch, front_config_text, model_slug, upstream_slots
from vsup.export.kubernetes import (
    NAME_MAX,
    NODE_LABEL,
    PRESTOP_SECONDS,
    UID,
    KubernetesExport,
    _config_map,
    _config_text,
    _headless_service,
    _kubelet_steps,
    _labels,
    _service,
    _stateful_set,
    check_name,
    key_env,
    kubelet_configuration,
    quantity,
    secret_steps,
)
from vsup.export.pod import CONFIG_DIR, PodShape, shape_pod
from vsup.topology.cpulist import format_list
from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan, PlanSettings, format_gib

FRONT_FILE = "front.yaml"
# The batch store's volume in the front's container, and the store's own folder in it (vsup makes
# it 0700: the volume's root is the fsGroup's, which the store refuses as its folder).
BATCH_MOUNT = "/var/lib/vsup/batch-volume"
BATCH_DIR = f"{BATCH_MOUNT}/store"
GiB = 1024**3


def batch_volume_bytes(cfg: VsupConfig) -> int:
    """The claim's size: batch.max_total_bytes (every file and result) with a quarter more for
    SQLite's write-ahead log, its pages' slack and an upload in progress, in whole GiB."""
    wanted = bytes_of(cfg.batch.max_total_bytes) * 5 // 4
    return max(1, -(-wanted // GiB)) * GiB
# The front is one asyncio process: one CPU is what it can use; its memory is the proxy's buffers.
FRONT_RESOURCES = {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def memory_share(fleet_plan: Plan, model: str) -> float:
    """The model's part of the memory of the busiest node it shares: its instances' demand there
    over everything's on that node (1 where it is alone), so its pods fit beside the others'."""
    mine = {inst.index: inst for inst in fleet_plan.of_model(model)}
    share = 1.0
    for node in fleet_plan.memory:
        own = sum(mine[i].weights_bytes or 0 for i in node.instances if i in mine)
        own += sum(mine[i].kvcache_bytes + mine[i].overhead_bytes for i in node.instances if i in mine)
        if own and node.demand_bytes > own:
            share = min(share, own / node.demand_bytes)
    return share


def shape_models(machine: Machine, fleet_plan: Plan, views: Sequence[ModelView], settings: dict[str, PlanSettings], *,
                 shm_bytes: int) -> tuple[tuple[ModelView, PodShape], ...]:
    """Each model's pod: its instances of the fleet plan, on its share of the CPUs and of the
    memory of the nodes it shares; vsup inside sizes the KV cache within that."""
    shapes = []
    for view in views:
        insts = fleet_plan.of_model(view.name)
        share = next(m for m in fleet_plan.models if m.name == view.name)
        try:
            shape = shape_pod(machine, replace(fleet_plan, instances=insts, models=()), view.config, settings[view.name],
                              shm_bytes=shm_bytes, share=frozenset(share.cpus), memory_share=memory_share(fleet_plan, view.name))
        except VsupError as exc:  # "instances: ..." of the model's view is its entry's key
            text = str(exc)
            raise VsupError(f"{view.key}.{text}" if text.startswith(("instances:", "placement."))
                            else f"{view.key} ({view.name!r}): {text}") from None
        shapes.append((view, shape))
    return tuple(shapes)


def model_names(name: str, views: Sequence[ModelView]) -> dict[str, str]:
    """Each model's StatefulSet name `<name>-<slug>`, within the 52 characters --name has."""
    names: dict[str, str] = {}
    for view in views:
        slug = model_slug(view.name)
        full = f"{name}-{slug}"
        if not slug:
            raise VsupError(f"{view.key}: the model name {view.name!r} has no letter or digit to name its StatefulSet "
                            "by; set served_model_name")
        if len(full) > NAME_MAX:
            raise VsupError(f"{view.key}: the StatefulSet of model {view.name!r} would be {full!r}, {len(full)} characters "
                            f"(at most {NAME_MAX}); give a shorter --name (at most {NAME_MAX - 1 - len(slug)} here) or a "
                            "shorter served_model_name")
        other = next((n for n, f in names.items() if f == full), None)
        if other is not None:
            raise VsupError(f"{view.key}: models {other!r} and {view.name!r} would both be the StatefulSet {full!r}; "
                            "give one a served_model_name that differs in letters or digits")
        names[view.name] = full
    return names


def export_kubernetes_fleet(machine: Machine, shapes: Sequence[tuple[ModelView, PodShape]], cfg: VsupConfig, *,
                            name: str, image: str, replicas_per_host: int | str, hosts: int) -> KubernetesExport:
    check_name(name)
    if cfg.proxy.port == 0:
        raise VsupError("proxy.port: 0 picks a free port at start, but the Services need a fixed one; give a port, e.g. 8000")
    names = model_names(name, [view for view, _ in shapes])
    port = cfg.proxy.port
    docs: list[tuple[str, dict]] = []
    upstreams: list[str] = []
    counts: dict[str, int] = {}
    for view, shape in shapes:
        per_host = len(shape.nodes) if replicas_per_host == "auto" else int(replicas_per_host)
        if not 1 <= per_host <= len(shape.nodes):
            raise VsupError(
                f"--replicas-per-host {replicas_per_host}: a pod of model {view.name!r} takes one NUMA node's share of "
                f"it and the plan gives it {len(shape.nodes)} node(s); give 1 to {len(shape.nodes)}, or auto"
            )
        sts, replicas = names[view.name], per_host * hosts
        counts[view.name] = replicas
        config_text = _config_text(shape)
        headless = _headless_service(sts, port)
        headless["spec"]["publishNotReadyAddresses"] = True  # the front checks /ready itself
        docs += [
            (f"Model {view.name!r} ({view.key}): {replicas} pod(s), each one NUMA node's share of its CPUs.",
             _config_map(sts, config_text)),
            ("", _stateful_set(shape, view.config, name=sts, image=image, replicas=replicas, config_text=config_text,
                               secrets=name)),
            (f"Model {view.name!r}: a stable DNS name per pod ({sts}-0.{sts}-pods), the front's upstreams.", headless),
        ]
        upstreams += [f"{view.name}=http://{sts}-{i}.{sts}-pods:{port}" for i in range(replicas)]
    batch = front_batch(cfg, max(upstream_slots(view.config, shape.instances, cfg) for view, shape in shapes)) if cfg.batch.enabled else None
    front_text = front_config_text(cfg, "the front proxy: every model's pods behind one endpoint, by the request's "
                                         "model (written by `vsup export kubernetes`)", batch)
    if batch is not None:
        docs.append(("The front's batch store (the Batch API): kept across its restarts; one front writes it at a time.",
                     _batch_claim(name, batch_volume_bytes(cfg))))
    docs += [
        ("The front: vsup proxy, routing each request by its model to that model's pods.", _config_map(name, front_text, FRONT_FILE)),
        ("", _front_deployment(cfg, name=name, image=image, upstreams=upstreams, batch=batch is not None)),
        ("Clients connect here: one OpenAI endpoint, every model behind it.", _service(name, port)),
    ]
    objects = tuple(obj for _, obj in docs)
    first = shapes[0][1]
    kubelet = kubelet_configuration(first)
    summary = _summary(machine, shapes, cfg, names=names, counts=counts, image=image, name=name)
    manifests_text = yamltext.comment(summary) + yamltext.documents(docs)
    kubelet_text = yamltext.comment(_kubelet_steps(first)) + yamltext.dump(kubelet)
    return KubernetesExport(objects, kubelet, manifests_text, kubelet_text)


def _batch_claim(name: str, size: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{name}-batches", "labels": dict(_labels(name))},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": quantity(size)}}},
    }


def _front_deployment(cfg: VsupConfig, *, name: str, image: str, upstreams: list[str], batch: bool = False) -> dict:
    labels = _labels(name)
    probe_timeout = max(1, math.ceil(cfg.health.timeout))
    # it checks the keys and passes the client's on to the pods, which check the same keys
    args = ["proxy", "--forward-key", "--config", f"{CONFIG_DIR}/{FRONT_FILE}"]
    if batch:
        args += ["--batch-dir", BATCH_DIR]
    for upstream in upstreams:
        args += ["--upstream", upstream]
    mounts: list[dict] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    container = {
        "name": "vsup-front",
        "image": image,
        "args": args,
        "ports": [{"name": "http", "containerPort": cfg.proxy.port, "protocol": "TCP"}],
        "resources": {"requests": dict(FRONT_RESOURCES["requests"]), "limits": dict(FRONT_RESOURCES["limits"])},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": probe_timeout, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "initialDelaySeconds": 5,
                          "periodSeconds": 10, "timeoutSeconds": probe_timeout, "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "volumeMounts": mounts,
    }
    env = key_env(cfg.proxy, name)
    if env:
        container["env"] = env
    volumes: list[dict] = [{"name": "config", "configMap": {"name": f"{name}-config"}}]
    if batch:
        mounts.append({"name": "batches", "mountPath": BATCH_MOUNT})
        volumes.append({"name": "batches", "persistentVolumeClaim": {"claimName": f"{name}-batches"}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "replicas": 1,
            # the batch store is one process's (its lock): the old front stops before the new one starts
            **({"strategy": {"type": "Recreate"}} if batch else {}),
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "terminationGracePeriodSeconds": math.ceil(PRESTOP_SECONDS + cfg.proxy.drain_timeout + 5),
                    # fsGroup: the batch volume is writable by vsup's user
                    "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                                        **({"fsGroup": UID} if batch else {})},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _summary(machine: Machine, shapes: Sequence[tuple[ModelView, PodShape]], cfg: VsupConfig, *, names: dict[str, str],
             counts: dict[str, int], image: str, name: str) -> str:
    cpu_nodes = machine.cpu_nodes
    lines = [
        "vsup on Kubernetes, a fleet of models, written by `vsup export kubernetes` from the plan of one node type:",
        f"  {len(cpu_nodes)} NUMA node(s) with CPUs ({format_list(n.id for n in cpu_nodes)}), {len(machine.cores)} cores",
        "Each model's pods take that model's share of one NUMA node (Guaranteed QoS: requests == limits):",
    ]
    for view, shape in shapes:
        inst = shape.plan.instances[0]
        lines.append(
            f"  {view.name} ({view.key}): StatefulSet {names[view.name]}, {counts[view.name]} pod(s) of {shape.cpus} CPUs, "
            f"{quantity(shape.memory_bytes)} = {shape.instances} instance(s) × ({format_gib(inst.weights_bytes or 0)} weights + "
            f"{format_gib(inst.kvcache_bytes)} KV cache + {format_gib(inst.overhead_bytes)} overhead) + "
            f"{format_gib(shape.shm_bytes)} /dev/shm + {format_gib(shape.plan.settings.memory_reserve_bytes)} reserve"
        )
    lines += [
        f"The front: Deployment {name} (vsup proxy), routing by the request's model to every pod of it; Service {name}.",
        *([f"The Batch API (/v1/files, /v1/batches): the front's store on the PersistentVolumeClaim {name}-batches "
           f"({quantity(batch_volume_bytes(cfg))}, ReadWriteOnce); the lines run below interactive requests on every pod."]
          if cfg.batch.enabled else []),
        f"The nodes need kubelet-config.yaml (see its steps) and the label {NODE_LABEL[0]}={NODE_LABEL[1]}.",
        f"Image: {image} (build it from the repository's Dockerfile and push it where the nodes pull from).",
    ]
    lines += secret_steps(cfg.proxy, name, "the front and every model's pods")
    lines += [f"warning: {view.name}: {w}" for view, shape in shapes for w in shape.warnings]
    return "\n".join(lines)
