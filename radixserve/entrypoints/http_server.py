"""The HTTP server: SGLang's native API (/generate, /health, ...) and the
OpenAI API (/v1/...), on FastAPI + uvicorn, in front of the TokenizerManager.

    radixserve serve --model-path ... [--host 127.0.0.1] [--port 30000] [--api-key KEY]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

import radixserve
from radixserve.entrypoints.launcher import EngineProcesses, start_engine_processes
from radixserve.entrypoints.openai.adapters import openai_error, validation_error_to_openai, value_error_to_openai
from radixserve.entrypoints.streaming import peek, sse_stream
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.server_args import ServerArgs

logger = logging.getLogger("radixserve.server")

API_VERSION = "v1"
WATCHDOG_S = 1.0
_OPEN_PATHS = {"/health", "/metrics"}


def error_response(message: str, status: int = 400, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    err_type = err_type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error")
    return JSONResponse(openai_error(message, err_type, param, status), status)


async def _json_events(outputs: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for out in outputs:
        yield "data: " + json.dumps(out, ensure_ascii=False) + "\n\n"


def _generate_input(body: Any) -> GenerateReqInput:
    if not isinstance(body, dict):
        raise ValueError("body: a JSON object is expected")
    known = {f.name for f in dataclasses.fields(GenerateReqInput)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field")
    return GenerateReqInput(**body)


def create_app(engine: EngineProcesses, args: ServerArgs) -> FastAPI:
    app = FastAPI(title="radixserve", version=radixserve.__version__)
    app.state.engine, app.state.args, app.state.healthy = engine, args, True
    tm = engine.tokenizer_manager

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if args.api_key and request.url.path not in _OPEN_PATHS:
            if request.headers.get("authorization", "") != f"Bearer {args.api_key}":
                return error_response("invalid or missing API key", 401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response("body: invalid JSON", 400)
        return JSONResponse(validation_error_to_openai(errors), 400)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return JSONResponse(value_error_to_openai(exc), 400)

    @app.get("/health")
    async def health():
        return Response(status_code=200) if app.state.healthy else Response(status_code=503)

    @app.get("/health_generate")
    async def health_generate():
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "ignore_eos": True})
        async for _ in tm.generate_request(obj):
            pass
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        info = engine.model_info
        return {"model_path": info["model_path"], "tokenizer_path": info["tokenizer_path"], "is_generation": True,
                "served_model_name": tm.served_model_name, "context_length": tm.context_len,
                "vocab_size": tm.vocab_size}

    @app.get("/get_server_info")
    async def get_server_info():
        state = await tm.get_internal_state()
        return {**dataclasses.asdict(args), **engine.model_info, "version": radixserve.__version__,
                "api_version": API_VERSION, "internal_states": [state]}

    @app.post("/flush_cache")
    async def flush_cache():
        if tm.num_running_requests() or not await tm.flush_cache():
            return error_response("cannot flush the cache while requests are running", 400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            return error_response("rid: a request id (string) is required", 400, "rid")
        tm.abort_request(body["rid"])
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        tm.metrics.update_from_state(await tm.get_internal_state())
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return error_response(f"body: invalid JSON ({exc.msg})", 400)
        obj = _generate_input(body)
        gen = tm.generate_request(obj, request)
        if obj.stream:
            return StreamingResponse(sse_stream(_json_events(await peek(gen))), media_type="text/event-stream")
        outs = [o async for o in gen]
        if obj.is_single and len(outs) == 1:
            return outs[0]
        return sorted(outs, key=lambda o: o.get("index", 0))

    from radixserve.entrypoints.openai.serving import add_openai_routes

    add_openai_routes(app, tm)
    return app


async def _watchdog(app: FastAPI, server) -> None:
    """A dead child process makes the server unhealthy and then exit."""
    engine: EngineProcesses = app.state.engine
    while True:
        await asyncio.sleep(WATCHDOG_S)
        dead = engine.dead()
        if dead:
            logger.error("child process(es) died: %s; shutting down", ", ".join(dead))
            app.state.healthy = False
            server.should_exit = True
            return


def launch_server(args: ServerArgs) -> int:
    """Start everything, serve until SIGINT/SIGTERM or a child's death; returns the exit code."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = start_engine_processes(args)
    app = create_app(engine, args)
    loop = "uvloop" if _has_uvloop() else "asyncio"
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, loop=loop,
                                           log_level=args.log_level, timeout_keep_alive=30))

    @app.on_event("startup")
    async def _started():
        engine.tokenizer_manager.start()
        asyncio.get_running_loop().create_task(_watchdog(app, server))
        print(f"radixserve is serving {args.model_name()} on http://{args.host}:{args.port}", flush=True)

    # uvicorn re-raises the signal that stopped it once it has shut down; with
    # these no-op handlers that lands here, and we stop the children and exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0 if app.state.healthy else 1


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401

        return True
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="radixserve serve", description="Start the radixserve HTTP server")
    ServerArgs.add_cli_args(parser)
    return launch_server(ServerArgs.from_cli_args(parser.parse_args(argv)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
