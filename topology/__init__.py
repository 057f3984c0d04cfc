"""Machine topology: read it from sysfs (``topology.sysfs``) and plan instances on it
(``topology.planner``). Everything here is data in, data out; no processes, no network."""

from topology.errors import PlanError, TopologyError
from topology.model import Core, Isa, Machine, Node

__all__ = ["Core", "Isa", "Machine", "Node", "PlanError", "TopologyError"]
