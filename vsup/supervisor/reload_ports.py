"""Before a reload stops anything: is every TCP port its new instances will listen on free?

A reload that moves an instance to another port (a new `vllm.base_port`) stops the old one, then
starts the new one there (rollout.py, in place); a port that something else holds would leave a
healthy instance stopped and its replacement crash-looping. So the reload is refused first, naming
the holder (leftovers.describe_port_holder), and nothing is stopped. This is about the instances'
TCP ports only (`vllm.base_port` / `vllm.spare_base_port`); an instance on a unix socket has none.

Which ports a step needs follows rollout.py: an instance already on one of its two slots
(`base_port + i`, `spare_base_port + i`) keeps it (a beside start checks its other slot itself and
falls back in place); one that moves needs `base_port + i`; a new index needs either slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from vsup.config.loader import where
from vsup.config.schema import VsupConfig, spare_base_port
from vsup.topology.plan_model import Plan


def busy_port(config: VsupConfig, plan: Plan, current: Mapping[int, int] | Sequence[int], own: Mapping[int, str],
              is_free: Callable[[int], bool], holder: Callable[[int], str | None]) -> str | None:
    """The first port the re-read `config`/`plan` needs that is taken, in one line naming the key,
    the instance and who holds it; None when all are free. `current`: the running fleet's port by
    index (holes allowed); `own`: port -> name of every instance of this vsup that has processes (a port one of
    them holds is busy too: it still runs when the step needs the port). An index not in
    `current` is new (a hole a removed model left counts as new)."""

    def taken(port: int, index: int) -> str | None:
        if port in own:
            return f"held by instance {own[port]} of this vsup, which still runs when instance {index} moves there"
        if is_free(port):
            return None
        return holder(port) or "held by a process vsup cannot see (another user's)"

    if config.vllm.listen != "tcp":
        return None  # instances on Unix sockets in vsup's own folder: no port to take
    ports = current if isinstance(current, Mapping) else dict(enumerate(current))
    spare = spare_base_port(config)
    for new in plan.instances:
        slots = (new.port, spare + new.index)
        if new.index in ports:
            if ports[new.index] in slots:
                continue
            why = taken(new.port, new.index)
            if why is not None:
                return (f"{where(config, 'vllm.base_port')}: port {new.port} for instance {new.index} is {why}; "
                        "stop what uses it or choose another vllm.base_port")
            continue
        reasons = [taken(port, new.index) for port in slots]
        if all(reasons):
            return (f"{where(config, 'vllm.base_port')}: port {new.port} for the new instance {new.index} is {reasons[0]}, "
                    f"and its spare port {slots[1]} is {reasons[1]}; stop what uses them or choose other ports")
    return None
