"""The shapes of the control socket's answers the CLI reads (`vsup status`, `restart`, `reload`,
`top`): what each view takes from them, with its type. An answer is checked before anything is
shown, so one of another shape (another program on the socket, a vsup of another version) is a
one-line error naming the first wrong field, never a traceback half-way through a table.

Only what the views read is described; other keys pass (a newer vsup may add some). Types are
strict (a "5" is not a count) but a whole number passes where a float is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vsup.errors import VsupError


class _Shape(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


Count = Annotated[int, Field(ge=0)]
Priority = Annotated[str, Field(pattern=r"^-?\d+$")]


class VsupPart(_Shape):
    pid: int
    uptime: float | None = None
    proxy: str
    ready: Count
    in_flight: Count
    stopping: bool = False


class Waiting(_Shape):
    line: str = ""
    count: Count | None = None
    note: str = ""


class Phase(_Shape):
    name: str | None = None
    for_: float | None = Field(None, alias="for")
    shards: list[int] | None = None
    read_bytes: float | None = None
    weights_bytes: float | None = None
    idle: float | None = None
    judged: bool | None = None
    waiting: Waiting | None = None


class Metrics(_Shape):
    generation_tokens_per_s: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    cpu_percent: float | None = None
    rss_bytes: float | None = None
    numa_local_ratio: float | None = None


class InstanceEntry(_Shape):
    index: int
    name: str | None = None
    model: str | None = None
    state: str
    pid: int | None
    port: int | None = None
    address: str | None = None
    cpus: list[int]
    nodes: list[int]
    uptime: float | None = None
    restarts: Count
    in_flight: Count = 0
    placement_ok: bool | None = None
    placement_drift: list[str] = []
    next_start_in: float | None = None
    last_exit: str | None = None
    phase: Phase | None = None
    metrics: Metrics | None = None


class ChangingEntry(_Shape):
    index: int
    name: str
    state: str
    pid: int | None
    port: int | None = None
    address: str | None = None


class NewInstance(_Shape):
    name: str
    port: int | None = None
    at: str | None = None
    state: str


class Step(_Shape):
    index: int
    action: str
    why: str
    how: str | None = None
    state: str
    detail: str | None = None
    new: NewInstance | None = None


class Rollout(_Shape):
    kind: str
    trigger: str
    state: str
    took: float
    error: str | None = None
    step: Count = 0
    steps: list[Step]
    unchanged: list[int] = []
    applied: list[str] = []
    not_applied: list[str] = []
    pending: str | None = None


class Queue(_Shape):
    waiting: Count = 0
    by_priority: dict[Priority, Count] = {}
    oldest_wait_s: float | None = None
    waited: Count = 0
    wait_sum_s: float = 0.0


class Model(_Shape):
    name: str | None = None
    instances: list[int | None] = []
    ready: Count = 0
    states: dict[str, Count] = {}
    in_flight: Count = 0


class Batch(_Shape):
    id: str
    status: str
    endpoint: str | None = None
    models: list[str] = []
    owner: str | None = None
    total: Count = 0
    completed: Count = 0
    failed: Count = 0
    pending: Count | None = None
    running: Count | None = None
    rate: float | None = None
    eta: float | None = None
    created_at: float | None = None
    ended_at: float | None = None
    metadata: dict[str, Any] | None = None


class StatusAnswer(_Shape):
    vsup: VsupPart
    instances: list[InstanceEntry]
    models: list[Model] | None = None
    queues: dict[str, Queue] = {}
    changing: list[ChangingEntry] = []
    rollout: Rollout | None = None
    batches: list[Batch] = []


class RestartAnswer(_Shape):
    instances: list[InstanceEntry]


class ReloadAnswer(_Shape):
    rollout: Rollout


def checked(shape: type[BaseModel], data: Any, path: Path, route: str) -> dict[str, Any]:
    """`data` as it came when it has `shape`; else a VsupError naming the first wrong field."""
    try:
        shape.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the answer"
        raise VsupError(f"the control socket {path} answered {route} with an unexpected shape ({where}: {first['msg']}; "
                        f"{exc.error_count()} problem(s)): not a vsup of this version? (`vsup --version` here)") from None
    return data
