"""An sbatch script for vsup, from a machine's plan. Pure: plan and config in, script text out.

On every host of the job, one `srun` step per NUMA node runs `vsup run` with that node's
instances, bound by an explicit CPU mask from the plan (`--cpu-bind=mask_cpu:` — the CPUs of the
node's instances; Slurm refuses `--hint=nomultithread` next to an explicit binding, and vsup
already runs one OpenMP thread per core) and `--mem-bind=local`; vsup inside plans within that
mask. One more step on the first host runs the front proxy (`vsup proxy`), on the core the plan
reserved, in front of every per-node vsup of every host, weighted by their ready instances: the
two-level layout (clients -> front proxy -> per-node vsup -> instances).

Each step's configuration is written by the script itself (a heredoc), so the script is the only
file to submit. No key is in it nor in those configurations (the folder is shared): they name the
environment variable of each key (export/keys.py), which sbatch and srun pass on. Each host's pid
files and instance logs go to a node-local folder made by `mktemp -d` (0700, a name no other user
can take first), whose path the script keeps in the shared folder for that host's steps.

The front holds the Batch API's store (`--batch-dir`, a folder that outlives the job, so a
resubmitted job resumes its batches) and spreads the lines over the per-node vsups, which place
them below their interactive requests (`X-Vsup-Batch: line`); their own Batch API is off.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from vsup.config.fleet import is_fleet, models_of
from vsup.config.schema import VsupConfig, parse_config
from vsup.errors import VsupError
from vsup.export import keys, yamltext
from vsup.export.fleet import front_batch, front_config_text, front_proxy, model_slug, upstream_slots
from vsup.export.pod import instances_per_node, share_config
from vsup.topology.cpulist import format_list
from vsup.topology.model import Machine
from vsup.topology.plan_model import InstancePlan, Plan, format_gib

JOB_ID = "${SLURM_JOB_ID}"  # expanded by the script when it writes the step configurations
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HEREDOC_END = "VSUP_EOF"


def cpu_mask(cpus) -> str:
    """A CPU set as Slurm's mask_cpu takes it: one hex number."""
    return hex(sum(1 << cpu for cpu in cpus))


def _heredoc(path: str, text: str) -> str:
    """`cat > path` of `text`, in an unquoted heredoc (so ${SLURM_JOB_ID} expands): the text's own
    backslashes, dollars and backticks are escaped and stay literal."""
    if HEREDOC_END in text.splitlines():  # (YAML indents or quotes it; never end the heredoc early)
        raise VsupError(f"a configuration value is a line {HEREDOC_END!r}, which would end the script's heredoc")
    escaped = text.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`").replace("\\${SLURM_JOB_ID}", JOB_ID)
    return f"cat > {path} <<{HEREDOC_END}\n{escaped}{HEREDOC_END}\n"


def check_job_name(job_name: str) -> str:
    """The job's name, as the script can carry it unquoted on its `#SBATCH` line: a newline would
    end that line (and start a shell one), a space or a quote would be read by sbatch's own
    parsing, a leading dash as an option."""
    if not JOB_NAME.fullmatch(job_name):
        raise VsupError(f"--job-name {job_name!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a letter "
                        "or digit, e.g. vsup-llama")
    return job_name


# This host's node-local folder, as the setup step recorded it in the shared one ($1: "$CONF/local").
LOCAL = 'd=$(cat "$1/$SLURMD_NODENAME")'


def _local_folders(hosts: int) -> list[str]:
    """A step on every host that makes its node-local folder: `mktemp -d` (0700, a name no other
    user can take first, unlike a fixed /tmp/vsup-<job id>), recorded by host name."""
    return [
        "# Each host's node-local folder for its vsups' pid files and instance logs: mktemp -d (0700, a name",
        "# no other user can take first), its path kept in $CONF/local/<host> for that host's steps.",
        'mkdir -p "$CONF/local"',
        f"srun --nodes={hosts} --ntasks-per-node=1 --overlap --cpu-bind=none --job-name=vsup-local \\",
        """     bash -c 'd=$(mktemp -d "/tmp/vsup-$SLURM_JOB_ID.XXXXXXXX") && mkdir "$d/pids" && echo "$d" >"$1/$SLURMD_NODENAME"' \\""",
        '     vsup-local "$CONF/local"',
        "",
    ]


# Each vsup step records its pid in the host's node-local folder, so that the trap can signal vsup alone.
def _step(name: str) -> str:
    """The words before a step's vsup command: record its pid in the host's node-local folder and
    keep its instance logs there (LOGS_DIRECTORY: log.dir's default), then exec it."""
    return (f"""bash -c '{LOCAL} && echo $$ >"$d/pids/$2.pid" && LOGS_DIRECTORY="$d/$2" exec "${{@:3}}"'"""
            f' vsup-step "$CONF/local" {name}')


def _stop_trap(drain_s: int) -> list[str]:
    """The batch shell's TERM trap: TERM to each host's vsups, by pid (not to the steps: under
    proctrack/linuxproc a step's signal reaches every process of it, the vLLM instances too, and
    in-flight requests fail); `wait` in the script's last line then lets them drain."""
    return [
        "# Stop: `scancel --batch --signal=TERM $SLURM_JOB_ID` (under any ProctrackType), the time limit",
        f"# (--signal above: TERM {drain_s + 30} s before it), or a plain scancel (drains under proctrack/cgroup only)",
        "# TERM this shell: it forwards TERM to each vsup of every host, which drains and stops its",
        f"# instances within proxy.drain_timeout + stop.timeout = {drain_s} s (keep the cluster's KillWait above that).",
        "stop_vsups() {",
        "    echo \"vsup: TERM: draining every host's vsup\" >&2",
        '    srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpu-bind=none --job-name=vsup-stop \\',
        f"         bash -c '{LOCAL} && for f in \"$d\"/pids/*.pid; do kill -TERM \"$(cat \"$f\")\" || true; done' \\",
        '         vsup-stop "$CONF/local" || true',
        "}",
        "trap stop_vsups TERM",
        "",
    ]


@dataclass(frozen=True)
class Step:
    """One `vsup run` step on every host: some instances of one model, on their CPUs."""

    name: str  # its config file, log folder and pid file: node0, chat-node0
    title: str  # for the comments: "NUMA node 0", "model 'chat', NUMA node 0"
    cfg: VsupConfig  # the single-model configuration it runs (a fleet: the model's view)
    instances: tuple[InstancePlan, ...]
    model: str = ""  # a fleet's model name: the front's upstream says it


def _steps(host_plan: Plan, cfg: VsupConfig) -> tuple[Step, ...]:
    """Single model: one step per NUMA node. A fleet: one per model and NUMA node(s) its instances
    are on (its share of that node), in the plan's order."""
    if not is_fleet(cfg):
        nodes, _ = instances_per_node(host_plan)
        return tuple(Step(f"node{n}", f"NUMA node {n}", cfg, tuple(i for i in host_plan.instances if i.cpu_nodes == (n,)))
                     for n in nodes)
    steps = []
    for view in models_of(cfg):
        groups: dict[tuple[int, ...], list[InstancePlan]] = {}
        for inst in host_plan.of_model(view.name):
            groups.setdefault(inst.cpu_nodes, []).append(inst)
        for nodes, insts in groups.items():
            where_ = "-".join(map(str, nodes))
            steps.append(Step(f"{model_slug(view.name) or f'model{view.position}'}-node{where_}",
                              f"model {view.name!r} ({view.key}), NUMA node(s) {format_list(nodes)}", view.config,
                              tuple(insts), view.name))
    return tuple(steps)


def export_slurm(machine: Machine, host_plan: Plan, cfg: VsupConfig, *, hosts: int, job_name: str) -> str:
    check_job_name(job_name)
    steps = _steps(host_plan, cfg)
    if cfg.proxy.port == 0:
        raise VsupError("proxy.port: 0 picks a free port at start, but the per-node vsups need fixed ones; give a port, e.g. 8000")
    if cfg.proxy.port + len(steps) > 65535:
        raise VsupError(f"proxy.port {cfg.proxy.port}: the per-node vsups listen on the {len(steps)} ports after it, past 65535")
    drain_s = round(cfg.proxy.drain_timeout + cfg.stop.timeout)
    if drain_s + 30 > 65535:  # sbatch --signal takes at most 65535 s before the time limit
        raise VsupError(f"proxy.drain_timeout + stop.timeout = {drain_s} s: the job's stop signal (sbatch --signal, "
                        "that + 30 s before the time limit) allows at most 65505 s in all; give shorter timeouts")
    summary = _summary(machine, host_plan, cfg, steps, hosts) if not is_fleet(cfg) else _fleet_summary(machine, cfg, steps, hosts)
    lines = ["#!/bin/bash"]
    lines += [f"# {line}".rstrip() for line in summary.splitlines()]
    lines += [
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={hosts}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        f"#SBATCH --signal=B:TERM@{drain_s + 30}",
        "set -euo pipefail",
        "",
        *_stop_trap(drain_s),
        'VSUP="${VSUP:-vsup}"  # vsup as installed on the hosts (best: in the venv of vLLM\'s CPU build)',
        'CONF="${VSUP_CONF_DIR:-$PWD/vsup-$SLURM_JOB_ID}"  # on a filesystem every host sees',
        'mkdir -p "$CONF"',
        "",
    ]
    lines += _key_checks(cfg)
    lines += _local_folders(hosts)
    step_ports = []
    for position, step in enumerate(steps):
        insts = step.instances
        port = cfg.proxy.port + 1 + position
        step_ports.append(port)
        config = share_config(step.cfg, len(insts), insts[0].weights_bytes, insts[0].kvcache_bytes, {
            "placement": {"reserve_cores": 0},  # the step's mask holds its instances' CPUs only
            "vllm": {"base_port": insts[0].port},
            "proxy": {"port": port},
            # the steps of a host share its state folder, and clients reach them through the front:
            # batches are the front's to hold, not each step's
            "batch": {"enabled": False},
        })
        # the node-local folder's: LOGS_DIRECTORY (_step) and the default socket
        for section, key in (("log", "dir"), ("control", "socket")):
            config.get(section, {}).pop(key, None)
        text = yamltext.comment(f"vsup for {step.title} of every host: {len(insts)} instance(s), proxy on port {port}") + yamltext.dump(config)
        parse_config(text.replace(JOB_ID, "1"), f"the step configuration of {step.title}")
        cpus = sorted(cpu for i in insts for cpu in i.cpus)
        lines.append(f"# {step.title}: CPUs {format_list(cpus)}, instances {', '.join(str(i.index) for i in insts)} of the plan")
        lines.append(_heredoc(f'"$CONF/{step.name}.yaml"', text).rstrip("\n"))
        lines.append(
            f"srun --nodes={hosts} --ntasks-per-node=1 --overlap --cpu-bind=verbose,mask_cpu:{cpu_mask(cpus)} --mem-bind=verbose,local \\\n"
            f'     --job-name=vsup-{step.name} {_step(step.name)} "$VSUP" run --config "$CONF/{step.name}.yaml" &'
        )
        lines.append("")

    batch = front_batch(cfg, max(upstream_slots(step.cfg, len(step.instances), cfg) for step in steps)) if cfg.batch.enabled else None
    if is_fleet(cfg):
        front_text = front_config_text(cfg, "the front proxy: every model's vsups of every host behind one endpoint, by the "
                                            "request's model", batch)
        loop = [f"    upstreams+=(--upstream {shlex.quote(step.model + '=')}\"http://$host:{port}\")"
                for step, port in zip(steps, step_ports, strict=True)]
        weighting = "# The front proxy, on the first host (on the core the plan reserved), routing by the request's model to\n" \
                    "# that model's vsups, weighting each by the instances its /ready reports (0: out of rotation)."
    else:
        front = {"proxy": {**front_proxy(cfg), "host": "0.0.0.0"}, "health": cfg.health.model_dump(mode="json", exclude_defaults=True),
                 "batch": batch}
        front = {section: values for section, values in front.items() if values}
        front_text = yamltext.comment("the front proxy: every per-node vsup of every host behind one endpoint") + yamltext.dump(front)
        parse_config(front_text, "the front proxy's configuration", require_model=False)
        loop = [f"    for port in {' '.join(map(str, step_ports))}; do upstreams+=(--upstream \"http://$host:$port\"); done"]
        weighting = "# The front proxy, on the first host (on the core the plan reserved), weighting each per-node vsup\n" \
                    "# by the instances its /ready reports (0: out of rotation)."
    reserved = host_plan.reserved_cpus
    bind = f"verbose,mask_cpu:{cpu_mask(reserved)}" if reserved else "none"
    store = [
        "# The Batch API's store (/v1/files, /v1/batches), held by the front: best on a local disk of the",
        "# front's host (SQLite's locks on NFS are unreliable), and kept after the job, so a job submitted",
        "# again resumes its batches (on the same first host, or give VSUP_BATCH_DIR a folder it reaches).",
        f'BATCH_DIR="${{VSUP_BATCH_DIR:-$HOME/.local/state/vsup/batches-{job_name}}}"',
    ] if batch is not None else []
    batch_flag = ' --batch-dir "$BATCH_DIR"' if batch is not None else ""
    lines += [
        *weighting.splitlines(),
        _heredoc('"$CONF/front.yaml"', front_text).rstrip("\n"),
        'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "upstreams=()",
        'for host in "${hosts[@]}"; do',
        *loop,
        "done",
        'first=${hosts[0]}',
        *store,
        f'srun --nodes=1 --ntasks=1 --nodelist="$first" --overlap --cpu-bind={bind} --job-name=vsup-front \\',
        # the front checks the same keys and passes the client's on (--forward-key): the per-node vsups check it too
        f'     {_step("front")} "$VSUP" proxy --forward-key --config "$CONF/front.yaml"{batch_flag} "${{upstreams[@]}}" &',
        f'echo "vsup: clients connect to http://$first:{cfg.proxy.port}" >&2',
        "",
        "# Wait for the steps; after a TERM (the trap above) wait again until every vsup has drained, so the",
        "# job stays in squeue and vsup's shutdown lines reach the job's output.",
        "until wait; do :; done",
    ]
    return "\n".join(lines) + "\n"


def _key_checks(cfg: VsupConfig) -> list[str]:
    """The script stops before any step unless every key's variable is set: sbatch and srun pass
    the environment on to every vsup, so no key is written on the shared filesystem."""
    variables = keys.key_vars(cfg.proxy)
    if not keys.has_keys(cfg.proxy):
        return []
    lines = ["# The keys come by environment (sbatch and srun pass it on to every vsup), never into a file on the",
             "# shared filesystem: the step configurations name each key's variable (key_env)."]
    if cfg.proxy.api_key is not None:
        lines.append(f': "${{{keys.API_KEY_ENV}:?proxy.api_key is set: export {keys.API_KEY_ENV}=<the key> before sbatch}}"')
    lines += [f': "${{{var.env}:?{var.entry} ({var.name}) is read from {var.env}: export {var.env}=<its key> before sbatch}}"'
              for var in variables]
    return [*lines, ""]


def _summary(machine: Machine, host_plan: Plan, cfg: VsupConfig, steps: tuple[Step, ...], hosts: int) -> str:
    nodes, per_node = instances_per_node(host_plan)
    inst = host_plan.instances[0]
    lines = [
        "vsup on Slurm, written by `vsup export slurm` from the plan of one node type:",
        f"  {len(machine.cpu_nodes)} NUMA node(s) with CPUs, {len(machine.cores)} cores; "
        f"{len(host_plan.instances)} instance(s), {per_node} per node on nodes {format_list(nodes)}",
        f"  each instance: {len(inst.omp_cpus)} OpenMP thread(s), KV cache {format_gib(inst.kvcache_bytes)}"
        + (f", weights {format_gib(inst.weights_bytes)}" if inst.weights_bytes else ""),
        f"  per host: one step per NUMA node ({len(nodes)}), proxies on ports "
        f"{cfg.proxy.port + 1}-{cfg.proxy.port + len(nodes)}; the front proxy on port {cfg.proxy.port} of the first host",
        f"Hosts: {hosts}. Submit: sbatch {shlex.quote('vsup.sbatch')}",
    ]
    lines += [f"warning: {w}" for w in host_plan.warnings]
    return "\n".join(lines)


def _fleet_summary(machine: Machine, cfg: VsupConfig, steps: tuple[Step, ...], hosts: int) -> str:
    lines = [
        "vsup on Slurm, a fleet of models, written by `vsup export slurm` from the plan of one node type:",
        f"  {len(machine.cpu_nodes)} NUMA node(s) with CPUs, {len(machine.cores)} cores; per host one step per model "
        "and NUMA node of its share:",
    ]
    for position, step in enumerate(steps):
        inst = step.instances[0]
        lines.append(f"  {step.title}: {len(step.instances)} instance(s) of {len(inst.omp_cpus)} OpenMP thread(s), KV cache "
                     f"{format_gib(inst.kvcache_bytes)}, proxy on port {cfg.proxy.port + 1 + position}")
    lines += [
        f"  the front proxy on port {cfg.proxy.port} of the first host routes each request by its model",
        f"Hosts: {hosts}. Submit: sbatch {shlex.quote('vsup.sbatch')}",
    ]
    return "\n".join(lines)
