"""A fake `vllm serve` for the test suite: a real process on a real port (see docs/fakevllm.md).

Importing this package is cheap on purpose (no aiohttp): the pytest helpers live in
`tests.fakevllm.fixtures`, the server in `tests.fakevllm.server`.
"""

from pathlib import Path

#: Executable wrapper with vLLM's CLI shape, usable as `vllm.command: [WRAPPER, serve]`.
WRAPPER = Path(__file__).resolve().parent / "vllm"
