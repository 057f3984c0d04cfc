"""Run a coroutine on uvloop when it is installed (it roughly halves the proxy's CPU per request),
else on the standard asyncio loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
