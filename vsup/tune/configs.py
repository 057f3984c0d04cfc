"""A candidate as a vsup YAML (pure dict edits): the user's configuration with the candidate's
placement, vLLM flags and preload (`vllm.preload`), plus the run-time settings of one measurement (free ports,
its own log folder and control socket). The winner is written the same way, without those."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from vsup.config.admission import flag_int
from vsup.tune.candidates import KV_MAX, PRELOAD_SETS, Candidate

FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens"}


def flag_value(args: Sequence[str], flag: str) -> int | None:
    """The value of `--flag N` or `--flag=N` in vLLM's args (the last one wins, as in argparse)."""
    return flag_int(args, flag)


def _without_flag(args: Sequence[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = True
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    return out


def apply_candidate(data: Mapping[str, Any], candidate: Candidate, libraries: Mapping[str, str]) -> dict[str, Any]:
    """The user's configuration (as loaded YAML) with this candidate's settings."""
    out = copy.deepcopy(dict(data))
    out["instances"] = candidate.instances
    placement = dict(out.get("placement") or {})
    placement["omp_threads"] = candidate.omp_threads
    placement["smt"] = candidate.smt
    placement["housekeeping_core"] = candidate.housekeeping_core
    if candidate.kvcache_gib == KV_MAX:
        placement["kvcache_gib"] = None
    elif candidate.kvcache_gib is not None:
        placement["kvcache_gib"] = candidate.kvcache_gib
    out["placement"] = placement
    vllm = dict(out.get("vllm") or {})
    args = [str(a) for a in vllm.get("args") or []]
    for field, flag in FLAGS.items():
        value = getattr(candidate, field)
        if value is not None:
            args = [*_without_flag(args, flag), flag, str(value)]
    vllm["args"] = args
    # the set as vllm.preload, explicit either way: "none" measures no preload (not vllm.preload's
    # default auto, which would preload what the other sets try); vllm.env's LD_PRELOAD stays the user's
    libs = [libraries[name] for name in PRELOAD_SETS[candidate.preload]]
    vllm["preload"] = libs or "none"
    out["vllm"] = vllm
    return out


def for_measurement(data: Mapping[str, Any], *, proxy_port: int, base_port: int, log_dir: str, socket: str) -> dict[str, Any]:
    """One measurement's run-time settings: its own ports, logs and control socket, the proxy on
    loopback (the load comes from this machine), the instances on private Unix sockets (their
    folder is keyed by the proxy port, so runs never meet; base_port counts only under tcp)."""
    out = copy.deepcopy(dict(data))
    out["proxy"] = {**(out.get("proxy") or {}), "host": "127.0.0.1", "port": proxy_port}
    out["vllm"] = {**(out.get("vllm") or {}), "base_port": base_port, "listen": "unix"}
    out["log"] = {**(out.get("log") or {}), "dir": log_dir, "echo": False}
    out["control"] = {**(out.get("control") or {}), "socket": socket}
    return out


def render(data: Mapping[str, Any], comments: Sequence[str] = ()) -> str:
    head = "".join(f"# {line}".rstrip() + "\n" for line in comments)
    return head + yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)
