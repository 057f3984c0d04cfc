"""Kubernetes manifests for vsup and the kubelet configuration its nodes need, from the shape of
one pod (export/pod.py). Pure: data in, objects and YAML text out.

- a ConfigMap with the pod's vsup.yaml, which names each key's environment variable (key_env)
  but holds no key: the keys come from Secrets you create (NAME-api-key, NAME-api-keys);
- a StatefulSet of identical pods, each one NUMA node's share: Guaranteed QoS (requests ==
  limits, whole CPUs in multiples of the SMT width), memory from the plan, /dev/shm as a
  memory-backed emptyDir with a size limit (charged to the pod, so counted in its memory),
  SYS_NICE (the runtime's seccomp profile allows set_mempolicy/mbind only with it), readiness on
  vsup's /ready (503 while no instance is ready or vsup drains), liveness on /health, a preStop
  pause and a grace period that covers vsup's drain and the instances' stop;
- a Service for the clients and the headless Service the StatefulSet names;
- the KubeletConfiguration fragment: CPU manager static + full-pcpus-only, topology manager
  single-numa-node with pod scope, memory manager Static with reservedMemory that sums to the
  node-allocatable reservations (the kubelet refuses to start otherwise), one core per NUMA node
  in reservedSystemCPUs.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass

from vsup import __version__
from vsup.config.schema import ProxyConfig, VsupConfig
from vsup.errors import VsupError
from vsup.export import keys, yamltext
from vsup.export.pod import CONFIG_DIR, CONFIG_FILE, MiB, PodShape
from vsup.topology.cpulist import format_list
from vsup.topology.model import Machine
from vsup.topology.plan_model import GiB, format_gib

# The image the repository's Dockerfile builds; a placeholder until it is pushed somewhere.
DEFAULT_IMAGE = f"vsup:{__version__}"
# Nodes configured with kubelet-config.yaml carry this label; the pods select it.
NODE_LABEL = ("vsup/kubelet", "numa-static")
UID = 10001  # the Dockerfile's non-root user
PRESTOP_SECONDS = 5  # time for the endpoints to drop the pod before vsup starts draining
# The kubelet's default hard eviction thresholds, written out: setting any of them unsets the rest.
EVICTION_HARD = {"memory.available": "100Mi", "nodefs.available": "10%", "imagefs.available": "15%",
                 "nodefs.inodesFree": "5%", "imagefs.inodesFree": "5%"}
EVICTION_MEMORY = 100 * MiB
# --name names the Services (DNS-1035 labels: a letter first, at most 63, and `NAME-pods` adds 5)
# and the StatefulSet, whose pods carry the label controller-revision-hash=NAME-<10-character hash>
# (a label value: at most 63): so at most 52.
NAME = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")
NAME_MAX = 52


@dataclass(frozen=True)
class KubernetesExport:
    objects: tuple[dict, ...]  # ConfigMap, StatefulSet, Service, headless Service
    kubelet: dict  # the KubeletConfiguration fragment
    manifests_text: str  # for `kubectl apply -f`
    kubelet_text: str  # to merge into each node's kubelet configuration


def quantity(value: int) -> str:
    """Bytes as a Kubernetes quantity, exact: Gi, Mi or Ki when they divide it, else bytes."""
    for suffix, unit in (("Gi", GiB), ("Mi", MiB), ("Ki", 1024)):
        if value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def grace_seconds(cfg: VsupConfig) -> int:
    """preStop pause + vsup's drain (proxy.drain_timeout) + the instances' stop (stop.timeout, in
    parallel) + a margin, so the kubelet's SIGKILL never cuts vsup's own shutdown short."""
    return math.ceil(PRESTOP_SECONDS + cfg.proxy.drain_timeout + cfg.stop.timeout + 5)


def export_kubernetes(machine: Machine, shape: PodShape, cfg: VsupConfig, *, name: str, image: str,
                      replicas_per_host: int | str, hosts: int) -> KubernetesExport:
    check_name(name)
    if cfg.proxy.port == 0:
        raise VsupError("proxy.port: 0 picks a free port at start, but the Service needs a fixed one; give a port, e.g. 8000")
    per_host = len(shape.nodes) if replicas_per_host == "auto" else int(replicas_per_host)
    if not 1 <= per_host <= len(shape.nodes):
        raise VsupError(
            f"--replicas-per-host {replicas_per_host}: a pod takes one NUMA node's share and this machine has "
            f"{len(shape.nodes)} node(s) with instances; give 1 to {len(shape.nodes)}, or auto"
        )
    config_text = _config_text(shape)
    objects = (
        _config_map(name, config_text),
        _stateful_set(shape, cfg, name=name, image=image, replicas=per_host * hosts, config_text=config_text),
        _service(name, cfg.proxy.port),
        _headless_service(name, cfg.proxy.port),
    )
    kubelet = kubelet_configuration(shape)
    summary = _summary(machine, shape, cfg, name=name, image=image, per_host=per_host, hosts=hosts)
    manifests_text = yamltext.comment(summary) + yamltext.documents(
        [("", objects[0]), ("", objects[1]), ("Clients connect here: one OpenAI endpoint, every pod behind it.", objects[2]),
         ("The StatefulSet's own (headless) Service: a stable DNS name per pod (NAME-0.NAME-pods).", objects[3])]
    )
    kubelet_text = yamltext.comment(_kubelet_steps(shape)) + yamltext.dump(kubelet)
    return KubernetesExport(objects, kubelet, manifests_text, kubelet_text)


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise VsupError(f"--name {name!r}: a Kubernetes name: lowercase letters, digits and '-', a letter first, a letter "
                        f"or digit last, at most {NAME_MAX} characters (the StatefulSet's pods add a revision label), e.g. vsup-llama")
    return name


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "vsup", "app.kubernetes.io/instance": name}


def _config_text(shape: PodShape) -> str:
    config = shape.config  # no key in it (pod_config): each comes from a Secret, by environment
    return yamltext.comment(
        f"vsup inside one pod: {shape.instances} instance(s) on one NUMA node's share "
        "(written by `vsup export kubernetes`; `vsup config --example --all` lists every key)"
    ) + yamltext.dump(config)


def _config_map(name: str, config_text: str, file: str = CONFIG_FILE) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "labels": _labels(name)},
        "data": {file: config_text},
    }


def key_env(proxy: ProxyConfig, secrets: str) -> list[dict]:
    """A container's environment of keys, each from a Secret you create, never the ConfigMap:
    proxy.api_key as VSUP_API_KEY from `<secrets>-api-key` (key api-key), each named key as its
    variable (key_env, export/keys.py) from `<secrets>-api-keys` (under the variable's name)."""
    env = []
    if proxy.api_key is not None:
        env.append({"name": keys.API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": f"{secrets}-api-key", "key": "api-key"}}})
    env += [{"name": var.env, "valueFrom": {"secretKeyRef": {"name": f"{secrets}-api-keys", "key": var.env}}}
            for var in keys.key_vars(proxy)]
    return env


def secret_steps(proxy: ProxyConfig, secrets: str, who: str) -> list[str]:
    """The summary's lines on the Secrets to create (`who` reads them)."""
    lines = []
    if proxy.api_key is not None:
        lines.append(f"proxy.api_key is read by {who} from the Secret {secrets}-api-key (key api-key), not the "
                     f"ConfigMap: kubectl create secret generic {secrets}-api-key --from-literal=api-key=...")
    variables = keys.key_vars(proxy)
    if variables:
        lines.append(f"proxy.api_keys are read by {who} from the Secret {secrets}-api-keys (one entry per key, named by "
                     f"its variable), not the ConfigMap: kubectl create secret generic {secrets}-api-keys "
                     + " ".join(f"--from-literal={var.env}=..." for var in variables))
    return lines


def _stateful_set(shape: PodShape, cfg: VsupConfig, *, name: str, image: str, replicas: int, config_text: str,
                  secrets: str | None = None) -> dict:
    """`secrets`: the prefix of the Secrets holding the keys (default NAME; a fleet's models share them)."""
    resources = {"cpu": str(shape.cpus), "memory": quantity(shape.memory_bytes)}
    probe_timeout = max(1, math.ceil(cfg.health.timeout))
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict] = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        # memory-backed and charged to the pod: its size is part of the pod's memory limit
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(shape.shm_bytes)}},
    ]
    if os.path.isabs(cfg.model):
        # the model directory of the node, read-only at the same path (or replace with a volume of yours)
        mounts.append({"name": "model", "mountPath": cfg.model, "readOnly": True})
        volumes.append({"name": "model", "hostPath": {"path": cfg.model, "type": "Directory"}})
    container: dict = {
        "name": "vsup",
        "image": image,
        "args": ["run", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": cfg.proxy.port, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["SYS_NICE"]}},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": probe_timeout, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "initialDelaySeconds": 15,
                          "periodSeconds": 10, "timeoutSeconds": probe_timeout, "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "volumeMounts": mounts,
    }
    env = key_env(cfg.proxy, secrets or name)
    if env:
        container["env"] = env
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": _labels(name)},
        "spec": {
            "serviceName": f"{name}-pods",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(name)},
            "template": {
                # a changed configuration rolls the pods
                "metadata": {"labels": _labels(name), "annotations": {"vsup/config-sha256": digest}},
                "spec": {
                    "nodeSelector": {NODE_LABEL[0]: NODE_LABEL[1]},
                    "terminationGracePeriodSeconds": grace_seconds(cfg),
                    "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _service(name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": _labels(name)},
        "spec": {"selector": _labels(name), "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }


def _headless_service(name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-pods", "labels": _labels(name)},
        "spec": {"clusterIP": "None", "selector": _labels(name),
                 "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }


def kubelet_configuration(shape: PodShape) -> dict:
    reserved = sum(value for _, value in shape.reserved_memory)
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cpuManagerPolicy": "static",
        "cpuManagerPolicyOptions": {"full-pcpus-only": "true"},
        "reservedSystemCPUs": format_list(shape.system_cpus),
        "topologyManagerPolicy": "single-numa-node",
        "topologyManagerScope": "pod",
        "memoryManagerPolicy": "Static",
        "reservedMemory": [{"numaNode": node, "limits": {"memory": quantity(value)}} for node, value in shape.reserved_memory],
        # Σ reservedMemory must equal kubeReserved + systemReserved + the hard eviction threshold
        "systemReserved": {"memory": quantity(reserved - EVICTION_MEMORY)},
        "evictionHard": dict(EVICTION_HARD),
    }


def _summary(machine: Machine, shape: PodShape, cfg: VsupConfig, *, name: str, image: str, per_host: int, hosts: int) -> str:
    cpu_nodes = machine.cpu_nodes
    threads = sorted({len(c.cpus) for c in machine.cores})
    inst = shape.plan.instances[0]
    weights, kv, overhead = inst.weights_bytes or 0, inst.kvcache_bytes, inst.overhead_bytes
    reserve = shape.plan.settings.memory_reserve_bytes
    lines = [
        "vsup on Kubernetes, written by `vsup export kubernetes` from the plan of one node type:",
        f"  {len(cpu_nodes)} NUMA node(s) with CPUs ({format_list(n.id for n in cpu_nodes)}), "
        f"{len(machine.cores)} cores ({'-'.join(map(str, threads))} thread(s) each), "
        + ", ".join(f"node {n.id} MemTotal {format_gib(n.memory_total_bytes)}" for n in cpu_nodes),
        f"Each pod takes one NUMA node's share (Guaranteed QoS: requests == limits): {shape.cpus} CPUs, "
        f"{quantity(shape.memory_bytes)} =",
        f"  {shape.instances} instance(s) × ({format_gib(weights)} weights + {format_gib(kv)} KV cache + "
        f"{format_gib(overhead)} overhead) + {format_gib(shape.shm_bytes)} /dev/shm + {format_gib(reserve)} reserve "
        "(vsup, its proxy, page cache)",
        f"  inside, vsup plans {shape.instances} instance(s) of "
        + ", ".join(f"{len(i.omp_cpus)}" for i in shape.plan.instances) + " OpenMP thread(s)"
        + (f" and keeps {len(shape.plan.reserved_cpus)} CPU(s) for itself" if shape.plan.reserved_cpus else ""),
        f"Replicas: {per_host * hosts} ({per_host} per host × {hosts} host(s)).",
        "The nodes need kubelet-config.yaml (see its steps) and the label "
        f"{NODE_LABEL[0]}={NODE_LABEL[1]}.",
        f"Image: {image} (build it from the repository's Dockerfile and push it where the nodes pull from).",
        "No Batch API here (/v1/files, /v1/batches answer 404): the pods have it off, as clients reach them through",
        "the Service and no pod's store outlives it. For it, export a fleet (a config with `models:`, one entry is",
        "enough): its front proxy holds the batches on a PersistentVolumeClaim and runs them on every pod.",
    ]
    lines += secret_steps(cfg.proxy, name, "the pods")
    lines += [f"warning: {w}" for w in shape.warnings]
    return "\n".join(lines)


def _kubelet_steps(shape: PodShape) -> str:
    return "\n".join([
        "Kubelet configuration for the nodes that run vsup (a fragment: merge it into each node's",
        "kubelet config file, e.g. /var/lib/kubelet/config.yaml), written by `vsup export kubernetes`.",
        f"- reservedSystemCPUs: one core per NUMA node ({format_list(shape.system_cpus)}) for the kubelet, the OS and",
        "  the pods that are not Guaranteed; every other core can be given whole to a vsup pod.",
        "- reservedMemory per NUMA node sums to systemReserved + evictionHard memory.available, as the",
        "  memory manager requires; evictionHard lists all the kubelet's defaults (set one, the rest unset).",
        "Changing the CPU or memory manager policy of a node that already ran pods, node by node:",
        "  kubectl drain NODE --ignore-daemonsets --delete-emptydir-data",
        "  systemctl stop kubelet",
        "  rm -f /var/lib/kubelet/cpu_manager_state /var/lib/kubelet/memory_manager_state",
        "    (both managers refuse to start on a state file written under another policy)",
        "  (edit the kubelet config file), systemctl start kubelet",
        f"  kubectl label node NODE {NODE_LABEL[0]}={NODE_LABEL[1]} && kubectl uncordon NODE",
    ])
