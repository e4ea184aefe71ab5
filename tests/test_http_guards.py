"""The HTTP guards on a test-local FastAPI app: the last-resort error catch,
the body limit and the API key, each answering in OpenAI's error shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from radixserve.entrypoints.http_guards import CatchErrors, LimitBody, RequireApiKey, resolved_max_connections


def make_app() -> FastAPI:
    app = FastAPI()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug with secret details")

    @app.post("/echo")
    async def echo(request: Request):
        return {"size": len(await request.body())}

    app.add_middleware(RequireApiKey, key="k", open_paths={"/open"})
    app.add_middleware(LimitBody, limit=1000)
    app.add_middleware(CatchErrors)
    return app


def test_an_unhandled_error_is_a_json_500_and_one_log_line(caplog):
    client = TestClient(make_app(), raise_server_exceptions=False)
    with caplog.at_level(logging.INFO, logger="radixserve.server"):
        r = client.get("/boom", headers={"Authorization": "Bearer k"})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal server error (RuntimeError)", "type": "server_error",
                                 "param": None, "code": 500}
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and "secret details" in errors[0].getMessage() and errors[0].exc_info is None
    with caplog.at_level(logging.DEBUG, logger="radixserve.server"):
        client.get("/boom", headers={"Authorization": "Bearer k"})
    assert any(rec.exc_info for rec in caplog.records if rec.levelno == logging.DEBUG), "traceback at debug level"


def test_body_limit_by_length_and_by_bytes_read():
    client = TestClient(make_app())
    auth = {"Authorization": "Bearer k"}
    assert client.post("/echo", content=b"x" * 1000, headers=auth).json() == {"size": 1000}
    r = client.post("/echo", content=b"x" * 1001, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    r = client.post("/echo", content=iter([b"x" * 600, b"x" * 600]), headers=auth)  # chunked: no length
    assert r.status_code == 413 and "1000 bytes" in r.text  # the server shapes it (test_hostile)


def test_api_key():
    client = TestClient(make_app())
    r = client.post("/echo", content=b"x")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.post("/echo", content=b"x", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/open").status_code == 404, "open paths need no key"


def test_max_connections_default_fits_the_open_file_limit():
    assert resolved_max_connections(None, 1 << 20) == 4096
    assert resolved_max_connections(None, 1024) == 1024 - 128
    assert resolved_max_connections(50, 1024) == 50
