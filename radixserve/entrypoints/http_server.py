"""The HTTP server: SGLang's native API (/generate, /health, ...) and the
OpenAI API (/v1/...), on FastAPI + uvicorn, in front of the TokenizerManager.

    radixserve serve --model-path ... [--host 127.0.0.1] [--port 30000] [--api-key KEY]

Every error is a JSON body in OpenAI's shape; docs/limits.md lists the
statuses, the limits and what happens when a process dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import threading
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

import radixserve
from radixserve.entrypoints import http_guards
from radixserve.entrypoints.http_guards import error_body
from radixserve.entrypoints.launcher import (EngineProcesses, SchedulerRanks, raise_open_file_limit,
                                            start_engine_processes)
from radixserve.entrypoints.openai.adapters import validation_error_to_openai, value_error_to_openai
from radixserve.entrypoints.streaming import incremental, peek, sse_stream
from radixserve.managers.child_process import freeze_startup_objects
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.managers.profiler import check_profile_options
from radixserve.managers.tokenizer_manager import (EngineDeadError, RequestFailedError, RequestTimeoutError,
                                                   ServerBusyError)
from radixserve.server_args import ServerArgs
from radixserve.validation import FIELD_PREFIX, first_error

logger = logging.getLogger("radixserve.server")

API_VERSION = "v1"
WATCHDOG_S = 1.0
SHUTDOWN_GRACE_S = 5.0  # after SIGTERM, requests in flight get this long before they are ended with an error
EXIT_DEADLINE_S = 30.0  # once shutting down, the process is gone within this long, whatever hangs
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("RADIXSERVE_HEALTH_CHECK_TIMEOUT", 20))
WARMUP_PROMPT = "The capital city of France is"  # SGLang's warm-up request, greedy, 8 tokens
WARMUP_INPUT_IDS = [10, 11, 12]  # its prompt for a model without a tokenizer
WARMUP_TIMEOUT_S = 600.0
_OPEN_PATHS = {"/health", "/metrics"}


def error_response(message: str, status: int = 400, param: str | None = None, err_type: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error_body(message, status, err_type, param), status, headers=headers)


async def _json_events(outputs: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Each output as an SSE event, in orjson as SGLang's server writes them
    (a tenth of ``json.dumps``'s time; NaN and infinities go out as null)."""
    async for out in outputs:
        yield b"data: " + orjson.dumps(out) + b"\n\n"


async def read_json(request: Request) -> Any:
    """The request's body as JSON; ``ValueError("body: ...")`` for anything
    that is not (bad UTF-8, bad syntax, nesting too deep, huge integers)."""
    data = await request.body()
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("body: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers of over 4300 digits
        raise ValueError(f"body: invalid JSON ({str(exc).splitlines()[0][:200]})") from None


def generate_input(body: Any) -> GenerateReqInput:
    """A /generate body as a checked ``GenerateReqInput``; ``ValueError`` naming the field."""
    return checked_body(body, GenerateReqInput)


def kv_limit_bytes(body: Any) -> int | None | tuple[str, str]:
    """The limit a ``/set_kv_limit`` body asks for, in bytes (None: no
    limit), or ``(field, message)`` when the body is not one of
    ``{"limit_bytes": int | null}`` and ``{"limit_gb": number | null}``."""
    if not isinstance(body, dict) or len(body.keys() & {"limit_bytes", "limit_gb"}) != 1 or len(body) != 1:
        return "limit_bytes", "body: exactly one of limit_bytes (an integer) and limit_gb (a number), or null"
    (name, value), = body.items()
    if value is None:
        return None
    whole = name == "limit_bytes"
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not 0 < value < 2**62:
        kind = "a positive integer" if whole else "a positive number"
        return name, f"{name}: {kind} or null, got {json.dumps(value)[:40]}"
    return int(value) if whole else int(value * 2**30)


def memory_tags(body: Any) -> list[str] | None | tuple[str, str]:
    """The ``tags`` of a ``/release_memory_occupation`` or
    ``/resume_memory_occupation`` body (None: all), or ``(field, message)``
    when the body is not ``{"tags": [str, ...] | null}`` (or empty). Which
    tags exist and can be released, the scheduler says."""
    if not isinstance(body, dict):
        return "body", 'body: a JSON object, e.g. {"tags": ["kv_cache", "weights"]}'
    extra = sorted(body.keys() - {"tags"})
    if extra:
        return extra[0], f"{extra[0]}: unknown field (only tags)"
    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        return "tags", f"tags: a list of tags (kv_cache, weights) or null, got {json.dumps(tags)[:40]}"
    return tags


class LoadLoRAAdapterBody(BaseModel):
    """SGLang's ``/load_lora_adapter`` body; ``pinned`` is accepted and
    ignored (pinning is not built, docs/lora.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterBody(BaseModel):
    """SGLang's ``/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str


def checked_body(body: Any, model: type[BaseModel]) -> BaseModel:
    """A JSON body as ``model`` (a /generate body, a LoRA load or unload),
    checked; ``ValueError`` naming the field."""
    if not isinstance(body, dict):
        raise ValueError("body: a JSON object is expected")
    try:
        return model(**body)
    except ValidationError as exc:
        raise first_error(exc) from None
    except TypeError as exc:  # a key that is not a Python identifier
        raise ValueError(f"body: {exc}") from None


def lora_update_response(ok: bool, message: str, loaded: dict[str, str]) -> JSONResponse:
    """SGLang's answer (``success``, ``error_message``, ``loaded_adapters``),
    200 or 400; a failure also carries the error in OpenAI's shape, with the
    field it names."""
    body = {"success": ok, "error_message": message or None, "loaded_adapters": loaded}
    if ok:
        return JSONResponse(body, 200)
    match = FIELD_PREFIX.match(message)
    return JSONResponse({**body, **error_body(message, 400, None, match.group(1) if match else None)}, 400)


def add_error_handlers(app: FastAPI) -> None:
    """The server's errors in OpenAI's shape: 400 naming the field for a
    refused request, 429, 503, 504 and a failed request's status."""
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response("body: invalid JSON", 400)
        return JSONResponse(validation_error_to_openai(errors), 400)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return JSONResponse(value_error_to_openai(exc), 400)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and not message.startswith("body:"):
            message = f"body: {message}"  # FastAPI's own body-parsing failures
        match = FIELD_PREFIX.match(message)
        return error_response(message, exc.status_code, param=match.group(1) if match else None, headers=exc.headers)

    @app.exception_handler(ServerBusyError)
    async def on_busy(request: Request, exc: ServerBusyError):
        return error_response(str(exc), 429, headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def on_dead(request: Request, exc: EngineDeadError):
        return error_response(str(exc), 503)

    @app.exception_handler(RequestTimeoutError)
    async def on_timeout(request: Request, exc: RequestTimeoutError):
        return error_response(str(exc), 504)

    @app.exception_handler(RequestFailedError)
    async def on_failed(request: Request, exc: RequestFailedError):
        return error_response(str(exc), exc.status_code)


def create_app(engine: EngineProcesses, args: ServerArgs) -> FastAPI:
    app = FastAPI(title="radixserve", version=radixserve.__version__)
    app.state.engine, app.state.args, app.state.healthy = engine, args, True
    app.state.ready = True  # launch_server holds it False until the warm-up request has finished
    tm = engine.tokenizer_manager
    add_error_handlers(app)
    # Outermost last: errors are caught around everything, then the body
    # limit, then the key is checked before any body is read.
    if args.api_key:
        app.add_middleware(http_guards.RequireApiKey, key=args.api_key, open_paths=_OPEN_PATHS)
    app.add_middleware(http_guards.LimitBody, limit=args.max_request_body_bytes)
    app.add_middleware(http_guards.CatchErrors)

    @app.get("/health")
    async def health():
        ok = app.state.healthy and app.state.ready and tm.dead is None
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not app.state.ready:
            return error_response("the server is warming up", 503)
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "ignore_eos": True}, log_metrics=False)
        gen = tm.generate_request(obj)

        async def run():
            async for _ in gen:
                pass

        try:
            await asyncio.wait_for(run(), HEALTH_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, RequestTimeoutError):
            return error_response(f"no token generated in time ({HEALTH_CHECK_TIMEOUT_S:g} s)", 503)
        finally:
            await gen.aclose()
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer name, which its router and bench_serving ask first
    async def get_model_info():
        info = engine.model_info
        return {"model_path": info["model_path"], "tokenizer_path": info["tokenizer_path"], "is_generation": True,
                "served_model_name": tm.served_model_name, "context_length": tm.context_len,
                "vocab_size": tm.vocab_size}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        states = await tm.get_internal_states()
        public = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
        # served_model_name resolved, as SGLang reports it: its router names the model by it
        return {**public, **engine.model_info, "served_model_name": tm.served_model_name,
                "version": radixserve.__version__, "api_version": API_VERSION, "internal_states": states}

    @app.get("/get_load")
    async def get_load():
        """The load SGLang's router polls (its power-of-two policy sums
        ``num_tokens``: KV tokens held by requests plus the prompts waiting),
        from the scheduler's latest report, so a poll never waits on it."""
        loads = []
        for dp_rank in range(len(tm.sends)):
            st = tm.replica_stats.get(dp_rank, {})
            waiting = st.get("waiting", 0)
            loads.append({"dp_rank": dp_rank, "num_reqs": st.get("running", 0) + waiting, "num_waiting_reqs": waiting,
                          "num_tokens": st.get("kv_used", 0) + st.get("waiting_tokens", 0)})
        return loads

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0, allow_inf_nan=False)):
        """SGLang's: empty the prefix cache (every tier but the files) and the
        grammar cache; refused (400) while requests run or wait, unless they
        end within ``timeout`` seconds."""
        ok, message = await tm.flush_cache(timeout)
        return Response("Cache flushed.\n", status_code=200) if ok else error_response(message, 400)

    @app.get("/get_kv_limit")
    async def get_kv_limit():
        """The elastic KV pool's run-time limit and usage, per replica (bytes)."""
        ok, message, states = await tm.kv_limit(False, None)
        return states if ok else error_response(message, 400)

    @app.post("/set_kv_limit")
    async def set_kv_limit(request: Request):
        """Set the elastic KV pool's limit on every replica (kvcached's
        ``kvctl limit``): ``{"limit_bytes": N}``, ``{"limit_gb": G}``, or
        null for the pool's whole size. Cached KV is evicted to meet it;
        admissions wait while running requests hold more (docs/elastic_kv.md)."""
        body = await read_json(request)
        parsed = kv_limit_bytes(body)
        if isinstance(parsed, tuple):
            return error_response(parsed[1], 400, parsed[0])
        ok, message, states = await tm.kv_limit(True, parsed)
        return states if ok else error_response(message, 400)

    async def memory_occupation(request: Request, release: bool):
        body = await read_json(request) if await request.body() else {}
        tags = memory_tags(body)
        if isinstance(tags, tuple):
            return error_response(tags[1], 400, tags[0])
        ok, message, states = await tm.memory_occupation(release, tags)
        match = FIELD_PREFIX.match(message)
        return states if ok else error_response(message, 400, match.group(1) if match else None)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        """SGLang's: give back the device memory of ``tags`` (kv_cache,
        weights; absent or null: both) on every replica, until
        ``/resume_memory_occupation``; requests sent meanwhile wait (docs/elastic_kv.md)."""
        return await memory_occupation(request, True)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        """SGLang's: take the memory of ``tags`` back; the waiting requests run."""
        return await memory_occupation(request, False)

    async def lora_update(request: Request, load: bool) -> JSONResponse:
        try:
            body = checked_body(await read_json(request), LoadLoRAAdapterBody if load else UnloadLoRAAdapterBody)
        except ValueError as exc:
            return lora_update_response(False, str(exc), dict(sorted(tm.lora_adapters.items())))
        if load:
            ok, message = await tm.load_lora_adapter(body.lora_name, body.lora_path)
        else:
            ok, message = await tm.unload_lora_adapter(body.lora_name)
        return lora_update_response(ok, message, dict(sorted(tm.lora_adapters.items())))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """SGLang's: read the PEFT adapter at ``lora_path`` as ``lora_name``
        on every rank (with --enable-lora); requests may name it at once (docs/lora.md)."""
        return await lora_update(request, True)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """SGLang's: requests can no longer name ``lora_name``; those running
        with it finish first, then the schedulers free it."""
        return await lora_update(request, False)

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request):
        """SGLang's profiler endpoint: the torch profiler on every scheduler
        rank (options: output_dir, num_steps, activities, with_stack,
        record_shapes, profile_id)."""
        body = await read_json(request) if await request.body() else {}
        if not isinstance(body, dict):
            return error_response("body: a JSON object of profiler options", 400)
        bad = check_profile_options(body, args.resolved_device(), args.resolved_torch_profiler_dir())
        if bad is not None:
            return error_response(bad[1], 400, bad[0])
        ok, message = await tm.profile("start", body)
        return Response(message, 200) if ok else error_response(message, 400)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        ok, message = await tm.profile("stop", {})
        return Response(message, 200) if ok else error_response(message, 400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            return error_response("rid: a request id (string) is required", 400, "rid")
        tm.abort_request(body["rid"])
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():  # from the figures the scheduler pushes: a scrape never waits for it
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(request: Request):
        obj = generate_input(await read_json(request))
        gen = tm.generate_request(obj, request)
        if obj.stream:
            outputs = await peek(gen)
            if args.incremental_streaming_output:
                outputs = incremental(outputs)
            return StreamingResponse(sse_stream(_json_events(outputs)), media_type="text/event-stream")
        outs = [o async for o in gen]
        if obj.is_single and len(outs) == 1:
            return outs[0]
        return sorted(outs, key=lambda o: o.get("index", 0))

    from radixserve.entrypoints.openai.serving import add_openai_routes

    add_openai_routes(app, tm, args.tool_call_parser, args.reasoning_parser)
    return app


def _announce(args: ServerArgs) -> None:
    print(f"radixserve is serving {args.model_name()} on http://{args.host}:{args.port}", flush=True)


async def _warm_up(app: FastAPI, server) -> None:
    """As SGLang's server: a few greedy tokens of a short prompt go through
    every stage before /health reports ready, so that no user request is the
    first to run a code path (kernel compilation and caches, a prefill, a
    decode, detokenizing). Not counted in the metrics. If it fails, the
    server stops (exit code 1)."""
    tm = app.state.engine.tokenizer_manager
    prompt = {"text": WARMUP_PROMPT} if tm.tokenizer is not None else {"input_ids": WARMUP_INPUT_IDS}
    obj = GenerateReqInput(**prompt, sampling_params={"max_new_tokens": 8, "temperature": 0.0}, log_metrics=False)
    out = None
    try:
        async def run():
            nonlocal out
            async for out in tm.generate_request(obj):  # noqa: B007 (the last one is read below)
                pass
        await asyncio.wait_for(run(), WARMUP_TIMEOUT_S)
        reason = (out or {}).get("meta_info", {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise RuntimeError(reason.get("message", "aborted"))
    except Exception as exc:  # the server cannot serve: say why and stop
        logger.error("the warm-up request failed (%s: %s); shutting down", type(exc).__name__, exc)
        app.state.healthy = False
        server.should_exit = True
        return
    app.state.ready = True
    _announce(app.state.args)


async def _watchdog(app: FastAPI, server) -> None:
    """A dead child ends every request with an error, makes the server
    unhealthy and then exit. Once the server is stopping (a signal or a dead
    child), requests get ``SHUTDOWN_GRACE_S`` to finish and are then ended,
    and a last-resort timer guarantees the process is gone."""
    engine: EngineProcesses = app.state.engine
    while not server.should_exit:
        await asyncio.sleep(WATCHDOG_S)
        dead = engine.dead()
        if dead and not server.should_exit:
            reason = f"child process(es) died: {', '.join(dead)}"
            logger.error("%s; shutting down", reason)
            app.state.healthy = False
            engine.tokenizer_manager.fail_all(reason)
            server.should_exit = True
    _exit_deadline(engine, EXIT_DEADLINE_S)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_GRACE_S
    while engine.tokenizer_manager.num_running_requests() and loop.time() < deadline:
        await asyncio.sleep(0.1)
    if engine.tokenizer_manager.dead is None:
        engine.tokenizer_manager.fail_all("the server is shutting down")


def _exit_deadline(engine: EngineProcesses, seconds: float) -> None:
    """Kill the children and exit(1) in ``seconds`` unless the process has exited by then."""

    def expire():
        logger.error("shutdown did not finish within %gs; exiting now", seconds)
        for p in engine.processes:
            if p.is_alive():
                p.kill()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def launch_server(args: ServerArgs, ranks: SchedulerRanks | None = None) -> int:
    """Start everything (``ranks``: the scheduler ranks, already started by
    ``serve.py``), serve until SIGINT/SIGTERM or a child's death;
    returns the exit code."""
    try:
        import uvicorn

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        max_connections = http_guards.resolved_max_connections(args.max_connections, raise_open_file_limit())
        bootstrap = start_bootstrap_server(args)  # before the schedulers, which register with it
    except BaseException:
        if ranks is not None:
            ranks.stop()
        raise
    try:
        engine = start_engine_processes(args, ranks)  # which stops the ranks itself if it fails
    except BaseException:
        if bootstrap is not None:
            bootstrap.close()
        raise
    if args.node_rank > 0:
        return _run_ranks_only(engine)
    app = create_app(engine, args)
    loop = "uvloop" if _has_uvloop() else "asyncio"
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, loop=loop, log_level=args.log_level, timeout_keep_alive=30,
        http=http_guards.protocol_with_header_timeout(args.http_header_timeout), limit_concurrency=max_connections,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5,
    ))

    app.state.ready = args.skip_server_warmup or args.disaggregation_mode != "null"
    freeze_startup_objects()

    @app.on_event("startup")
    async def _started():
        engine.tokenizer_manager.start()
        loop = asyncio.get_running_loop()
        loop.create_task(_watchdog(app, server))
        if app.state.ready:
            _announce(args)
        else:
            loop.create_task(_warm_up(app, server))

    # uvicorn re-raises the signal that stopped it once it has shut down; with
    # these no-op handlers that lands here, and we stop the children and exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown()
        if bootstrap is not None:
            bootstrap.close()
    return 0 if app.state.healthy else 1


def start_bootstrap_server(args: ServerArgs):
    """A prefill server's KV bootstrap server on ``--disaggregation-bootstrap-port``
    (docs/disaggregation.md), run by its node 0; None on other servers and nodes."""
    if args.disaggregation_mode != "prefill" or args.node_rank > 0:
        return None
    from radixserve.disaggregation import get_kv_classes

    return get_kv_classes(args.disaggregation_transfer_backend)["bootstrap_server"](
        args.host, args.disaggregation_bootstrap_port)


def _run_ranks_only(engine: EngineProcesses) -> int:
    """A node other than node 0 serves no HTTP: it runs its TP ranks until a
    signal or one of them dies (a dead rank ends the others' collectives)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"radixserve: TP ranks {', '.join(p.name for p in engine.processes)} running", flush=True)
    while not stop.wait(WATCHDOG_S):
        dead = [p for p in engine.processes if not p.is_alive()]
        if dead and all(p.exitcode == 0 for p in dead):  # node 0, stopping, closed them
            if len(dead) < len(engine.processes):
                continue  # the others are closing too
            logger.info("the TP ranks closed; exiting")
            engine.shutdown()
            return 0
        if dead:
            logger.error("child process(es) died: %s; exiting", ", ".join(p.name for p in dead))
            engine.shutdown()
            return 1
    engine.shutdown()
    return 0


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401

        return True
    except ImportError:
        return False

