"""vsup: run several vLLM CPU servers, each pinned to its own cores and memory node, behind one
OpenAI-compatible endpoint. Everything with I/O (processes, sockets, files, signals) lives here."""

__version__ = "0.1.0"
