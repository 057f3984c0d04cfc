"""Machine topology: read it from sysfs (``vsup.topology.sysfs``) and plan instances on it
(``vsup.topology.planner``). Everything here is data in, data out; no processes, no network."""

from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.model import Core, Isa, Machine, Node

__all__ = ["Core", "Isa", "Machine", "Node", "PlanError", "TopologyError"]
