"""Input-token (prompt) logprobs of an extend batch: which requests want
them, and turning the logits processor's output into each request's entries."""

from __future__ import annotations

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.managers.schedule_batch import ModelWorkerBatch, Req


def record_input_logprobs(reqs: list[Req], batch: ModelWorkerBatch, out: LogitsProcessorOutput) -> None:
    """Input-token logprobs, in SGLang's convention: one entry per prompt
    position ``q`` from ``logprob_start_len`` on, log P(token_q | tokens < q),
    except that the first entry (position ``logprob_start_len``, 0 or not) is
    None, as SGLang returns it (its frontend's ``select`` averages what
    follows); so is the entry there of the top logprobs and of the
    ``token_ids_logprob`` ones. The last new token of a chunk scores the next
    chunk's first token from its next-token logits."""
    offset = 0
    lens = out.input_logprob_lens or [0] * len(reqs)
    for i, req in enumerate(reqs):
        n = lens[i]
        if not req.wants_input_logprobs():
            offset += n
            continue
        prefix, ext = batch.extend_prefix_lens[i], batch.extend_seq_lens[i]
        s = batch.extend_logprob_start_lens[i]
        if prefix == 0 and req.logprob_start_len == 0:  # no logits score the first prompt token
            _add_entry(req, 0, None, None, None)
        vals = out.input_token_logprobs[offset : offset + n].tolist()
        for j, v in enumerate(vals):
            top = by_ids = None
            if req.top_logprobs_num:
                top = list(zip(out.input_top_logprobs_val[i][j], out.input_top_logprobs_idx[i][j]))
            if req.token_ids_logprob is not None:
                by_ids = list(zip(out.input_token_ids_logprobs_val[i][j], req.token_ids_logprob))
            _add_entry(req, prefix + s + j + 1, v, top, by_ids)
        nxt = prefix + ext
        if nxt < len(req.origin_input_ids) and nxt >= req.logprob_start_len:  # a chunk: score the next one's first token
            lp = torch.log_softmax(out.next_token_logits[i].float(), dim=-1)
            top = by_ids = None
            if req.top_logprobs_num:
                v, ix = lp.topk(req.top_logprobs_num)
                top = list(zip(v.tolist(), ix.tolist()))
            if req.token_ids_logprob is not None:
                by_ids = list(zip(lp[req.token_ids_logprob].tolist(), req.token_ids_logprob))
            _add_entry(req, nxt, float(lp[req.origin_input_ids[nxt]]), top, by_ids)
        offset += n


def _add_entry(req: Req, q: int, value: float | None, top: list | None, by_ids: list | None) -> None:
    """Record prompt position ``q``; the one at ``logprob_start_len`` is None."""
    first = q == req.logprob_start_len
    req.input_token_logprobs.append((None if first else value, req.origin_input_ids[q]))
    if req.top_logprobs_num:
        req.input_top_logprobs.append(None if first else top)
    if req.token_ids_logprob is not None:
        req.input_token_ids_logprobs.append(None if first else by_ids)
