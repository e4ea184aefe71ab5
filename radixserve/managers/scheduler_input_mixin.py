"""How a request enters and leaves the Scheduler's queues before it runs:
building and validating its ``Req``, the waiting (or grammar) queue, aborts."""

from __future__ import annotations

from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.managers.schedule_policy import prefix_key
from radixserve.sampling.grammar import grammar_spec
from radixserve.sampling.sampling_params import SamplingParams


class SchedulerInputMixin:
    """Request intake of :class:`Scheduler` (whose state it uses)."""

    def new_req(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, return_logprob: bool = False,
                logprob_start_len: int = -1, top_logprobs_num: int = 0,
                token_ids_logprob: list[int] | None = None, lora_path: str | None = None) -> Req:
        """The one way a request becomes a ``Req``: its params checked against
        the vocabulary and normalized, the model's EOS ids attached, its LoRA
        adapter (``lora_path``, a loaded adapter's name) resolved. Raises
        ``ValueError`` naming the field."""
        sampling_params.verify(self.vocab_size)
        sampling_params.normalize(self.vocab_size)
        req = Req(rid, input_ids, sampling_params, self.eos_token_ids, return_logprob, logprob_start_len,
                  top_logprobs_num, token_ids_logprob)
        if lora_path is not None:
            manager = self.model_runner.lora_manager
            if manager is None:
                raise ValueError(f"lora_path: this server serves no LoRA adapters (start it with --enable-lora), "
                                 f"got {lora_path!r}")
            req.lora_path, req.lora_id = lora_path, manager.resolve(lora_path)
        return req

    def validate(self, req: Req) -> None:
        """Raise ValueError (naming the field) for a request that cannot run."""
        n = len(req.origin_input_ids)
        if n == 0:
            raise ValueError("input_ids: the prompt is empty")
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n >= self.context_len:
            raise ValueError(
                f"input_ids: the prompt has {n} tokens, the context window is {self.context_len} "
                f"(prompt plus at least one output token)"
            )
        if n + 1 > self.allocator.size:
            raise ValueError(f"input_ids: the prompt has {n} tokens, the KV pool only {self.allocator.size}")
        bad = [t for t in req.token_ids_logprob or () if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        req.sampling_params.verify(self.vocab_size)

    def add_request(self, req: Req) -> None:
        self.validate(req)
        sp = req.sampling_params
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - len(req.origin_input_ids))
        req.init_stop_matching(self.tokenizer)
        self.stats.prompt_tokens += len(req.origin_input_ids)
        if not self.disagg.take(req):  # a request with a bootstrap room goes through its transfer first
            self.tree_cache.prefetch(prefix_key(req))
            self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """Into the waiting queue, or the grammar queue until its grammar compiles."""
        spec = grammar_spec(req.sampling_params)
        if spec is None:
            self.waiting.append(req)
        else:
            self.grammar_queue.add(req, spec)

    def abort_request(self, rid: str) -> bool:
        """Abort a waiting or running request; its KV comes back. True if found."""
        for queue in (self.waiting, self.grammar_queue.reqs):
            for i, req in enumerate(queue):
                if req.rid == rid:
                    queue.pop(i)
                    if req.kv_sender is not None:  # bootstrapped, not prefilled yet: the decode side is told
                        req.kv_sender.abort()
                        req.kv_sender.clear()
                    req.finished_reason = FinishReason.aborted("aborted by request")
                    self._finished_outside_batch.append(req)
                    return True
        for req in self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else []) + self.parked_reqs():
            if req.rid == rid:
                req.to_abort = True
                return True
        return self.disagg.abort(rid)
