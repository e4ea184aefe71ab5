"""Structured output on xgrammar: a request's ``json_schema``, ``regex``,
``ebnf`` or ``structural_tag`` becomes a grammar; each step, the grammar's
matcher says which tokens may come next (a bitmask over the vocabulary, one
row per request), the sampler sees -inf logits for the others, and the
matcher then accepts the token sampled.

- ``check_grammar`` validates a spec without a tokenizer (the HTTP edge: a
  bad schema is a 400 before anything is queued).
- ``GrammarBackend`` compiles specs against the model's tokenizer on its own
  threads, caching by spec, so a compilation never stalls a step; the
  scheduler holds a request back until its grammar is ready. The cache is
  bounded in bytes (``--grammar-cache-max-mb``, least recently used out) and
  emptied by ``/flush_cache``; what a compile may take is bounded before it
  starts (``grammar_sandbox``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
COMPILE_THREADS = 2
# One thread fills a batch's masks: more lost to contention in the scheduler
# process (64 rows took 0.4 ms alone on an H200 host, but longer on 8 threads).
FILL_THREADS = 1


def grammar_spec(params: Any) -> tuple[str, str] | None:
    """``(kind, text)`` of the one grammar ``params`` asks for, or None."""
    given = [(name, getattr(params, name)) for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    return given[0] if given else None


def _xgrammar():
    import xgrammar

    return xgrammar


def check_grammar(kind: str, text: str) -> None:
    """Raise ``ValueError("<kind>: invalid ...")`` if ``text`` is not a valid
    ``kind`` grammar. Builds the grammar alone (no token masks), which takes
    milliseconds."""
    xgr = _xgrammar()
    try:
        if kind == "json_schema":
            json.loads(text)
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            _structural_tag(xgr, text, xgr.Grammar.from_structural_tag)
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{kind}: invalid {kind.replace('_', ' ')}: {first_line(exc)}") from None


def compile_spec(compiler, kind: str, text: str):
    """``(kind, text)`` compiled by an xgrammar ``GrammarCompiler``."""
    compile_fn = {"json_schema": compiler.compile_json_schema, "regex": compiler.compile_regex,
                  "ebnf": compiler.compile_grammar}.get(kind)
    if compile_fn is not None:
        return compile_fn(text)
    return _structural_tag(_xgrammar(), text, compiler.compile_structural_tag)


def _structural_tag(xgr, text: str, build):
    """SGLang's structural tag (``{"structures": [...], "triggers": [...]}``)
    or xgrammar's own format, built with ``build``."""
    spec = json.loads(text)
    if isinstance(spec, dict) and "structures" in spec:
        try:
            tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in spec["structures"]]
            triggers = list(spec["triggers"])
        except (KeyError, TypeError) as exc:
            raise ValueError("'structures' must be a list of {begin, schema, end} objects and 'triggers' a list "
                             f"of strings ({type(exc).__name__}: {exc})") from None
        return build(tags, triggers)
    return build(text)


def first_line(exc: Exception) -> str:
    """xgrammar's message without its "[time] source-file:line:" prefix."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _SOURCE_PREFIX.sub("", text)


_SOURCE_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+:\d+:\s*)?")


# Heap a compiled grammar takes beyond xgrammar's ``memory_size_bytes``, by kind (measured with glibc's
# mallinfo2 over many grammars: a small JSON schema takes about 254 KB, of which xgrammar counts 60; a
# 200-property one 2.5 MB, of which it counts 2.1; regexes and EBNF grammars a few KB more than counted).
UNCOUNTED_HEAP = {"json_schema": 200 << 10, "structural_tag": 200 << 10}
UNCOUNTED_HEAP_OTHER = 4 << 10


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary and builds the
    batch bitmask. Thread-safe for ``submit``; the rest runs on the scheduler.

    The cache holds ``spec -> future``; a compiled entry weighs the heap it
    takes (:meth:`entry_bytes`), and entries go least recently used
    first while the total is over ``cache_max_bytes`` (compilations in flight
    weigh nothing until they end). A request holds its own grammar, so
    eviction never takes one from a request that has it."""

    def __init__(self, tokenizer, vocab_size: int, cache_max_bytes: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_max_bytes = cache_max_bytes
        self._compiler = None
        self._compiler_lock = threading.Lock()  # the first compilation builds the compiler (about a second)
        self._lock = threading.RLock()  # a future done at once calls back under submit's lock
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # compiled entries' bytes
        self.cache_bytes = 0
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._batch = None  # xgrammar's multi-threaded mask filler, made on first use
        # host seconds spent in each part (bench.structured_output reports them)
        self.timings = {"compile_s": 0.0, "fill_s": 0.0, "apply_s": 0.0, "accept_s": 0.0}

    def submit(self, spec: tuple[str, str]) -> Future:
        """A future compiled grammar for ``spec``; equal specs share one compilation."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._cache[spec] = self._pool.submit(self._compile, spec)
            fut.add_done_callback(lambda done: self._weigh(spec, done))
            return fut

    def clear_cache(self) -> None:
        """Forget every compiled grammar (``/flush_cache``); requests keep theirs."""
        with self._lock:
            self._cache.clear()
            self._sizes.clear()
            self.cache_bytes = 0

    def cache_stats(self) -> dict[str, int]:
        with self._lock:
            return {"grammar_cache_bytes": self.cache_bytes, "grammar_cache_entries": len(self._sizes)}

    def _weigh(self, spec: tuple[str, str], fut: Future) -> None:
        with self._lock:
            if self._cache.get(spec) is not fut:  # flushed while it compiled
                return
            size = self.entry_bytes(spec, fut.result() if fut.exception() is None else None)
            self._sizes[spec] = size
            self.cache_bytes += size
            for old in [s for s in self._cache if s in self._sizes]:  # oldest first
                if self.cache_bytes <= self.cache_max_bytes:
                    break
                del self._cache[old]
                self.cache_bytes -= self._sizes.pop(old)

    @staticmethod
    def entry_bytes(spec: tuple[str, str], compiled) -> int:
        """What a cached grammar weighs: its text, xgrammar's own count of
        its size (``memory_size_bytes``), and the heap that count misses
        (``UNCOUNTED_HEAP``); a failed compilation, its text."""
        if compiled is None:
            return len(spec[1])
        return len(spec[1]) + compiled.memory_size_bytes + UNCOUNTED_HEAP.get(spec[0], UNCOUNTED_HEAP_OTHER)

    def _compile(self, spec: tuple[str, str]):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                # no cache of xgrammar's own: this one is bounded and flushed
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        start = time.perf_counter()
        try:
            return compile_spec(self._compiler, *spec)
        finally:
            self.timings["compile_s"] += time.perf_counter() - start

    @staticmethod
    def matcher(compiled) -> Any:
        """A fresh matcher: the state of one request's output in its grammar."""
        return _xgrammar().GrammarMatcher(compiled)

    def bitmask(self, matchers: list) -> torch.Tensor | None:
        """The allowed next tokens of a batch, one row per request (``None``
        for an unconstrained request: all allowed); None when no row is
        constrained. Rows are filled on xgrammar's threads; on a GPU host the
        mask is in pinned memory, so that its copy to the device is queued
        behind the forward instead of waiting for it."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        start = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(matchers), words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        if self._batch is None:
            self._batch = _xgrammar().BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], mask, rows)
        self.timings["fill_s"] += time.perf_counter() - start
        return mask

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (queued on
        the device's stream on a GPU: no sync)."""
        start = time.perf_counter()
        _xgrammar().apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True))
        self.timings["apply_s"] += time.perf_counter() - start

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Advance each matcher by its request's sampled token; False where
        the grammar refuses it."""
        start = time.perf_counter()
        ok = _xgrammar().BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        self.timings["accept_s"] += time.perf_counter() - start
        return ok
