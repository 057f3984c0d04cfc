"""`vsup export kubernetes`: every generated object validated offline against the Kubernetes
schemas (kubernetes-validate ships them; the kubelet configuration against the subset of
k8s.io/kubelet/config/v1beta1 in tests/data/kubernetes), the plan's numbers on several
topologies, a pod's config planned again as vsup inside the pod sees it, and the errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.machines import make_machine
from tests.sysfs_builder import GIB, add_memory_limit, build_sysfs
from tests.test_plan_cli import vsup
from vsup.config.planning import settings_from_config
from vsup.config.schema import parse_config
from vsup.export.kubernetes import export_kubernetes
from vsup.export.pod import node_type, shape_pod
from vsup.topology.cpulist import format_list, parse_list
from vsup.topology.model import EFFICIENCY
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine

DATA = Path(__file__).parent / "data" / "kubernetes"
KUBELET_SCHEMA = json.loads((DATA / "kubeletconfiguration-v1beta1.schema.json").read_text())
# the oldest Kubernetes whose schemas the package ships that has every field used, and the newest
VERSIONS = ("1.29", kubernetes_validate.latest_version())
MiB = 1024**2
UNITS = {"Ki": 1024, "Mi": MiB, "Gi": GIB, "": 1}


def to_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|)", quantity).groups()
    return int(number) * UNITS[unit]


def export(machine, config: str, *, replicas_per_host="auto", hosts=1, shm_gib=1):
    cfg = parse_config(config)
    settings = settings_from_config(cfg, numactl_available=True)
    machine = node_type(machine)
    shape = shape_pod(machine, plan(machine, settings), cfg, settings, shm_bytes=int(shm_gib * GIB))
    return shape, export_kubernetes(machine, shape, cfg, name="vsup", image="registry.example/vsup:test",
                                    replicas_per_host=replicas_per_host, hosts=hosts)


def check_objects(result) -> dict:
    """Validate everything; the text is the objects; return them by kind."""
    for obj in result.objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert [doc for doc in yaml.safe_load_all(result.manifests_text)] == list(result.objects)
    assert yaml.safe_load(result.kubelet_text) == result.kubelet
    jsonschema.validate(result.kubelet, KUBELET_SCHEMA)
    by_kind = {}
    for obj in result.objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    return by_kind


def container(by_kind) -> dict:
    (sts,) = by_kind["StatefulSet"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c


def check_guaranteed_and_kubelet(by_kind, result, machine, smt: int) -> None:
    c = container(by_kind)
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    assert requests == limits and set(requests) == {"cpu", "memory"}  # Guaranteed QoS
    assert re.fullmatch(r"\d+", requests["cpu"]) and int(requests["cpu"]) % smt == 0  # whole cores for full-pcpus-only
    kubelet = result.kubelet
    assert kubelet["cpuManagerPolicy"] == "static" and kubelet["cpuManagerPolicyOptions"] == {"full-pcpus-only": "true"}
    assert kubelet["topologyManagerPolicy"] == "single-numa-node" and kubelet["topologyManagerScope"] == "pod"
    assert kubelet["memoryManagerPolicy"] == "Static"
    # the memory manager's rule: Σ reservedMemory = kubeReserved + systemReserved + evictionHard memory.available
    reserved = sum(to_bytes(r["limits"]["memory"]) for r in kubelet["reservedMemory"])
    assert reserved == to_bytes(kubelet["systemReserved"]["memory"]) + to_bytes(kubelet["evictionHard"]["memory.available"])
    assert {r["numaNode"] for r in kubelet["reservedMemory"]} == {n.id for n in machine.cpu_nodes}
    # reservedSystemCPUs: exactly one whole core (every sibling) per NUMA node
    system = parse_list(kubelet["reservedSystemCPUs"])
    cores = [core for core in machine.cores if set(core.cpus) & system]
    assert set().union(*(set(core.cpus) for core in cores)) == system
    assert sorted(core.node for core in cores) == sorted(n.id for n in machine.cpu_nodes)


def pod_config(by_kind) -> dict:
    (cm,) = by_kind["ConfigMap"]
    return yaml.safe_load(cm["data"]["vsup.yaml"])


def test_two_socket_smt_xeon():
    machine = make_machine(sockets=2, cores_per_node=16, smt=2, node_memory=128 * GIB)
    shape, result = export(machine, "model: /models/qwen\nplacement:\n  model_size_gib: 15\n")
    by_kind = check_objects(result)
    check_guaranteed_and_kubelet(by_kind, result, machine, smt=2)
    c = container(by_kind)
    # 16 cores - 1 for the kubelet = 30 CPUs; memory: 126 GiB allocatable - 1 GiB /dev/shm - 2 GiB
    # vsup's reserve leaves 123 GiB: KV cache 123 - 15 - 1.5 -> 106 GiB; asked: 106 + 16.5 + 1 + 2
    assert c["resources"]["limits"] == {"cpu": "30", "memory": "128512Mi"}
    assert to_bytes("128512Mi") == int(125.5 * GIB)
    assert result.kubelet["reservedSystemCPUs"] == "0,16,32,48"
    assert result.kubelet["reservedMemory"] == [{"numaNode": 0, "limits": {"memory": "2Gi"}}, {"numaNode": 1, "limits": {"memory": "2Gi"}}]
    assert result.kubelet["systemReserved"] == {"memory": "3996Mi"}
    sts = by_kind["StatefulSet"][0]
    assert sts["spec"]["replicas"] == 2
    config = pod_config(by_kind)
    assert config["instances"] == 1 and config["placement"]["kvcache_gib"] == 106 and config["placement"]["model_size_gib"] == 15
    assert config["proxy"]["host"] == "0.0.0.0" and config["placement"]["launcher"] == "numactl"
    parse_config(by_kind["ConfigMap"][0]["data"]["vsup.yaml"])
    (inst,) = shape.plan.instances
    assert len(inst.omp_cpus) == 14 and len(shape.plan.reserved_cpus) == 2  # vsup keeps one core of the pod
    # the rest of the pod: /dev/shm, probes, SYS_NICE, the stop timeout, the model, the image
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["model"]["hostPath"] == {"path": "/models/qwen", "type": "Directory"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "SYS_NICE" in c["securityContext"]["capabilities"]["add"]
    assert c["args"] == ["run", "--config", "/etc/vsup/vsup.yaml"] and c["image"] == "registry.example/vsup:test"
    # preStop 5 s + proxy.drain_timeout 30 + stop.timeout 30 + 5
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 70
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # no front here, so no Batch API: the pods have it off, and the summary says how to get it
    assert config["batch"] == {"enabled": False}
    assert "No Batch API here" in result.manifests_text and "export a fleet" in result.manifests_text


def test_epyc_nps4_two_instances_per_pod():
    machine = make_machine(sockets=1, nodes_per_socket=4, cores_per_node=24, smt=2, l3_per_node=3, node_memory=96 * GIB)
    shape, result = export(machine, "model: org/model\ninstances: 8\nplacement:\n  model_size_gib: 4\n", hosts=3)
    by_kind = check_objects(result)
    check_guaranteed_and_kubelet(by_kind, result, machine, smt=2)
    # 23 cores = 46 CPUs; inside: one core for vsup, 11 + 11 for two instances; KV: (94 - 1 - 2) / 2
    # - 4 - 1.5 = 40 GiB; the pod asks 2 × 45.5 + 1 + 2 = 94 GiB: all the node leaves
    assert container(by_kind)["resources"]["limits"] == {"cpu": "46", "memory": "94Gi"}
    assert [len(i.omp_cpus) for i in shape.plan.instances] == [11, 11]
    assert {i.kvcache_bytes for i in shape.plan.instances} == {40 * GIB}
    assert pod_config(by_kind)["instances"] == 2
    assert by_kind["StatefulSet"][0]["spec"]["replicas"] == 12  # 4 per host × 3 hosts
    assert result.kubelet["reservedSystemCPUs"] == "0,24,48,72,96,120,144,168"
    assert "model" not in {v["name"] for v in by_kind["StatefulSet"][0]["spec"]["template"]["spec"]["volumes"]}  # a hub name


def test_sub_numa_clustering_uneven_nodes_size_every_pod_for_the_smallest():
    machine = make_machine(sockets=2, nodes_per_socket=3, cores_per_node=[43, 43, 42, 43, 43, 42], smt=2, node_memory=80 * GIB)
    shape, result = export(machine, "model: /m\nplacement:\n  model_size_gib: 15\n", replicas_per_host="4")
    by_kind = check_objects(result)
    check_guaranteed_and_kubelet(by_kind, result, machine, smt=2)
    # the 42-core node less its system core: 82 CPUs; KV (78 - 1 - 2) - 16.5 -> 58 GiB
    assert container(by_kind)["resources"]["limits"] == {"cpu": "82", "memory": f"{int(77.5 * 1024)}Mi"}
    assert shape.plan.instances[0].kvcache_bytes == 58 * GIB
    assert by_kind["StatefulSet"][0]["spec"]["replicas"] == 4
    assert len(parse_list(result.kubelet["reservedSystemCPUs"])) == 12  # 6 nodes × 2 threads


def test_hybrid_part_keeps_openmp_on_performance_cores(tmp_path):
    machine = read_machine(build_sysfs(tmp_path, hybrid=(8, 16)), live=False)  # 8 P-cores × 2 threads, 16 E-cores
    shape, result = export(machine, "model: /m\nplacement:\n  model_size_gib: 2\n")
    by_kind = check_objects(result)
    check_guaranteed_and_kubelet(by_kind, result, machine, smt=2)
    system = parse_list(result.kubelet["reservedSystemCPUs"])
    assert [core.kind for core in machine.cores if set(core.cpus) & system] == [EFFICIENCY]
    # 32 CPUs - the E-core for the system = 31, even for full-pcpus-only: 30 (8 P-cores + 14 E-cores)
    c = container(by_kind)
    assert c["resources"]["limits"]["cpu"] == "30"
    (inst,) = shape.plan.instances
    p_cpus = {cpu for core in machine.cores if core.kind != EFFICIENCY for cpu in core.cpus}
    assert len(inst.omp_cpus) == 8 and set(inst.omp_cpus) <= p_cpus
    # KV: (16 - 2 - 1 - 2) - 2 - 1.5 -> 7 GiB; the pod asks 7 + 3.5 + 1 + 2
    assert inst.kvcache_bytes == 7 * GIB and c["resources"]["limits"]["memory"] == f"{int(13.5 * 1024)}Mi"
    assert any("hybrid CPU" in w for w in shape.warnings)
    assert "# warning: hybrid CPU" in result.manifests_text


def test_api_key_goes_to_a_secret_not_the_config_map():
    machine = make_machine(sockets=2, cores_per_node=8, smt=2)
    _, result = export(machine, "model: /m\nplacement:\n  model_size_gib: 2\nproxy:\n  api_key: s3cret\n  port: 9000\n")
    by_kind = check_objects(result)
    assert "s3cret" not in result.manifests_text
    assert container(by_kind)["env"] == [{"name": "VSUP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "vsup-api-key", "key": "api-key"}}}]
    assert container(by_kind)["ports"][0]["containerPort"] == 9000
    assert by_kind["Service"][0]["spec"]["ports"][0]["port"] == 9000


def test_named_keys_come_from_a_secret_by_environment_never_the_config_map():
    machine = make_machine(sockets=2, cores_per_node=8, smt=2)
    _, result = export(machine, "model: /m\nplacement:\n  model_size_gib: 2\nproxy:\n  api_key: s3cret\n  api_keys:\n"
                                "    - {name: team-a, key: t3am-a-s3cret, priority: 5, requests_per_minute: 60}\n"
                                "    - {name: ci, key_env: CI_KEY}\n")
    by_kind = check_objects(result)  # the env entries are valid for every Kubernetes version tested
    assert "t3am-a-s3cret" not in result.manifests_text and "s3cret" not in result.manifests_text
    assert container(by_kind)["env"] == [
        {"name": "VSUP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "vsup-api-key", "key": "api-key"}}},
        {"name": "VSUP_KEY_TEAM_A", "valueFrom": {"secretKeyRef": {"name": "vsup-api-keys", "key": "VSUP_KEY_TEAM_A"}}},
        {"name": "CI_KEY", "valueFrom": {"secretKeyRef": {"name": "vsup-api-keys", "key": "CI_KEY"}}},
    ]
    (config_map,) = by_kind["ConfigMap"]
    pod_cfg = parse_config(config_map["data"]["vsup.yaml"])  # vsup inside reads each key from its variable
    assert [(k.name, k.key, k.key_env, k.priority, k.requests_per_minute) for k in pod_cfg.proxy.api_keys] == \
        [("team-a", None, "VSUP_KEY_TEAM_A", 5, 60), ("ci", None, "CI_KEY", 0, None)]
    assert "kubectl create secret generic vsup-api-keys --from-literal=VSUP_KEY_TEAM_A=... --from-literal=CI_KEY=..." \
        in result.manifests_text


@pytest.mark.parametrize("keys, message", [
    ("    - {name: a.b, key: x}\n    - {name: A-B, key: y}\n",
     "proxy.api_keys[1]: the keys 'a.b' (proxy.api_keys[0]) and 'A-B' would both be carried by the environment variable "
     "VSUP_KEY_A_B; give one of them its own key_env"),
    ("    - {name: a, key_env: 'MY KEY'}\n", "proxy.api_keys[0].key_env: 'MY KEY' is not an environment variable"),
])
def test_keys_that_cannot_each_have_a_variable_are_one_line(tmp_path, keys, message):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8), smt=2, packages=2)
    (tmp_path / "vsup.yaml").write_text("model: /m\nplacement:\n  model_size_gib: 1\nproxy:\n  api_keys:\n" + keys)
    for kind in ("kubernetes", "slurm"):
        result = vsup("export", kind, "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root), "-o", str(tmp_path / kind))
        assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_pod_config_plans_the_same_inside_the_pod(tmp_path):
    """What vsup inside a pod will do: the ConfigMap's config, planned on the 2-socket machine seen
    through the pod's cgroup (30 CPUs of node 1, memory of node 1, memory.max = the pod's limit)."""
    host = build_sysfs(tmp_path / "host", nodes=(16, 16), smt=2, packages=2, node_memory=128 * GIB)
    config = tmp_path / "vsup.yaml"
    config.write_text("model: /models/qwen\nplacement:\n  model_size_gib: 15\n")
    out = tmp_path / "out"
    result = vsup("export", "kubernetes", "--config", str(config), "--fsroot", str(host), "-o", str(out))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all((out / "vsup.yaml").read_text()))
    pod_yaml = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["vsup.yaml"]
    limits = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    (tmp_path / "pod.yaml").write_text(pod_yaml)
    # cores 17-31 of node 1 and their siblings: what the CPU manager may hand the pod
    cpus = format_list([*range(17, 32), *range(49, 64)])
    assert len(parse_list(cpus)) == int(limits["cpu"])
    pod = add_memory_limit(build_sysfs(tmp_path / "pod", nodes=(16, 16), smt=2, packages=2, node_memory=128 * GIB,
                                       cpuset=cpus, cpuset_mems="1"), to_bytes(limits["memory"]))
    result = vsup("plan", "--config", str(tmp_path / "pod.yaml"), "--fsroot", str(pod), "--format", "json")
    assert result.returncode == 0, result.stderr
    inside = json.loads(result.stdout)
    (inst,) = inside["instances"]
    assert inst["nodes"] == [1] and len(inst["omp_cpus"]) == 14 and inst["kvcache_bytes"] == 106 * GIB
    limit = inside["memory_limit"]
    assert limit["limit_bytes"] == to_bytes(limits["memory"]) and limit["demand_bytes"] <= limit["budget_bytes"]
    assert (out / "kubelet-config.yaml").read_text().startswith("---\n# Kubelet configuration")


@pytest.mark.parametrize(
    "config, args, message",
    [
        ("instances: 3\n", (), "instances: 3 do not split evenly over NUMA nodes (node 0: 2, node 1: 1)"),
        ("instances: 1\n", (), "instances: instance 0 spans NUMA nodes 0,1, but a pod takes one node's share"),
        ("", ("--replicas-per-host", "3"), "--replicas-per-host 3: a pod takes one NUMA node's share and this machine has 2 node(s)"),
        ("", ("--replicas-per-host", "many"), "--replicas-per-host 'many': expected a whole number of pods per host, or auto"),
        ("proxy:\n  port: 0\n", (), "proxy.port: 0 picks a free port at start"),
        ("placement:\n  kvcache_gib: 58\n", (), "cannot hold 1 instance(s): cgroup memory limit: 1 × (2 GiB weights + 58 GiB KV"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, config, args, message):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8), smt=2, packages=2, node_memory=64 * GIB)
    path = tmp_path / "vsup.yaml"
    text = "model: /m\n" + config
    text = text.replace("placement:\n", "placement:\n  model_size_gib: 2\n") if "placement:" in text else text + "placement:\n  model_size_gib: 2\n"
    path.write_text(text)
    result = vsup("export", "kubernetes", "--config", str(path), "--fsroot", str(root), *args)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith("vsup: error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_model_size_is_named(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8), smt=2, packages=2)
    (tmp_path / "vsup.yaml").write_text("model: org/some-model\n")
    result = vsup("export", "kubernetes", "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root))
    assert result.returncode == 2
    assert "placement.model_size_gib: the model's size is unknown (org/some-model" in result.stderr


@pytest.mark.parametrize("name", ["My-App", "vsup llm", "a/b", "vsup-", "-vsup", "1vsup", "x" * 53, "x" * 300, "vsup\nkind: Pod", ""])
def test_a_name_kubernetes_would_refuse_is_one_line_naming_name(tmp_path, name):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8), smt=2, packages=2, node_memory=64 * GIB)
    (tmp_path / "vsup.yaml").write_text("model: /m\nplacement:\n  model_size_gib: 2\n")
    result = vsup("export", "kubernetes", "--config", str(tmp_path / "vsup.yaml"), "--fsroot", str(root), "--name", name)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith(f"vsup: error: --name {name!r}: a Kubernetes name: lowercase letters") \
        and result.stderr.count("\n") == 1, result.stderr


def test_the_longest_name_allowed_makes_names_and_labels_kubernetes_takes():
    name = "v" + "-x" * 25 + "9"  # 52 characters
    cfg = parse_config("model: /m\nplacement:\n  model_size_gib: 2\n")
    settings = settings_from_config(cfg, numactl_available=True)
    machine = node_type(make_machine(sockets=2, cores_per_node=8, node_memory=64 * GIB))
    shape = shape_pod(machine, plan(machine, settings), cfg, settings, shm_bytes=GIB)
    result = export_kubernetes(machine, shape, cfg, name=name, image="i", replicas_per_host="auto", hosts=1)
    label = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
    dns1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
    for obj in result.objects:
        meta = obj["metadata"]["name"]
        assert label.fullmatch(meta) and len(meta) <= 63, meta
        if obj["kind"] == "Service":
            assert dns1035.fullmatch(meta), meta
        if obj["kind"] == "StatefulSet":
            # the pods' controller-revision-hash label is NAME-<10-character hash>, a label value (<= 63)
            assert len(f"{meta}-{'h' * 10}") <= 63
