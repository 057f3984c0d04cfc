"""vsup: several vLLM CPU servers, each pinned to its own cores and memory node, behind one
OpenAI-compatible endpoint.

The distribution installs this one import name. Inside it, ``vsup.topology`` reads the machine
and plans instances (data in, data out) and ``vsup.supervisor`` does everything with I/O."""

__version__ = "0.1.0"
