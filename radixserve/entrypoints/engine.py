"""The offline ``Engine``: the Scheduler driven in-process, no HTTP.

    with radixserve.Engine(model_path=...) as engine:
        out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, Iterator

from tqdm import tqdm

from radixserve.managers.detokenizer_manager import DecodeStatus, NullTokenizer
from radixserve.managers.schedule_batch import Req
from radixserve.managers.scheduler_factory import build_scheduler
from radixserve.model_executor.cpu_malloc import HeapTrimmer
from radixserve.sampling.grammar import check_grammar, grammar_spec
from radixserve.sampling.grammar_sandbox import GrammarSandbox
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


class Engine:
    """Loads the model, owns a Scheduler and runs it until requests finish.

    ``generate`` takes a prompt (or list), token ids (or list) and sampling
    parameters (a dict, or one per prompt) with SGLang's field names, and
    returns ``{text, output_ids, meta_info}`` per request.
    """

    def __init__(self, model_path: str | None = None, **options: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **options)
        if self.server_args.dp_size > 1:
            raise ValueError("dp_size: the offline Engine runs one replica (with tp_size ranks); "
                             "data parallelism is a server option (--dp-size)")
        if self.server_args.disaggregation_mode != "null":
            raise ValueError("disaggregation_mode: prefill and decode servers are HTTP servers "
                             "(radixserve serve --disaggregation-mode ...); the offline Engine runs both halves")
        if self.server_args.tp_size * self.server_args.pp_size > 1:  # rank 0 here, the others in processes (engine_tp.py)
            from radixserve.entrypoints.engine_tp import TpLeader

            self.scheduler = TpLeader(self.server_args)
        else:
            self.scheduler = build_scheduler(self.server_args)
        self.tokenizer = self.scheduler.tokenizer
        self._counter = itertools.count()
        # freed blocks are kept for reuse on a CPU (cpu_malloc.py): a long run's fragmented heap goes back every 30 s
        self._heap = HeapTrimmer()
        self._grammar_sandbox = (GrammarSandbox(self.tokenizer, self.scheduler.vocab_size,
                                                self.server_args.grammar_compile_limits())
                                 if self.tokenizer is not None else None)

    # -- API -------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        rid: str | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one request (returns a dict) or a batch (a list).
        With ``stream=True`` (one request) returns an iterator of cumulative
        outputs, the last one with ``meta_info.finish_reason`` set.
        ``token_ids_logprob`` (with ``return_logprob``; one list of ids, or one
        per prompt) adds those ids' logprobs at every position scored, as
        ``input_token_ids_logprobs`` and ``output_token_ids_logprobs``.
        ``lora_path`` (with ``enable_lora``) names the LoRA adapter of every
        prompt, or one per prompt (None: the base model); docs/lora.md."""
        self._check_resident()
        single, token_lists = self._inputs(prompt, input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"sampling_params: {len(params)} given for {len(token_lists)} prompts")
        by_ids = _per_prompt_token_ids(token_ids_logprob if return_logprob else None, len(token_lists))
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(token_lists)
        if len(adapters) != len(token_lists):
            raise ValueError(f"lora_path: {len(adapters)} given for {len(token_lists)} prompts")
        reqs = [
            r
            for i, (ids, p) in enumerate(zip(token_lists, params))
            for r in self._make_reqs(ids, p, return_logprob, logprob_start_len, top_logprobs_num,
                                     rid if single else None, by_ids[i], adapters[i])
        ]
        if stream:
            if len(reqs) != 1:
                raise ValueError("stream: streaming takes exactly one prompt with n=1")
            return self._stream(reqs[0])
        outputs = self._run(reqs)
        return outputs[0] if single and len(outputs) == 1 else outputs

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The model's chat template applied to ``messages`` with a generation prompt."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_kv_limit(self) -> dict:
        """The elastic KV pool's run-time limit and what it bounds (bytes)."""
        return self._kv_limit(False, None)

    def set_kv_limit(self, limit_bytes: int | None) -> dict:
        """Set the elastic KV pool's run-time limit (None: its whole size):
        cached KV is evicted to meet it, and admissions wait while the
        running requests still hold more (docs/elastic_kv.md)."""
        return self._kv_limit(True, limit_bytes)

    def _kv_limit(self, apply: bool, limit_bytes: int | None) -> dict:
        return _state(self.scheduler.kv_limit(apply, limit_bytes))

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """SGLang's: give back the memory of ``tags`` (``"kv_cache"``,
        ``"weights"``; None: both) until :meth:`resume_memory_occupation`;
        needs ``enable_memory_saver`` and no request running. Returns what is
        released; ValueError says why not (docs/elastic_kv.md)."""
        return _state(self.scheduler.release_memory_occupation(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Take the memory of ``tags`` (None: all) back; outputs are then as before the release."""
        return _state(self.scheduler.resume_memory_occupation(tags))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """SGLang's: read the PEFT adapter at ``lora_path`` (a local folder)
        as ``lora_name``, which requests may name at once. ValueError naming
        the field, nothing changed, for a name in use, ``max_loaded_loras``
        reached, a folder that cannot be read or does not fit
        ``max_lora_rank`` / ``lora_target_modules``, or LoRA not enabled.
        ``pinned`` is accepted and ignored (docs/lora.md)."""
        return _lora_update(self.scheduler.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """SGLang's: new requests can no longer name ``lora_name``; those
        that hold it finish first, then its slot and host copy are freed.
        A later load of the name is a new adapter (none of this one's cached
        KV is served to it)."""
        return _lora_update(self.scheduler.unload_lora_adapter(lora_name))

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        if self.scheduler is None:
            return
        self.scheduler.close()  # its KV event publisher, if any
        if self._grammar_sandbox is not None:
            self._grammar_sandbox.close()
        if self.server_args.tp_size * self.server_args.pp_size > 1:
            self.scheduler.shutdown()
        if self.scheduler.device.type == "cpu":
            from radixserve.model_executor.cpu_malloc import reuse_freed_memory

            reuse_freed_memory(False)
        self.scheduler = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests ------------------------------------------------------------------
    def _inputs(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass input_ids")
            return isinstance(prompt, str), [self.tokenizer.encode(t) for t in texts]
        single = bool(input_ids) and isinstance(input_ids[0], int)
        return single, [list(input_ids)] if single else [list(x) for x in input_ids]

    def _make_reqs(self, ids, params, return_logprob, logprob_start_len, top_logprobs_num, rid,
                   token_ids_logprob=None, lora_path=None) -> list[Req]:
        sp = SamplingParams.from_dict(dict(params or {}))
        sp.verify(self.scheduler.vocab_size)
        spec = grammar_spec(sp)
        if spec is not None:
            check_grammar(*spec)
            self._grammar_sandbox.check(*spec)
        rid = rid or uuid.uuid4().hex
        reqs = []
        for i in range(sp.n):
            req = self.scheduler.new_req(rid if sp.n == 1 else f"{rid}-{i}", ids, sp if sp.n == 1 else _nth_sample(sp, i),
                                         return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
                                         lora_path)
            self.scheduler.validate(req)
            reqs.append(req)
        return reqs

    # -- driving the scheduler ---------------------------------------------------------
    def _run(self, reqs: list[Req]) -> list[dict]:
        start = time.perf_counter()
        for req in reqs:
            self.scheduler.add_request(req)
        bar = tqdm(total=len(reqs), desc="generate", disable=self.server_args.disable_tqdm or len(reqs) < 2)
        pending = {id(r) for r in reqs}
        while pending:
            for req in self._step():
                if req.finished() and id(req) in pending:
                    pending.discard(id(req))
                    bar.update(1)
        bar.close()
        self._drain()
        return [self._output(r, time.perf_counter() - start) for r in reqs]

    def _stream(self, req: Req) -> Iterator[dict]:
        start = time.perf_counter()
        self.scheduler.add_request(req)
        status, text, sent = self._decode_status(req), "", 0
        try:
            while not req.finished():
                if any(r is req for r in self._step()):
                    reason = req.finished_reason.to_json() if req.finished_reason else None
                    text += status.feed(req.output_ids[sent:], reason, req.sampling_params.no_stop_trim)
                    sent = len(req.output_ids)
                    yield self._output(req, time.perf_counter() - start, text)
        finally:
            if not req.finished():  # the consumer stopped early: abort
                self.scheduler.abort_request(req.rid)
            self._drain()

    def _check_resident(self) -> None:
        """Nothing runs while memory is released, and nothing here would resume it: refuse at once."""
        if self.scheduler.held():
            raise RuntimeError(f"memory released ({', '.join(sorted(self.scheduler.offload_tags))}): "
                               "call resume_memory_occupation first")

    def _drain(self) -> None:
        """Run until requests that only wait for their abort to land are gone."""
        while any(r.to_abort for r in self.scheduler.live_reqs()):
            self._step()

    def _step(self) -> list[Req]:
        finished = self.scheduler.step()
        self._heap.busy()
        return finished

    def _decode_status(self, req: Req) -> DecodeStatus:
        sp = req.sampling_params
        tokenizer = self.tokenizer if self.tokenizer is not None else NullTokenizer()
        return DecodeStatus(tokenizer, sp.skip_special_tokens, sp.spaces_between_special_tokens, sp.stop, sp.no_stop_trim, sp.stop_regex)

    def _output(self, req: Req, latency: float, text: str | None = None) -> dict:
        reason = req.finished_reason
        if text is None:  # the whole text at once, trimmed as the detokenizer trims it
            reason_json = reason.to_json() if reason else None
            text = self._decode_status(req).feed(req.output_ids, reason_json, req.sampling_params.no_stop_trim)
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": reason.to_json() if reason else None,
            "e2e_latency": latency,
        }
        if req.return_logprob:
            meta["input_token_logprobs"] = list(req.input_token_logprobs)
            meta["output_token_logprobs"] = list(req.output_token_logprobs)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = list(req.input_top_logprobs)
                meta["output_top_logprobs"] = list(req.output_top_logprobs)
            if req.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = list(req.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = list(req.output_token_ids_logprobs)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def _per_prompt_token_ids(token_ids: list | None, n: int) -> list[list[int] | None]:
    """``token_ids_logprob`` for each of ``n`` prompts: one list for all, or one each."""
    if token_ids is None or not token_ids or not isinstance(token_ids[0], list):
        return [token_ids] * n
    if len(token_ids) != n:
        raise ValueError(f"token_ids_logprob: {len(token_ids)} given for {n} prompts")
    return token_ids


def _state(result: tuple[bool, str, dict]) -> dict:
    """A scheduler control call's figures, or its message as a ValueError."""
    ok, message, state = result
    if not ok:
        raise ValueError(message)
    return state


def _lora_update(result: tuple[bool, str, dict]) -> dict:
    """A load's or unload's answer in SGLang's shape, or its message as a ValueError."""
    ok, message, loaded = result
    if not ok:
        raise ValueError(message)
    return {"success": True, "error_message": "", "loaded_adapters": loaded}


def _nth_sample(sp: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n samples: its own seed (derived from the request's) and n=1."""
    import dataclasses

    seed = None if sp.sampling_seed is None else sp.sampling_seed + i
    return dataclasses.replace(sp, n=1, sampling_seed=seed)
