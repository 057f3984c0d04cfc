"""A candidate as a vsup YAML (pure dict edits): the user's configuration with the candidate's
placement, vLLM flags and preload (`vllm.preload`), plus the run-time settings of one measurement (free ports,
its own log folder and control socket). The winner is written the same way, without those."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from vsup.config.admission import flag_int
from vsup.errors import VsupError
from vsup.tune.candidates import KV_MAX, PRELOAD_SETS, Candidate

FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens"}
EAGER_ON, EAGER_OFF = "--enforce-eager", "--no-enforce-eager"  # vLLM's BooleanOptionalAction: no value, the last wins
_COMPILE_MODE_NONE = ("0", "none")  # CompilationMode.NONE, by number or name (vLLM takes either, any case)


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


def _dashed(arg: str) -> str:
    """An option's name as vLLM reads it: `--a_b` is `--a-b` (up to a `=` or a `.`)."""
    if not arg.startswith("--"):
        return arg
    head, sep, tail = arg.partition("=")
    name, dot, sub = head.partition(".")
    return name.replace("_", "-") + dot + sub + sep + tail


def enforce_eager(args: Sequence[str]) -> bool:
    """Whether vLLM's args turn --enforce-eager on (the last of it and --no-enforce-eager wins; off by default)."""
    found = False
    for arg in map(_dashed, args):
        if arg in (EAGER_ON, EAGER_OFF):
            found = arg == EAGER_ON
    return found


def compile_off(args: Sequence[str]) -> str | None:
    """The argument of vLLM's args that turns torch.compile off other than --enforce-eager
    (`-O0`, `--optimization-level 0`, a compilation config with mode 0 / NONE), or None. With it a
    start without --enforce-eager compiles nothing either: the two cannot be told apart."""
    args = [str(a) for a in args]
    for i, raw in enumerate(args):
        arg = _dashed(raw)
        following = args[i + 1] if i + 1 < len(args) else ""
        if arg in ("-O0", "-O=0", "--optimization-level=0"):
            return raw
        if arg in ("-O", "--optimization-level") and following == "0":
            return f"{raw} {following}"
        name, eq, value = arg.partition("=")
        if name in ("-cc", "--compilation-config"):
            text = value if eq else following
            try:
                config = json.loads(text)
            except ValueError:
                continue
            if isinstance(config, dict) and str(config.get("mode", config.get("level", ""))).lower() in _COMPILE_MODE_NONE:
                return raw if eq else f"{raw} {following}"
        elif name in ("-cc.mode", "--compilation-config.mode", "-cc.level", "--compilation-config.level"):
            if str(value if eq else following).lower() in _COMPILE_MODE_NONE:
                return raw if eq else f"{raw} {following}"
    return None


def check_enforce_eager(args: Sequence[str], values: Sequence[bool] | None, origin: str) -> None:
    """A VsupError, one line, when `values` (from `origin`) would measure --enforce-eager off on
    a config whose vllm.args turn torch.compile off another way: that run would compile nothing."""
    culprit = compile_off(args)
    if values and False in values and culprit is not None:
        raise VsupError(f"{origin}: off (a compiled start) cannot be measured: vllm.args has {culprit!r}, which turns "
                        f"torch.compile off as --enforce-eager does; take it out of vllm.args, or try only on")


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
    if candidate.enforce_eager is not None:
        if not candidate.enforce_eager and (culprit := compile_off(args)) is not None:
            raise VsupError(f"{candidate.id}: vllm.args has {culprit!r}, which turns torch.compile off: "
                            "--enforce-eager off would measure no compile")
        args = [a for a in args if _dashed(a) not in (EAGER_ON, EAGER_OFF)] + ([EAGER_ON] if candidate.enforce_eager else [])
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
    folder is keyed by the proxy port, so runs never meet; base_port counts only under tcp), and
    the Batch API off."""
    out = copy.deepcopy(dict(data))
    out["proxy"] = {**(out.get("proxy") or {}), "host": "127.0.0.1", "port": proxy_port}
    out["vllm"] = {**(out.get("vllm") or {}), "base_port": base_port, "listen": "unix"}
    out["log"] = {**(out.get("log") or {}), "dir": log_dir, "echo": False}
    out["control"] = {**(out.get("control") or {}), "socket": socket}
    # no batch store: a candidate must not open the user's (and run its batches on a measurement)
    out["batch"] = {**(out.get("batch") or {}), "enabled": False}
    return out


def render(data: Mapping[str, Any], comments: Sequence[str] = ()) -> str:
    head = "".join(f"# {line}".rstrip() + "\n" for line in comments)
    return head + yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)
