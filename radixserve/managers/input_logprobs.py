"""Input-token (prompt) logprobs of an extend batch: which requests want
them, and turning the logits processor's output into each request's entries."""

from __future__ import annotations

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.managers.schedule_batch import ModelWorkerBatch, Req


def wants_input_logprobs(req: Req) -> bool:
    """Whether this extend of ``req`` scores its prompt tokens: asked for, and
    its first prefill (a retracted request's prompt was scored already)."""
    return (
        req.return_logprob
        and 0 <= req.logprob_start_len < len(req.origin_input_ids)
        and not req.output_ids
        and req.retractions == 0
    )


def record_input_logprobs(reqs: list[Req], batch: ModelWorkerBatch, out: LogitsProcessorOutput) -> None:
    """Input-token logprobs: position ``q`` gets log P(token_q | tokens < q);
    position 0 gets None. The last new token of a chunk scores the next
    chunk's first token from its next-token logits."""
    offset = 0
    lens = out.input_logprob_lens or [0] * len(reqs)
    for i, req in enumerate(reqs):
        n = lens[i]
        if not wants_input_logprobs(req):
            offset += n
            continue
        prefix, ext = batch.extend_prefix_lens[i], batch.extend_seq_lens[i]
        s = batch.extend_logprob_start_lens[i]
        if prefix == 0 and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            req.input_top_logprobs.append(None)
        vals = out.input_token_logprobs[offset : offset + n].tolist()
        for j, v in enumerate(vals):
            req.input_token_logprobs.append((v, req.origin_input_ids[prefix + s + j + 1]))
            if req.top_logprobs_num:
                tv, ti = out.input_top_logprobs_val[i][j], out.input_top_logprobs_idx[i][j]
                req.input_top_logprobs.append(list(zip(tv, ti)))
        nxt = prefix + ext
        if nxt < len(req.origin_input_ids) and nxt >= req.logprob_start_len:  # a chunk: score the next one's first token
            lp = torch.log_softmax(out.next_token_logits[i].float(), dim=-1)
            req.input_token_logprobs.append((float(lp[req.origin_input_ids[nxt]]), req.origin_input_ids[nxt]))
            if req.top_logprobs_num:
                v, ix = lp.topk(req.top_logprobs_num)
                req.input_top_logprobs.append(list(zip(v.tolist(), ix.tolist())))
        offset += n
