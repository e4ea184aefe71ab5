"""Servers that several test modules share: a SmolLM2 server starts in about
10 s on a small CPU, so the modules whose server options are the same share
one instead of starting one each. The modules that use a shared server run
one after another (where the first of them is in the suite), and the server
stops after the last test that uses it, so that no shared server sits idle
in memory while other modules start servers of their own."""

from __future__ import annotations

import functools
import os

import httpx._transports.default as httpx_transport
import pytest

from server_harness import ONE_THREAD, ServerProcess
from test_grammar_limits import CACHE_MB, COMPILE_MB

_create_ssl_context = httpx_transport.create_ssl_context


@functools.lru_cache(maxsize=None)
def _default_ssl_context(trust_env: bool, cert_file: str | None, cert_dir: str | None):
    return _create_ssl_context(verify=True, cert=None, trust_env=trust_env)


def _shared_default_ssl_context(verify=True, cert=None, trust_env=True):
    """httpx builds a new SSL context, loading the whole CA bundle (25-60 ms
    of CPU), for every client, and ``httpx.get``/``post``/``stream`` make a
    client per call: the tests make thousands of calls (every poll of a
    server's state), all to plain-HTTP servers that never use the context,
    and on a 2-core machine that CPU is taken from the servers under test.
    The default context is built once per CA setting and shared; any other
    is built as httpx builds it."""
    if verify is True and cert is None:
        return _default_ssl_context(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    return _create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)


httpx_transport.create_ssl_context = _shared_default_ssl_context

SHARED_SERVERS = ("smollm2_keyed", "smollm2_open")
_LAST_TEST = pytest.StashKey[dict]()  # shared server fixture -> node id of the last test that uses it
_RUNNING = pytest.StashKey[dict]()  # shared server fixture -> its ServerProcess, once started


def _serve(request, *args: str, **kwargs):
    srv = ServerProcess(*args, env=ONE_THREAD, **kwargs)  # no check depends on the number of threads
    request.config.stash.setdefault(_RUNNING, {})[request.fixturename] = srv
    yield srv
    assert srv.stop() == 0, "SIGTERM shuts the server down cleanly"


@pytest.fixture(scope="session")
def smollm2_keyed(request):
    """SmolLM2 behind an API key (``.api_key``, ``.headers()``), 64 requests
    at a time: the native and OpenAI APIs and hostile clients
    (test_server_native.py, test_server_openai.py, test_hostile.py)."""
    yield from _serve(request, "--max-total-tokens", "16384", "--max-running-requests", "64", api_key="test-key")


@pytest.fixture(scope="session")
def smollm2_open(request):
    """SmolLM2 without a key, for SGLang's own clients, which send none
    (test_sglang_clients.py), with test_grammar_limits.py's grammar limits
    (test_structured_output.py)."""
    yield from _serve(request, "--max-total-tokens", "16384", "--grammar-compile-max-mb", str(COMPILE_MB),
                      "--grammar-cache-max-mb", str(CACHE_MB))


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    """Move the modules that use a shared server next to the first of them
    (each module's tests stay together and in order), and note the last test
    of each shared server."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    blocks, first_user = [], {}
    for tests in modules.values():
        name = next((n for n in SHARED_SERVERS if any(n in t.fixturenames for t in tests)), None)
        if name in first_user:
            first_user[name].extend(tests)
            continue
        blocks.append(tests)
        if name is not None:
            first_user[name] = tests
    items[:] = [item for tests in blocks for item in tests]
    config.stash[_LAST_TEST] = {name: next(t.nodeid for t in reversed(items) if name in t.fixturenames)
                                for name in first_user}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop a shared server once the last test that uses it is torn down
    (its session fixture's teardown checks the exit code at the end)."""
    result = yield
    running = item.config.stash.get(_RUNNING, {})
    for name, nodeid in item.config.stash.get(_LAST_TEST, {}).items():
        if nodeid == item.nodeid and name in running:
            running[name].stop()
    return result
