"""The API keys of an export, carried by environment variables and never written into a file.

An export's files (a Slurm script and its step configurations on a shared filesystem, Kubernetes
ConfigMaps) are read by more people than the keys are meant for. So every file an export writes
names, for each named key (proxy.api_keys), the environment variable that holds it (`key_env`),
and vsup reads the value from there at start (vsup/proxy/auth.py: one line naming the key and the
variable when it is unset). `proxy.api_key` goes by VSUP_API_KEY, as everywhere. The Slurm script
requires the variables before any step starts; Kubernetes fills them from Secrets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vsup.config.schema import ProxyConfig
from vsup.errors import VsupError

API_KEY_ENV = "VSUP_API_KEY"  # proxy.api_key's, read by vsup run and vsup proxy alike
# a variable a shell can export and a Kubernetes env entry can name
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class KeyVar:
    """One named key's variable: `entry` its proxy.api_keys key (for messages), `name` the key's name."""

    entry: str  # proxy.api_keys[1]
    name: str  # the key's name, also its data key in the Kubernetes Secret
    env: str  # the environment variable that carries it


def env_name(key_name: str) -> str:
    """The variable a named key written inline (`key:`) is carried by: VSUP_KEY_<NAME>."""
    return "VSUP_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", key_name).upper()


def key_vars(proxy: ProxyConfig) -> tuple[KeyVar, ...]:
    """Each named key's variable: its own key_env, or VSUP_KEY_<NAME> for a key written inline.
    Two keys that would share one variable, or a key_env no shell can export, are refused."""
    out: list[KeyVar] = []
    for i, entry in enumerate(proxy.api_keys):
        where = f"proxy.api_keys[{i}]"
        env = entry.key_env if entry.key_env is not None else env_name(entry.name)
        if not ENV_NAME.fullmatch(env):
            raise VsupError(f"{where}.key_env: {env!r} is not an environment variable a shell can export; use letters, "
                            "digits and '_', not starting with a digit, e.g. VSUP_KEY_TEAM_A")
        if env == API_KEY_ENV:
            raise VsupError(f"{where}.key_env: {API_KEY_ENV} carries proxy.api_key; give the key {entry.name!r} a variable "
                            "of its own, e.g. VSUP_KEY_TEAM_A")
        other = next((var for var in out if var.env == env), None)
        if other is not None:
            raise VsupError(f"{where}: the keys {other.name!r} ({other.entry}) and {entry.name!r} would both be carried by "
                            f"the environment variable {env}; give one of them its own key_env")
        out.append(KeyVar(where, entry.name, env))
    return tuple(out)


def without_secrets(proxy: dict, variables: tuple[KeyVar, ...]) -> dict:
    """A proxy section as written to a file: no api_key, each named key by its key_env only."""
    out = {k: v for k, v in proxy.items() if k != "api_key"}
    if "api_keys" in out:
        by_name = {var.name: var.env for var in variables}
        out["api_keys"] = [{"name": entry["name"], "key_env": by_name[entry["name"]],
                            **{k: v for k, v in entry.items() if k not in ("name", "key", "key_env")}}
                           for entry in out["api_keys"]]
    return out


def has_keys(proxy: ProxyConfig) -> bool:
    return proxy.api_key is not None or bool(proxy.api_keys)
