"""Machine topology: read it from sysfs (``vsup.topology.sysfs``) and plan instances on it
(``vsup.topology.planner``). Everything here is data in, data out: files read under a root, no
network, and no process of its own except one: the ISA reader's py-cpuinfo fallback (when
/proc/cpuinfo has no flags line) starts a helper process."""

from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.model import Core, Isa, Machine, Node

__all__ = ["Core", "Isa", "Machine", "Node", "PlanError", "TopologyError"]
