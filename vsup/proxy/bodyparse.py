"""STUB (replaced by i29-parse)."""
from __future__ import annotations

from typing import Any

from vsup.proxy.codec import parse_json


class NotAnObject(ValueError):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class BodyParser:
    async def parse(self, body: bytes) -> Any:
        return parse_json(body)

    async def aclose(self) -> None:
        pass
