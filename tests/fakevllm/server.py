"""A fake `vllm serve` (OpenAI API server of vLLM's CPU build, ~0.32) for the test suite.

A real process on a real port: the supervisor, the proxy and the `openai` SDK talk to it exactly
as to vLLM. Faults come from FAKE_VLLM_* variables (settings.py, docs/fakevllm.md). Lifecycle,
like vLLM: spawn the EngineCore stand-in and create /dev/shm files, "load the model"
(FAKE_VLLM_START_DELAY, port still closed), bind, serve; SIGTERM/SIGINT -> in-flight streams get a
final error event, children stopped, shm removed, exit 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any

from aiohttp import web

from . import openai_api as api
from .cli import ServeArgs, UsageError, parse_args
from .engine import BatchEngine
from .events import EventLog
from .kv_events import KvEventPublisher
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import VllmMetrics
from .phases import Start
from .prefix_cache import PrefixCache
from .settings import Faults, SettingsError, load_faults
from .tree import EngineCore, SharedMemoryFiles

VERSION = "0.32.0"
START_MARKER = "FAKE_VLLM_START"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def say(text: str, stream=None) -> None:
    """One output line, flushed at once (a supervisor reads these through a pipe). Never raises:
    like vLLM's logging (logging.Handler.handleError swallows a broken stream), a reader that went
    away — a supervisor that was killed — must not stop the server, above all not its shutdown."""
    try:
        print(text, file=stream or sys.stdout, flush=True)
    except OSError:
        pass


def log(level: str, where: str, message: str, stream=None) -> None:
    """One vLLM-looking log line."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    say(f"{level} {stamp} [{where}] {message}", stream)


def _mems_allowed() -> str | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


class _Progress:
    """How far one generation got, for the "cancelled" event."""

    __slots__ = ("phase", "tokens", "arrived", "last_token_at")

    def __init__(self) -> None:
        self.phase = "waiting_first_token"
        self.tokens = 0
        self.arrived = time.monotonic()
        self.last_token_at: float | None = None


class FakeVllm:
    def __init__(self, args: ServeArgs, faults: Faults) -> None:
        self.args = args
        self.faults = faults
        self.name = faults.name or args.uds or str(args.port)  # with --uds: the socket's path (unique)
        self.fingerprint = f"fakevllm-{self.name}"
        # LoRA adapters (--lora-modules, then the admin routes): name -> (path, base model); each is a model name of its own
        self.adapters: dict[str, tuple[str, str]] = {
            m.name: (m.path, m.base_model_name or args.names[0]) for m in args.lora_modules}
        self.events = EventLog(faults.events, self.name)
        self.shm: SharedMemoryFiles | None = None
        self.engine: EngineCore | None = None
        self.stop_fut: asyncio.Future | None = None
        self.stopping = False
        self.exit_code = 0
        self.ready_at: float | None = None
        self.hung = False
        self.ids = itertools.count(1)
        self.completion_requests = 0
        self.running = 0
        self.waiting = 0
        max_seqs = faults.max_num_seqs or args.max_num_seqs
        self.slots = asyncio.Semaphore(max_seqs) if max_seqs else None
        self.prom = VllmMetrics(args.names[0], lambda: self.running, lambda: self.waiting)
        self.kv_events: list[dict] | None = [] if args.kv_events else None  # drained to the publisher per request
        self.kv_publisher: KvEventPublisher | None = None
        self.prefix_cache = PrefixCache(faults.prefix_cache_blocks, self.kv_events)
        self.prefill_lock = asyncio.Lock()  # one prefill at a time, as one engine computes them
        self.created = int(time.time())
        self.early_signals: list[str] = []
        self.ballast: list[bytes] = []  # resident memory grown on demand (POST /fake/grow, a leak)
        self.engine_model: BatchEngine | None = None  # the speed model, when FAKE_VLLM_STEP_TIME is set

    # ---------------------------------------------------------------- startup and shutdown

    def start_processes(self) -> dict:
        """Create shm files and the EngineCore child; return the FAKE_VLLM_START record."""
        if self.faults.shm:
            self.shm = SharedMemoryFiles()
        if self.faults.child:
            self.engine = EngineCore(
                self.args.port, self.faults.worker, self.shm.paths if self.shm else [], self.faults.ignore_sigterm
            )
        env = os.environ
        return {
            "pid": os.getpid(),
            "port": self.args.port,
            "host": self.args.host,
            "uds": self.args.uds,
            "name": self.name,
            "model": self.args.model,
            "served_model_names": list(self.args.names),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE"),
            "CPU_VISIBLE_MEMORY_NODES": env.get("CPU_VISIBLE_MEMORY_NODES"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "mems_allowed": _mems_allowed(),
            "engine_pid": self.engine.pid if self.engine else None,
            "shm": self.shm.paths if self.shm else [],
            # what a supervisor must (not) pass down: its own systemd context, vLLM/OpenMP knobs
            "env": {
                k: v
                for k, v in env.items()
                if k.startswith(("VLLM_", "OMP_", "KMP_", "WATCHDOG_", "LISTEN_", "FAKE_VLLM_"))
                or k in ("NOTIFY_SOCKET", "LD_PRELOAD", "CPU_VISIBLE_MEMORY_NODES")
            },
            "argv": sys.argv,
        }

    def release(self) -> None:
        """What a clean vLLM exit does: stop EngineCore (and its Worker), remove shm files."""
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.engine is not None:
            self.engine.terminate(timeout=1.0)
        if self.shm is not None:
            self.shm.remove()

    def _on_signal(self, name: str) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.events.emit("sigterm", signal=name)
        log("INFO", "launcher.py", f"Received {name}, shutting down the API server.")
        if self.stop_fut is not None and not self.stop_fut.done():
            self.stop_fut.set_result(name)

    def _crash(self, why: str) -> None:
        """Die like a segfault/OOM kill: no cleanup, children and shm files left behind."""
        self.events.emit("crash", reason=why, code=self.faults.crash_code)
        log("ERROR", "api_server.py", f"fakevllm: crashing on purpose ({why}), exit {self.faults.crash_code}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.faults.crash_code)

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self.stop_fut = loop.create_future()
        if self.faults.step_time is not None:
            self.engine_model = BatchEngine(self.faults, self.stop_fut, compiled=not self.args.enforce_eager)
        if self.faults.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig.name)

        for name in self.early_signals:  # arrived before the event loop ran
            self._on_signal(name)

        log("INFO", "core.py", f"Loading model {self.args.model} (fake, {self.faults.start_delay:g} s)")
        engine_ready = loop.create_future()
        if self.engine is not None:
            fd = self.engine.ready_fd

            def engine_answered() -> None:
                # once: the byte stays unread until wait_ready(), and a reader left on a readable fd
                # would spin the loop (a busy CPU while "loading": no hung start could be told)
                loop.remove_reader(fd)
                if not engine_ready.done():
                    engine_ready.set_result(None)

            loop.add_reader(fd, engine_answered)
        else:
            engine_ready.set_result(None)
        if self.faults.start_delay > 0:
            await asyncio.wait((self.stop_fut,), timeout=self.faults.start_delay)
        phases = self.faults.phases
        if self.faults.compile_seconds is not None and not self.args.enforce_eager:  # as vLLM compiles unless told not to
            phases = (*phases, ("compile", self.faults.compile_seconds))
        if phases:  # vLLM's start, phase by phase (FAKE_VLLM_PHASES, FAKE_VLLM_COMPILE)
            start = Start(self.args.model, self.faults.shards, self.faults.wait_line_every, self.stop_fut, say)
            await start.run(phases)
        # Like vLLM, the API server binds only after the EngineCore handshake.
        await asyncio.wait((engine_ready, self.stop_fut), return_when=asyncio.FIRST_COMPLETED)
        if self.engine is not None:
            loop.remove_reader(self.engine.ready_fd)
            if engine_ready.done() and not self.engine.wait_ready() and not self.stopping:
                log("ERROR", "core.py", "EngineCore failed to start (it exited before the handshake).", sys.stderr)
                self.release()
                self.events.emit("engine_died", engine_pid=self.engine.pid, during="startup")
                return 1
        if self.stopping:
            self.release()
            self.events.emit("stopped", code=0, during="startup")
            return 0
        if self.args.kv_events is not None:  # vLLM's scheduler starts its publisher with the engine
            self.kv_publisher = KvEventPublisher(self.args.kv_events)
        if self.faults.crash_at_start is not None:
            code = self.faults.crash_at_start
            log("ERROR", "core.py", "EngineCore failed to start (FAKE_VLLM_CRASH_AT_START).", sys.stderr)
            self.release()
            self.events.emit("crash_at_start", code=code)
            return code

        runner = web.AppRunner(
            self.make_app(), handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await runner.setup()
        try:
            if self.args.uds is not None:
                # vLLM's create_server_unix_socket: a plain bind, which fails if the path exists
                # (aiohttp's UnixSite would remove an existing socket first)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.bind(self.args.uds)
                except OSError:
                    sock.close()
                    raise
                site: web.BaseSite = web.SockSite(runner, sock)
            else:
                site = web.TCPSite(runner, self.args.host, self.args.port, reuse_address=True)
            await site.start()
        except OSError as e:
            where = repr(self.args.uds) if self.args.uds is not None else f"({self.args.host!r}, {self.args.port})"
            log("ERROR", "api_server.py", f"[Errno {e.errno}] error while attempting to bind on address "
                f"{where}: {e.strerror}", sys.stderr)
            await runner.cleanup()
            self.release()
            self.events.emit("bind_failed", error=str(e))
            return 1

        self.ready_at = time.monotonic()
        listen = f"unix:{self.args.uds}" if self.args.uds is not None else f"http://{self.args.host}:{self.args.port}"
        log("INFO", "api_server.py", f"Starting vLLM API server 0 on {listen}")
        say(f"INFO:     Started server process [{os.getpid()}]")
        say("INFO:     Waiting for application startup.")
        say("INFO:     Application startup complete.")
        self.events.emit("ready", port=self.args.port, uds=self.args.uds)
        self._schedule_faults(loop)
        watcher = asyncio.ensure_future(self._watch_engine()) if self.engine else None

        await self.stop_fut
        self.stopping = True
        if watcher is not None:
            watcher.cancel()
        log("INFO", "launcher.py", "Shutting down FastAPI HTTP server.")
        await runner.cleanup()
        self.release()
        say("INFO:     Application shutdown complete.")
        self.events.emit("stopped", code=self.exit_code)
        return self.exit_code

    def _schedule_faults(self, loop: asyncio.AbstractEventLoop) -> None:
        f = self.faults
        if f.long_line > 0:
            sys.stdout.write("WARNING fakevllm long line: " + "x" * f.long_line + "\n")
            sys.stdout.flush()
        if f.hang_after is not None:
            loop.call_later(f.hang_after, self._hang)
        if f.health_fail_after is not None:
            loop.call_later(
                f.health_fail_after,
                lambda: self.events.emit("health_failing", status=f.health_fail_status),
            )
        if f.grow_mib_per_s > 0:
            asyncio.ensure_future(self._leak(f.grow_mib_per_s))

    def grow_by(self, mib: float) -> int:
        """Allocate and touch `mib` MiB more (resident at once: every page is written). Returns
        the MiB grown so far."""
        self.ballast.append(b"\x01" * int(mib * MIB))
        return sum(len(chunk) for chunk in self.ballast) // MIB

    async def _leak(self, mib_per_s: float) -> None:
        while not self.stopping:
            await asyncio.sleep(0.1)
            self.grow_by(mib_per_s / 10)

    def _health_failing(self) -> bool:
        after = self.faults.health_fail_after
        return after is not None and self.ready_at is not None and time.monotonic() - self.ready_at >= after

    def _hang(self) -> None:
        self.hung = True
        self.events.emit("hang", mode=self.faults.hang_mode)
        log("WARNING", "api_server.py", f"fakevllm: hanging now (FAKE_VLLM_HANG_MODE={self.faults.hang_mode})")
        if self.faults.hang_mode != "block":
            return
        # The event loop stops here for good. A plain Python signal handler still runs between
        # sleeps, so SIGTERM keeps working (clean exit) unless it is ignored.
        if not self.faults.ignore_sigterm:
            def on_term(signum, frame):
                self.events.emit("sigterm", signal=signal.Signals(signum).name, blocked=True)
                self.release()
                self.events.emit("stopped", code=0, blocked=True)
                os._exit(0)

            signal.signal(signal.SIGTERM, on_term)
            signal.signal(signal.SIGINT, on_term)
        while True:
            time.sleep(3600)

    async def _watch_engine(self) -> None:
        """vLLM's API server exits (code 0) when its EngineCore process dies."""
        while self.engine.alive():
            await asyncio.sleep(0.2)
        if self.stopping or not self.faults.exit_on_engine_death:
            return
        self.events.emit("engine_died", engine_pid=self.engine.pid, returncode=self.engine.proc.returncode)
        log("ERROR", "core_client.py", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
            sys.stderr)
        self.exit_code = 0
        self.stopping = True
        if not self.stop_fut.done():
            self.stop_fut.set_result("engine_died")

    # ---------------------------------------------------------------- HTTP plumbing

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        app.on_response_prepare.append(self._tag_response)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/load", self.load)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/pooling", self.pooling)
        if self.faults.tokenize:
            app.router.add_post("/tokenize", self.tokenize)
            app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/fake/grow", self.grow)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)  # vLLM's, with VLLM_SERVER_DEV_MODE=1
        # two of vLLM's admin routes (serve/lora/api_router.py), so tests can see whether the proxy lets them through
        app.router.add_post("/v1/load_lora_adapter", self.lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.lora_adapter)
        return app

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Fake-Instance"] = self.name
        response.headers["Server"] = "uvicorn"

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self.hung and self.faults.hang_mode != "engine":
            # never answered; shield: a cancelled handler must not cancel the shared future
            await asyncio.shield(self.stop_fut)
            raise web.HTTPServiceUnavailable()
        try:
            response = await handler(request)
        except web.HTTPNotFound:
            response = web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            response = web.json_response({"detail": "Method Not Allowed"}, status=405)
        if self.faults.access_log and self.args.access_log and request.path not in self.args.access_log_excluded:
            # uvicorn's access line on stdout, as vLLM's log config writes it (vllm/logging_utils/uvicorn_logging.py)
            peer = request.transport.get_extra_info("peername") if request.transport else None
            where = f"{peer[0]}:{peer[1]}" if peer else "-"
            say(f'INFO:     {where} - "{request.method} {request.path_qs} HTTP/1.1" {response.status}')
        return response

    def _error(self, err: api.ApiError, rid: str | None = None, path: str | None = None) -> web.Response:
        if rid is not None:
            self.events.emit("rejected", id=rid, path=path, status=err.status, message=err.message)
        return web.Response(text=_dumps(err.body()), status=err.status, content_type="application/json")

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise api.bad_request(f"JSON decode error: {e}") from None

    # ---------------------------------------------------------------- simple endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self._health_failing():
            return web.Response(status=self.faults.health_fail_status)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.args.model,
                "parent": None,
                "max_model_len": self.args.max_model_len,
                "permission": [
                    {"id": f"modelperm-{self.name}", "object": "model_permission", "created": self.created,
                     "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                     "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                     "organization": "*", "group": None, "is_blocking": False}
                ],
            }
            for name in self.args.names
        ]
        # vLLM's adapter cards (serving_models.py): root = its path, parent = its base model, no max_model_len
        data += [
            {"id": name, "object": "model", "created": self.created, "owned_by": "vllm", "root": path, "parent": base,
             "max_model_len": None, "permission": data[0]["permission"]}
            for name, (path, base) in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    @property
    def names(self) -> tuple[str, ...]:
        """What a request's "model" may be: the served names and the adapters."""
        return self.args.names + tuple(self.adapters)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.running + self.waiting})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.prom.render()
        if self.engine_model is not None:  # the speed model's own count, beside vLLM's families
            body += (b"# HELP fakevllm:engine_steps_total Steps of the speed model's batched engine (FAKE_VLLM_STEP_TIME).\n"
                     b"# TYPE fakevllm:engine_steps_total counter\n"
                     b"fakevllm:engine_steps_total %d\n" % self.engine_model.steps)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.prefix_cache.clear()
        if self.kv_publisher is not None and self.kv_events:
            batch, self.kv_events[:] = list(self.kv_events), []
            self.kv_publisher.publish(batch)
        return web.Response(status=200)

    async def grow(self, request: web.Request) -> web.Response:
        """Test-only: `POST /fake/grow {"mib": N}` makes the server's resident memory N MiB larger."""
        try:
            body = await self._read_json(request)
            mib = body["mib"] if isinstance(body, dict) else None
            if not isinstance(mib, (int, float)) or isinstance(mib, bool) or not 0 < mib <= 65536:
                raise api.bad_request('give {"mib": N} with 0 < N <= 65536')
        except api.ApiError as err:
            return self._error(err)
        grown = self.grow_by(mib)
        self.events.emit("grown", mib=grown)
        return web.json_response({"grown_mib": grown})

    async def lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        loading = request.path.endswith("/load_lora_adapter")
        self.events.emit("lora_adapter", path=request.path, lora_name=name)
        # vLLM's checks (serving_models.py): a name loaded twice is 400, unloading an unknown one 404
        if loading and name in self.adapters:
            return self._error(api.bad_request(f"The lora adapter '{name}' has already been loaded."))
        if not loading and name not in self.adapters:
            return self._error(api.ApiError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found."))
        if loading and isinstance(name, str):
            self.adapters[name] = (str(body.get("lora_path", "")), self.args.names[0])
        elif not loading:
            del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' {'added' if loading else 'removed'} successfully.")

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = api.tokenize_response(await self._read_json(request), self.args.max_model_len)
        except api.ApiError as err:
            return self._error(err)
        return web.json_response(body, dumps=_dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise api.bad_request("tokens: expected a list of token ids", "tokens")
        except api.ApiError as err:
            return self._error(err)
        return web.json_response({"prompt": " ".join(f"tok{t}" for t in tokens)})

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self._pooled(request, "embd", api.embeddings_response)

    async def pooling(self, request: web.Request) -> web.Response:
        return await self._pooled(request, "pooling", api.pooling_response)

    async def _pooled(self, request: web.Request, prefix: str, answer) -> web.Response:
        rid = f"{prefix}-{self.name}-{next(self.ids)}"
        self.events.emit("request", path=request.path, id=rid, request_id=request.headers.get("X-Request-Id"))
        try:
            body = answer(await self._read_json(request), self.names, rid, int(time.time()))
        except api.ApiError as err:
            return self._error(err, rid, request.path)
        self.events.emit("finished", path=request.path, id=rid)
        return web.json_response(body, dumps=_dumps)

    # ---------------------------------------------------------------- generation

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, "chatcmpl", api.parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, "cmpl", api.parse_completion)

    async def _generation(self, request: web.Request, prefix: str, parse) -> web.StreamResponse:
        rid = f"{prefix}-{self.name}-{next(self.ids)}"
        self.completion_requests += 1
        self.events.emit("request", path=request.path, id=rid, n=self.completion_requests,
                         request_id=request.headers.get("X-Request-Id"), target=request.raw_path)
        f = self.faults
        crash_at_token = None
        if f.crash_after is not None and self.completion_requests == f.crash_after:
            if not f.crash_mid_stream:
                self._crash(f"FAKE_VLLM_CRASH_AFTER={f.crash_after}")
            crash_at_token = f.crash_after_tokens
        if f.status_503:
            return self._error(api.ApiError(503, "ServiceUnavailableError", "Service Unavailable (FAKE_VLLM_STATUS_503)"),
                               rid, request.path)
        if self._health_failing():
            return self._error(api.ApiError(500, "InternalServerError",
                                            "EngineCore encountered an issue. See stack trace (above) for the root cause."),
                               rid, request.path)
        try:
            body = await self._read_json(request)
            gen = parse(body, self.names, self.args.max_model_len)
        except api.ApiError as err:
            return self._error(err, rid, request.path)
        self.prom.prompt_tokens.inc(gen.prompt_tokens)
        uncached = 0
        for words in api.prompt_words(gen.kind, body):
            hits = self.prefix_cache.lookup(words)
            self.prom.prefix_cache_queries.inc(len(words))
            self.prom.prefix_cache_hits.inc(hits)
            uncached += len(words) - hits
        if self.kv_publisher is not None and self.kv_events:
            batch, self.kv_events[:] = list(self.kv_events), []
            self.kv_publisher.publish(batch)  # one batch per request, as one engine step would
        progress = _Progress()
        try:
            if self.slots is not None and self.slots.locked():
                progress.phase = "queued"  # vLLM's scheduler: beyond max_num_seqs, requests wait
                self.waiting += 1
                try:
                    await self.slots.acquire()
                finally:
                    self.waiting -= 1
            elif self.slots is not None:
                await self.slots.acquire()
            progress.phase = "waiting_first_token"
            self.prom.queue.observe(time.monotonic() - progress.arrived)
            self.running += 1
            try:
                if f.prefill_delay and uncached:
                    async with self.prefill_lock:  # what the cache did not hold is computed, in turn
                        await asyncio.wait((self.stop_fut,), timeout=uncached * f.prefill_delay)
                if gen.stream:
                    return await self._stream(request, gen, rid, progress, crash_at_token)
                return await self._complete(request, gen, rid, progress, crash_at_token)
            finally:
                self.running -= 1
                if self.slots is not None:
                    self.slots.release()
        except asyncio.CancelledError:
            self.events.emit("cancelled", path=request.path, id=rid, phase=progress.phase, tokens=progress.tokens,
                             stopping=self.stopping)
            raise

    async def _pace(self, gen: api.Generation, index: int, crash_at_token: int | None) -> bool:
        """Wait for token `index`; False when the server is shutting down (or hung, until then)."""
        if self.engine_model is not None:
            await self.engine_model.token()
        else:
            if index == 0:
                delay = self.faults.first_token_delay if gen.first_token_delay is None else gen.first_token_delay
            else:
                delay = self.faults.token_delay if gen.token_delay is None else gen.token_delay
            if delay > 0:
                await asyncio.wait((self.stop_fut,), timeout=delay)
        if self.hung:
            await asyncio.shield(self.stop_fut)
        if self.stopping:
            return False
        if crash_at_token is not None and index == crash_at_token:
            self._crash(f"FAKE_VLLM_CRASH_AFTER={self.faults.crash_after} mid-stream after {index} tokens")
        return True

    async def _complete(self, request, gen, rid, progress, crash_at_token) -> web.Response:
        for i in range(gen.max_tokens):
            if not await self._pace(gen, i, crash_at_token):
                return self._error(api.ApiError(500, "InternalServerError",
                                                f"Request {rid} aborted: the server is shutting down."))
            progress.phase = "generating"
            progress.tokens = i + 1
            self._token_out(progress, gen.prompts)
        self._finished(progress)
        self.events.emit("finished", path=request.path, id=rid, tokens=progress.tokens, stream=False)
        body = api.full_response(gen, rid, int(time.time()), self.fingerprint, progress.tokens)
        return web.Response(text=_dumps(body), content_type="application/json")

    async def _stream(self, request, gen, rid, progress, crash_at_token) -> web.StreamResponse:
        created = int(time.time())
        response: web.StreamResponse | None = None
        try:
            for i in range(gen.max_tokens):
                if not await self._pace(gen, i, crash_at_token):
                    break
                if response is None:
                    # Like vLLM, headers and the first bytes go out with the first token.
                    response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
                    await response.prepare(request)
                    progress.phase = "streaming"
                    if gen.kind == "chat":
                        for p in range(gen.prompts):
                            await response.write(self._sse(api.role_chunk(gen, rid, created, self.fingerprint, p)))
                for p in range(gen.prompts):
                    await response.write(self._sse(api.token_chunk(gen, rid, created, self.fingerprint, i, p)))
                progress.tokens = i + 1
                self._token_out(progress, gen.prompts)
            if response is None:  # shutting down before the first token
                return self._error(api.ApiError(500, "InternalServerError",
                                                f"Request {rid} aborted: the server is shutting down."))
            if progress.tokens < gen.max_tokens:
                err = api.error_body(f"Request {rid} aborted: the server is shutting down.", "InternalServerError", 500)
                await response.write(self._sse(err))
                self.events.emit("aborted", path=request.path, id=rid, tokens=progress.tokens)
            else:
                if gen.include_usage:
                    await response.write(self._sse(api.usage_chunk(gen, rid, created, self.fingerprint, progress.tokens)))
                self._finished(progress)
                self.events.emit("finished", path=request.path, id=rid, tokens=progress.tokens, stream=True)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The client went away between two writes (the handler was not cancelled in time).
            self.events.emit("cancelled", path=request.path, id=rid, phase=progress.phase, tokens=progress.tokens,
                             stopping=self.stopping)
        return response

    def _token_out(self, progress: _Progress, count: int) -> None:
        """One token step went out: time to first token, or the gap since the previous one."""
        now = time.monotonic()
        if progress.last_token_at is None:
            self.prom.ttft.observe(now - progress.arrived)
        else:
            self.prom.itl.observe(now - progress.last_token_at)
        progress.last_token_at = now
        self.prom.generation_tokens.inc(count)

    def _finished(self, progress: _Progress) -> None:
        self.prom.success["length"].inc()  # the fake always generates max_tokens
        self.prom.e2e.observe(time.monotonic() - progress.arrived)

    @staticmethod
    def _sse(obj: dict) -> bytes:
        return b"data: " + _dumps(obj).encode() + b"\n\n"


# -------------------------------------------------------------------- noise and entry point


MIB = 1024 * 1024


def _start_noise(lines_per_second: float) -> None:
    """Background chatter on stdout and stderr (FAKE_VLLM_NOISE) to test a supervisor's log readers;
    a full pipe blocks this thread and then the server, as it would block vLLM."""

    def run() -> None:
        period = 0.05
        owed = 0.0
        n = 0
        while True:
            owed += lines_per_second * period
            while owed >= 1:
                owed -= 1
                n += 1
                stream = sys.stdout if n % 2 else sys.stderr
                stream.write(f"INFO {time.strftime('%m-%d %H:%M:%S')} [loggers.py:123] Engine 000: noise line {n}: "
                             "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s\n")
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(period)

    threading.Thread(target=run, name="fakevllm-noise", daemon=True).start()


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _die_by(sig: signal.Signals) -> None:
    """End by `sig`'s default action, as the kernel ends a process that executes an instruction the
    CPU lacks (SIGILL) - before EngineCore exists, like vLLM importing its kernels. No core file."""
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    signal.raise_signal(sig)
    os._exit(1)  # not reached


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        faults = load_faults()
    except (UsageError, SettingsError) as e:
        print(f"fakevllm: error: {e}", file=sys.stderr)
        return 2
    try:
        server = FakeVllm(args, faults)
    except OSError as e:
        print(f"fakevllm: error: FAKE_VLLM_EVENTS={faults.events!r}: {e.strerror}", file=sys.stderr)
        return 2
    log("INFO", "api_server.py", f"vLLM API server version {VERSION} (fakevllm)")
    log("INFO", "utils.py", f"non-default args: model={args.model!r} host={args.host!r} port={args.port} "
        f"served_model_name={list(args.served_model_names)} ignored={list(args.ignored)}")
    if faults.sigill_at_start:
        server.events.emit("sigill_at_start")
        _die_by(signal.SIGILL)
    # Signals before the event loop takes over: ignored, or remembered and acted on once it runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        if faults.ignore_sigterm:
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, lambda signum, frame: server.early_signals.append(signal.Signals(signum).name))
    record = server.start_processes()
    say(f"{START_MARKER} {_dumps(record)}")
    server.events.emit("started", **record)
    if faults.noise > 0:
        _start_noise(faults.noise)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(server.serve())
    except BaseException:
        server.release()
        raise
