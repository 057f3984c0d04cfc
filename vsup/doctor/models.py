"""The doctor's checks of each model of a fleet (a file with `models:`): its files (a local path
exists, holds weight files) and its part of the memory plan, each result naming the model. The
single-model form keeps its own results (vsup.doctor.checks)."""

from __future__ import annotations

from pathlib import Path

from vsup.config.checks import looks_local
from vsup.config.fleet import ModelView
from vsup.config.loader import where
from vsup.config.planning import WEIGHT_SUFFIXES, model_dir_size
from vsup.doctor.result import FAIL, PASS, SKIP, WARN, Result
from vsup.errors import VsupError
from vsup.topology.fsroot import FsRoot
from vsup.topology.plan_model import Plan, format_gib


def check_model_files(view: ModelView, fs: FsRoot, live: bool) -> Result:
    """`view`'s model here (`live`), else under the checked root (a dump's, with --fsroot)."""
    model = view.config.model
    if not looks_local(model):
        sized = view.config.placement.model_size_gib is not None
        return Result("model-files", SKIP, f"{view.name}: {model} is a hub name: vLLM fetches it when the instance starts"
                      + ("" if sized else f"; set {view.key}.placement.model_size_gib so its memory is planned with its weights"))
    if not live and not model.startswith("/"):
        return Result("model-files", SKIP, f"{view.name}: {model} is relative to where vsup runs: checked on that machine only")
    path = Path(model).expanduser() if live else fs.path(model)
    if not path.exists():
        return Result("model-files", FAIL, f"{view.name}: {where(view.config, 'model')}: {model}: no such file or directory",
                      "give the model's local directory, or a hub name like org/name")
    try:
        size = model_dir_size(str(path))
    except VsupError as exc:
        return Result("model-files", FAIL, f"{view.name}: {exc}", "make the model's files readable by the user vsup runs as")
    if size is None:
        return Result("model-files", WARN, f"{view.name}: {model} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})",
                      f"point {view.key}.model at the model's directory (config.json and its weights)")
    return Result("model-files", PASS, f"{view.name}: {model}: {format_gib(size)} of weights")


def check_model_memory(view: ModelView, plan: Plan) -> Result:
    """`view`'s instances in the fleet's plan: where they are and what each holds."""
    mine = plan.of_model(view.name)
    share = next((m for m in plan.models if m.name == view.name), None)
    if not mine or share is None:
        return Result("model-memory", FAIL, f"{view.name}: no instance in the plan")
    first = mine[0]
    weights = format_gib(first.weights_bytes) if first.weights_bytes else "unknown"
    nodes = ",".join(str(n) for n in sorted({n for inst in mine for n in inst.nodes})) or "-"
    return Result("model-memory", PASS, f"{view.name}: {len(mine)} instance(s) on node(s) {nodes}, each {weights} weights + "
                  f"{format_gib(first.kvcache_bytes)} KV + {format_gib(first.overhead_bytes)} overhead = "
                  f"{format_gib(first.memory_bytes)}; {share.reason}")
