"""The scheduler's side of structured output: requests waiting for their
grammar to compile, and the per-step grammar work of a batch (its token
masks, then feeding it the sampled tokens). The grammars themselves are
``sampling.grammar``'s."""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable

import torch

from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.sampling.grammar import GrammarBackend, grammar_spec

logger = logging.getLogger(__name__)

POLL_S = 0.005  # longest wait for a compilation when there is nothing else to do


class GrammarQueue:
    """Requests whose grammar compiles (``reqs``), for one model's tokenizer;
    without a tokenizer, structured output is refused."""

    def __init__(self, tokenizer, vocab_size: int, cache_max_bytes: int):
        self.backend = GrammarBackend(tokenizer, vocab_size, cache_max_bytes) if tokenizer is not None else None
        self.reqs: list[Req] = []
        self.used = False  # until a first grammar, no batch is scanned for one

    def clear_cache(self) -> None:
        if self.backend is not None:
            self.backend.clear_cache()

    def cache_stats(self) -> dict[str, int]:
        """The compiled-grammar cache's size (``/metrics``, ``/get_server_info``)."""
        return self.backend.cache_stats() if self.backend is not None else {}

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, req: Req, spec: tuple[str, str]) -> None:
        """Start compiling ``spec`` for ``req``, which waits here meanwhile."""
        if self.backend is None:
            raise ValueError(f"{spec[0]}: structured output needs the model's tokenizer")
        req.grammar_future = self.backend.submit(spec)
        self.reqs.append(req)
        self.used = True

    def pop_compiled(self, agree: Callable[[list[str]], list[str]] | None = None) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, now with a matcher; requests whose
        grammar failed to compile, finished with an abort). ``agree`` turns
        the rids compiled here into those every TP rank takes now (rank 0's);
        a rank whose compilation is behind waits for it."""
        done = [r.rid for r in self.reqs if r.grammar_future.done()]
        taken = set(agree(done) if agree is not None else done)
        ready, failed, still = [], [], []
        for req in self.reqs:
            if req.rid not in taken:
                still.append(req)
                continue
            try:
                req.grammar = self.backend.matcher(req.grammar_future.result())
                ready.append(req)
            except Exception as exc:  # a grammar check at the edge passed, but compiling it failed
                kind = grammar_spec(req.sampling_params)[0]
                req.finished_reason = FinishReason.refused(f"sampling_params.{kind}: {exc}")
                failed.append(req)
        self.reqs = still
        return ready, failed

    def wait(self) -> None:
        """Block until a compilation ends, for at most ``POLL_S``."""
        futures.wait([r.grammar_future for r in self.reqs], POLL_S, futures.FIRST_COMPLETED)

    def constrained(self, reqs: list[Req]) -> bool:
        """Whether any of ``reqs`` has a grammar."""
        return self.used and any(r.grammar is not None for r in reqs)

    def vocab_mask(self, reqs: list[Req]) -> torch.Tensor | None:
        """The batch's token bitmask, or None when no request has a grammar.
        A request that finished meanwhile (its token will be dropped) gets none."""
        if not self.constrained(reqs):
            return None
        return self.backend.bitmask([None if r.finished() else r.grammar for r in reqs])

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.backend.apply(logits, mask)

    def advance(self, reqs: list[Req]) -> None:
        """Feed each request's new token to its grammar, all at once; a grammar
        that has ended finishes its request (the sampled token was one it allows)."""
        accepted = self.backend.accept([r.grammar for r in reqs], [r.output_ids[-1] for r in reqs])
        for req, ok in zip(reqs, accepted):
            if not ok:  # the mask allowed it: a bug, but one request's
                logger.error("request %s aborted: its grammar refused token %d", req.rid, req.output_ids[-1])
                req.finished_reason = FinishReason.failed("internal error: the grammar refused a token")
            elif req.finished_reason is None and req.grammar.is_terminated():
                req.finished_reason = FinishReason.stopped(req.output_ids[-1])
