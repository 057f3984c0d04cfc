"""`vsup export kubernetes` of a fleet (issue 21): a StatefulSet per model, each pod's vsup.yaml a
single-model config of that model, one front `vsup proxy` routing by model to every pod; every
object validated offline against the Kubernetes schemas; names that cannot fit refused in one line."""

from __future__ import annotations

from dataclasses import replace

import yaml

from tests.machines import make_machine
from tests.sysfs_builder import GIB, build_sysfs
from tests.test_export_kubernetes import check_guaranteed_and_kubelet, check_objects
from tests.test_plan_cli import vsup
from vsup.cli.proxy import build_pool, model_configs
from vsup.config.fleet import models_of
from vsup.config.planning import settings_from_config
from vsup.config.schema import parse_config
from vsup.export.fleet import model_slug
from vsup.export.kubernetes_fleet import export_kubernetes_fleet, memory_share, shape_models
from vsup.export.pod import node_type
from vsup.topology.fleet import merge, plan_fleet, restricted
from vsup.topology.plan_model import FleetModel
from vsup.topology.planner import plan

FLEET = """\
proxy: {port: 9000, api_key: s3cret, api_keys: [{name: team-a, key: t3am-a-s3cret, priority: 5}]}
vllm: {args: [--dtype, bfloat16]}
models:
  - model: /srv/models/chat
    served_model_name: chat
    instances: 2
    placement: {model_size_gib: 8, nodes: [0, 1]}
    proxy: {policy: prefix_affinity}
  - model: /srv/models/embed
    served_model_name: Org/Embed_v2
    instances: 2
    placement: {model_size_gib: 1, nodes: [2, 3]}
    vllm: {args: [--runner, pooling]}
"""


KEY_ENV = [{"name": "VSUP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "vsup-api-key", "key": "api-key"}}},
           {"name": "VSUP_KEY_TEAM_A", "valueFrom": {"secretKeyRef": {"name": "vsup-api-keys", "key": "VSUP_KEY_TEAM_A"}}}]


def export(machine, text: str = FLEET, *, name="vsup", hosts=1, replicas_per_host="auto"):
    cfg = parse_config(text)
    machine = node_type(machine)
    views = models_of(cfg)
    settings = {v.name: settings_from_config(v.config, numactl_available=True) for v in views}
    fleet_plan = plan_fleet(machine, [FleetModel(v.name, settings[v.name], v.share) for v in views])
    shapes = shape_models(machine, fleet_plan, views, settings, shm_bytes=GIB)
    return fleet_plan, shapes, export_kubernetes_fleet(machine, shapes, cfg, name=name, image="registry.example/vsup:t",
                                                       replicas_per_host=replicas_per_host, hosts=hosts)


def test_a_statefulset_per_model_and_a_front_that_routes_by_model():
    machine = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=16, smt=2, node_memory=128 * GIB)
    fleet_plan, shapes, result = export(machine, hosts=2)
    by_kind = check_objects(result)
    sets = {s["metadata"]["name"]: s for s in by_kind["StatefulSet"]}
    assert sorted(sets) == ["vsup-chat", "vsup-org-embed-v2"]
    configs = {c["metadata"]["name"]: c for c in by_kind["ConfigMap"]}
    for model, sts in (("chat", "vsup-chat"), ("Org/Embed_v2", "vsup-org-embed-v2")):
        spec = sets[sts]["spec"]
        (c,) = spec["template"]["spec"]["containers"]
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert requests == limits  # Guaranteed, as the single-model pods
        assert spec["serviceName"] == f"{sts}-pods" and spec["replicas"] == 2 * 2  # its 2 nodes × 2 hosts
        # each pod's vsup.yaml: a single-model config of that model alone
        text = configs[f"{sts}-config"]["data"]["vsup.yaml"]
        pod_cfg = parse_config(text)
        assert pod_cfg.models is None and pod_cfg.served_model_name == model and pod_cfg.instances == 1
        assert "s3cret" not in text and pod_cfg.proxy.api_keys[0].key_env == "VSUP_KEY_TEAM_A"
        assert c["env"] == KEY_ENV  # the same Secrets for every model
    assert parse_config(configs["vsup-chat-config"]["data"]["vsup.yaml"]).proxy.policy == "prefix_affinity"
    assert parse_config(configs["vsup-org-embed-v2-config"]["data"]["vsup.yaml"]).vllm.args == ["--runner", "pooling"]
    # the front: one upstream per pod, named by its model, through each model's headless Service
    (front,) = by_kind["Deployment"]
    (fc,) = front["spec"]["template"]["spec"]["containers"]
    ups = [fc["args"][i + 1] for i, a in enumerate(fc["args"]) if a == "--upstream"]
    assert ups == [f"chat=http://vsup-chat-{i}.vsup-chat-pods:9000" for i in range(4)] + \
        [f"Org/Embed_v2=http://vsup-org-embed-v2-{i}.vsup-org-embed-v2-pods:9000" for i in range(4)]
    pool = build_pool(tuple(ups))
    front_cfg = parse_config(configs["vsup-config"]["data"]["front.yaml"], require_model=False)
    # the front checks the keys, from the same Secrets, and passes the client's on: the pods check it too
    assert "s3cret" not in configs["vsup-config"]["data"]["front.yaml"] and fc["env"] == KEY_ENV
    assert fc["args"][:2] == ["proxy", "--forward-key"] and front_cfg.proxy.api_keys[0].key_env == "VSUP_KEY_TEAM_A"
    assert "s3cret" not in result.manifests_text
    assert {m: c.policy for m, c in model_configs(pool, front_cfg.proxy, front_cfg).items()} == \
        {"chat": "prefix_affinity", "Org/Embed_v2": "round_robin"}
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    assert sorted(services) == ["vsup", "vsup-chat-pods", "vsup-org-embed-v2-pods"]
    assert services["vsup"]["spec"]["selector"] == front["spec"]["template"]["metadata"]["labels"]
    for sts in sets.values():  # the clients' Service reaches the front only, never a model's pod directly
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert not set(services["vsup"]["spec"]["selector"].items()) <= set(labels.items())
        assert services[f"{sts['metadata']['name']}-pods"]["spec"]["publishNotReadyAddresses"] is True
    check_guaranteed_and_kubelet({"StatefulSet": [sets["vsup-chat"]]}, result, node_type(machine), smt=2)


def test_the_front_holds_the_batch_store_on_a_claim_and_one_front_writes_it_at_a_time():
    machine = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=16, smt=2, node_memory=128 * GIB)
    _, _, result = export(machine, FLEET + "batch: {max_total_bytes: 8GiB, priority: -5}\n")
    by_kind = check_objects(result)  # (the claim too: validated against the schemas)
    (claim,) = by_kind["PersistentVolumeClaim"]
    # 8 GiB of files and results, a quarter more for SQLite's log and an upload in progress
    assert claim["metadata"]["name"] == "vsup-batches"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}
    (front,) = by_kind["Deployment"]
    spec = front["spec"]["template"]["spec"]
    (fc,) = spec["containers"]
    assert front["spec"]["strategy"] == {"type": "Recreate"}  # never two fronts on one store (its lock)
    mounts = {m["name"]: m["mountPath"] for m in fc["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["batches"]["persistentVolumeClaim"] == {"claimName": "vsup-batches"}
    batch_dir = fc["args"][fc["args"].index("--batch-dir") + 1]
    assert batch_dir.startswith(mounts["batches"] + "/")  # a folder vsup makes 0700 inside the volume
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
    # the front's batch keys: the user's, but not enabled/dir; its share of a pod: a pod's instances' slots
    configs = {c["metadata"]["name"]: c for c in by_kind["ConfigMap"]}
    front_cfg = parse_config(configs["vsup-config"]["data"]["front.yaml"], require_model=False)
    assert front_cfg.batch.priority == -5 and front_cfg.batch.max_total_bytes == "8GiB"
    assert front_cfg.batch.slots_per_instance == 128 and front_cfg.batch.dir is None
    # the pods have their own Batch API off: the front's lines reach them marked as batch lines
    for name in ("vsup-chat-config", "vsup-org-embed-v2-config"):
        assert parse_config(configs[name]["data"]["vsup.yaml"]).batch.enabled is False


def test_a_fleet_without_the_batch_api_has_no_claim_and_no_store():
    machine = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=16, smt=2, node_memory=128 * GIB)
    _, _, result = export(machine, FLEET + "batch: {enabled: false}\n")
    by_kind = check_objects(result)
    assert "PersistentVolumeClaim" not in by_kind
    (front,) = by_kind["Deployment"]
    assert "--batch-dir" not in front["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "strategy" not in front["spec"]


def test_a_model_sharing_a_node_gets_its_cpus_and_its_part_of_the_memory():
    # 2 nodes × 8 cores, a partition made by hand: chat on node 0 and 2 cores of node 1, embed on the other 6
    machine = node_type(make_machine(sockets=2, cores_per_node=8, smt=1, node_memory=64 * GIB))
    cfg = parse_config(FLEET.replace(", nodes: [0, 1]", "").replace(", nodes: [2, 3]", "").replace("instances: 2", "instances: 1"))
    views = models_of(cfg)
    settings = {v.name: replace(settings_from_config(v.config, numactl_available=True), reserve_cores=0) for v in views}
    cores = [c.cpus[0] for c in machine.cores]
    chat = FleetModel("chat", replace(settings["chat"], instances=2), None)
    embed = FleetModel("Org/Embed_v2", settings["Org/Embed_v2"], None)
    fleet_plan = merge([(chat, plan(restricted(machine, frozenset(cores[:10])), chat.settings)),
                        (embed, plan(restricted(machine, frozenset(cores[10:])), embed.settings))])
    shapes = shape_models(machine, fleet_plan, views, settings, shm_bytes=GIB)
    result = export_kubernetes_fleet(machine, shapes, cfg, name="vsup", image="i", replicas_per_host="1", hosts=1)
    check_objects(result)
    pod = next(s for v, s in shapes if v.name == "Org/Embed_v2")
    assert set(pod.machine.cpus_usable) == set(cores[10:])  # its 6 cores of node 1, not the node's 7 (less the system core)
    part = memory_share(fleet_plan, "Org/Embed_v2")
    assert 0 < part < 1
    # its pod asks at most its part of what node 1 leaves after the reserve
    assert pod.memory_bytes - pod.shm_bytes - 2 * GIB <= part * (64 - 2) * GIB


def test_slugs_are_dns_labels():
    assert model_slug("Org/Embed_v2") == "org-embed-v2"
    assert model_slug("--Llama 3.1 (8B)--") == "llama-3-1-8b"


def test_a_statefulset_name_that_cannot_fit_names_the_model_and_name(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8, 8, 8), smt=2, packages=2, node_memory=64 * GIB)
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    name = "v" + "x" * 40  # fine alone (41), but vsup-org-embed-v2's slug adds 13
    result = vsup("export", "kubernetes", "--config", str(path), "--fsroot", str(root), "--name", name)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith("vsup: error: models[1]: the StatefulSet of model 'Org/Embed_v2' would be") \
        and "give a shorter --name (at most 39 here)" in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_two_models_of_one_slug_are_refused(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8, 8, 8), smt=2, packages=2, node_memory=64 * GIB)
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET.replace("Org/Embed_v2", "CHAT"))
    result = vsup("export", "kubernetes", "--config", str(path), "--fsroot", str(root))
    assert result.returncode == 2
    assert "models[1]: models 'chat' and 'CHAT' would both be the StatefulSet 'vsup-chat'" in result.stderr, result.stderr


def test_the_cli_writes_the_fleet_and_the_front_config_loads(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8, 8, 8), smt=2, packages=2, node_memory=64 * GIB)
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    result = vsup("export", "kubernetes", "--config", str(path), "--fsroot", str(root), "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all((tmp_path / "out" / "vsup.yaml").read_text()))
    assert [d["kind"] for d in docs].count("StatefulSet") == 2 and [d["kind"] for d in docs].count("Deployment") == 1


def test_a_model_whose_instances_span_nodes_is_named_by_its_key(tmp_path):
    root = build_sysfs(tmp_path / "m", nodes=(8, 8, 8, 8), smt=2, packages=2, node_memory=64 * GIB)
    path = tmp_path / "fleet.yaml"
    # chat: 1 instance of 12 cores, more than a node of 8 holds: it spans the 2 nodes it is given
    path.write_text(FLEET.replace("instances: 2", "instances: 1", 1).replace("nodes: [0, 1]}", "nodes: [0, 1], cores_per_instance: 12}", 1))
    result = vsup("export", "kubernetes", "--config", str(path), "--fsroot", str(root))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("vsup: error: models[0].instances: instance 0 spans NUMA nodes 0,1"), result.stderr
