"""What a grammar may cost: a compile over the memory or time limit is
refused before anything is queued (the trial runs in a child process), and
the scheduler's cache of compiled grammars stays within its bytes. SmolLM2's
tokenizer (49,152 tokens); on it a schema of N two-value enum properties
takes about N / 20 MB to compile. Over HTTP (a 400 naming the field while the
server serves, the cache in /metrics and emptied by /flush_cache): in
test_structured_output.py, whose server runs with these limits."""

from __future__ import annotations

import json
import time

import pytest


COMPILE_MB = 48  # the servers' and sandboxes' --grammar-compile-max-mb here
CACHE_MB = 1
# enum properties of a schema over COMPILE_MB: about 100 MB by the rule above (here the refusals come from
# 1,500 on, 1,200 compile within it); larger ones only take longer to reach the limit
OVER_LIMIT = 2000


def enum_schema(n: int, tag: str = "") -> dict:
    """An object of ``n`` enum properties (cheap to check, costly to compile)."""
    return {"type": "object", "properties": {f"{tag}p{i}": {"enum": [f"v{i}a", f"v{i}b"]} for i in range(n)}}


def small_schema(i: int) -> dict:
    """A distinct everyday schema (about 75 KB compiled on this vocabulary)."""
    return {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8},
                                             "count": {"type": "integer"}}, "required": [f"field_{i}"]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from radixserve.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)


def sandbox(tokenizer, max_mb: int, timeout_s: float):
    from radixserve.sampling.grammar_sandbox import GrammarSandbox
    from radixserve.feature_args import CompileLimits

    return GrammarSandbox(tokenizer, len(tokenizer), CompileLimits(max_mb, timeout_s))


# -- the sandbox --------------------------------------------------------------------------------


def test_a_compile_over_the_memory_limit_is_refused_and_remembered(tokenizer):
    box = sandbox(tokenizer, COMPILE_MB, 120)
    try:
        box.check("json_schema", json.dumps(small_schema(0)))
        bomb = json.dumps(enum_schema(OVER_LIMIT))
        with pytest.raises(ValueError, match=rf"^json_schema: .*more than {COMPILE_MB} MB \(--grammar-compile-max-mb"):
            box.check("json_schema", bomb)
        assert box.refused == 1
        box.check("regex", r"\d{3}-\d{4}")  # a fresh worker takes over
        with pytest.raises(ValueError, match="--grammar-compile-max-mb"):
            box.check("json_schema", bomb)
        assert box.refused == 1  # the verdict, not a second trial (which would count a second refusal)
        with pytest.raises(ValueError, match=r"^ebnf: invalid ebnf"):  # the compiler's own errors name the kind
            box.check("ebnf", 'root ::= "a" undefined_rule')
    finally:
        box.close()


def test_a_compile_over_the_time_limit_is_refused_and_its_worker_replaced(tokenizer):
    box = sandbox(tokenizer, 8192, 1.0)
    try:
        box.check("json_schema", json.dumps(small_schema(1)))  # the worker is up: the limit times the compile alone
        worker = box._worker.proc
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"^json_schema: .*more than 1 s \(--grammar-compile-timeout\)"):
            box.check("json_schema", json.dumps(enum_schema(8000)))
        assert time.monotonic() - start < 5
        assert worker.poll() is not None  # killed, not left compiling
        worker = None
        box.check("json_schema", json.dumps(small_schema(2)))
        box._worker.proc.kill()  # a worker that dies between trials is replaced too
        box._worker.proc.wait()
        box.check("json_schema", json.dumps(small_schema(3)))
    finally:
        box.close()


# -- the scheduler's cache of compiled grammars --------------------------------------------------


def test_the_compiled_grammar_cache_is_bounded_in_bytes_least_recently_used_out(tokenizer):
    from radixserve.sampling.grammar import GrammarBackend

    bound = 1_500_000
    backend = GrammarBackend(tokenizer, len(tokenizer), cache_max_bytes=bound)
    specs = [("json_schema", json.dumps(small_schema(i))) for i in range(12)]
    first = backend.submit(specs[0]).result()
    one = backend.entry_bytes(specs[0], first)
    assert 3 * one < bound < 10 * one  # so that twelve do not fit
    for spec in specs[1:6]:
        backend.submit(spec).result()
    assert backend.submit(specs[0]) is not None  # used again: now the most recent
    for spec in specs[6:]:
        backend.submit(spec).result()
    stats = backend.cache_stats()
    assert 0 < stats["grammar_cache_bytes"] <= bound and stats["grammar_cache_entries"] < len(specs)
    cached = set(backend._cache)
    assert specs[-1] in cached and specs[1] not in cached  # the oldest went first
    backend.clear_cache()
    assert backend.cache_stats() == {"grammar_cache_bytes": 0, "grammar_cache_entries": 0} and not backend._cache
    assert backend.submit(specs[0]).result().memory_size_bytes == first.memory_size_bytes  # compiles again


def test_what_the_grammar_cache_counts_is_the_heap_its_grammars_take(tokenizer):
    """The bound holds on the real memory: over many compiled grammars the
    heap grows by about what the cache counts (xgrammar's own size of a small
    JSON schema is a quarter of it), and a flush gives it all back."""
    import gc

    from radixserve.model_executor.cpu_malloc import heap_figures
    from radixserve.sampling.grammar import GrammarBackend

    backend = GrammarBackend(tokenizer, len(tokenizer), cache_max_bytes=1 << 40)
    backend.submit(("regex", "warm")).result()  # the compiler and its tokenizer info
    gc.collect()
    start, total = heap_figures()["malloc_in_use_bytes"], 0
    for kind, specs in [("json_schema", [json.dumps(small_schema(1000 + i)) for i in range(60)]),
                        ("regex", [rf"(yes|no|m{i}), \d{{1,3}} [a-z]{{2,{i % 5 + 3}}}" for i in range(60)])]:
        gc.collect()
        heap, counted = heap_figures()["malloc_in_use_bytes"], backend.cache_bytes
        for text in specs:
            backend.submit((kind, text)).result()
        gc.collect()
        grown, count = heap_figures()["malloc_in_use_bytes"] - heap, backend.cache_bytes - counted
        assert 0.6 * count < grown < 1.5 * count, (kind, grown, count)
        total += grown
    backend.clear_cache()
    gc.collect()
    assert heap_figures()["malloc_in_use_bytes"] - start < 0.1 * total
