"""Servers that several test modules share: a SmolLM2 server starts in about
10 s on a small CPU, so the modules whose server options are the same share
one instead of starting one each. The modules that use a shared server run
one after another, those of each server together and in order, all of them
where the first of them is in the suite; each server stops after the last
test that uses it. The first shared server is started when a test asks for
it; the others that the selected tests use are then started one after
another in the background, while the tests of the first run (those keep
about one core of two busy), so that no shared server sits idle in memory
while other modules start servers of their own."""

from __future__ import annotations

import functools
import os

import httpx._transports.default as httpx_transport
import pytest

from server_harness import ONE_THREAD, Prestarted, ServerProcess
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

# shared server fixture -> its ServerProcess arguments and keyword arguments (every one with one torch
# thread: no check depends on the number of threads)
SHARED_SERVERS = {
    "smollm2_keyed": (("--max-total-tokens", "16384", "--max-running-requests", "64"),
                      {"api_key": "test-key", "env": ONE_THREAD}),
    "smollm2_parsers": (("--max-total-tokens", "16384", "--tool-call-parser", "qwen", "--reasoning-parser", "qwen3"),
                        {"env": ONE_THREAD}),
    "smollm2_open": (("--max-total-tokens", "16384", "--grammar-compile-max-mb", str(COMPILE_MB),
                      "--grammar-cache-max-mb", str(CACHE_MB)), {"env": ONE_THREAD}),
}
_LAST_TEST = pytest.StashKey[dict]()  # shared server fixture -> node id of the last test that uses it
_USED = pytest.StashKey[list]()  # the shared server fixtures the selected tests use, in the order of first use
_RUNNING = pytest.StashKey[dict]()  # shared server fixture -> its ServerProcess, once started
_BACKGROUND = pytest.StashKey[Prestarted]()  # the other shared servers, started after the first


def _serve(request):
    name, stash = request.fixturename, request.config.stash
    background = stash.get(_BACKGROUND, None)
    if background is not None and name in background:
        srv = background.get(name)
    else:
        args, kwargs = SHARED_SERVERS[name]
        srv = ServerProcess(*args, **kwargs)
    running = stash.setdefault(_RUNNING, {})
    running[name] = srv
    if background is None:
        later = [n for n in stash.get(_USED, []) if n not in running]
        stash[_BACKGROUND] = Prestarted({n: SHARED_SERVERS[n] for n in later})
    yield srv
    assert srv.stop() == 0, "SIGTERM shuts the server down cleanly"


@pytest.fixture(scope="session")
def smollm2_keyed(request):
    """SmolLM2 behind an API key (``.api_key``, ``.headers()``), 64 requests
    at a time: the native and OpenAI APIs and hostile clients
    (test_server_native.py, test_server_openai.py, test_hostile.py)."""
    yield from _serve(request)


@pytest.fixture(scope="session")
def smollm2_parsers(request):
    """SmolLM2 with both output parsers, for test_server_openai.py's tools
    and reasoning."""
    yield from _serve(request)


@pytest.fixture(scope="session")
def smollm2_open(request):
    """SmolLM2 without a key, for SGLang's own clients, which send none
    (test_sglang_clients.py), with test_grammar_limits.py's grammar limits
    (test_structured_output.py)."""
    yield from _serve(request)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    """Move the modules that use a shared server next to the first of them
    (each module's tests stay together and in order), those of every shared
    server together, and note the order in which the shared servers are
    first used and the last test of each."""
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
    shared = list(first_user.values())
    ordered = []
    for tests in blocks:
        if any(tests is later for later in shared[1:]):
            continue
        ordered.append(tests)
        if shared and tests is shared[0]:
            ordered.extend(shared[1:])
    items[:] = [item for tests in ordered for item in tests]
    used = [n for n in SHARED_SERVERS if any(n in t.fixturenames for t in items)]
    config.stash[_USED] = sorted(used, key=lambda n: next(i for i, t in enumerate(items) if n in t.fixturenames))
    config.stash[_LAST_TEST] = {name: next(t.nodeid for t in reversed(items) if name in t.fixturenames)
                                for name in used}


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


def pytest_sessionfinish(session):
    """Stop the shared servers started in the background for tests that never asked for them."""
    background = session.config.stash.get(_BACKGROUND, None)
    if background is not None:
        background.stop()
