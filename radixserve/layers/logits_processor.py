"""From the last hidden states to next-token logits and input-token logprobs.

Under tensor parallelism each rank's LM head gives its slice of the
vocabulary; the slices are all-gathered (and the padding dropped) before
anything reads them, so every rank holds the same, full logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.distributed import TPGroup
from radixserve.layers.linear import linear
from radixserve.model_executor.forward_batch_info import ForwardBatch, ragged_arange

LOGPROB_CHUNK_ROWS = 1024  # token rows per LM-head call when computing input logprobs


@dataclass
class LogitsProcessorOutput:
    """What a model's forward returns.

    ``next_token_logits``: ``[bs, vocab]`` float32, the logits after each
    request's last new token (EXTEND: the last token of its extend segment;
    DECODE: its one token). The sampler reads these.

    Input-token logprobs (EXTEND with ``return_logprob`` only, else None).
    Let request ``i`` have ``n_i = extend_seq_lens[i]`` new tokens ``t_0 ..
    t_{n_i-1}`` and ``s_i = extend_logprob_start_lens[i]`` (0 when not given).
    For every new-token index ``j`` with ``s_i <= j < n_i - 1`` the entry is
    ``log P(t_{j+1} | context up to and including t_j)``. The last new token
    has no next input token in this forward and gets no entry (at a chunk
    boundary the scheduler knows the next chunk's first token; the logprob of
    the first generated token is the sampler's business).

    - ``input_token_logprobs``: float32, the entries of all requests
      concatenated in batch order; request ``i`` has
      ``input_logprob_lens[i] = max(0, n_i - 1 - s_i)`` of them.
    - ``input_top_logprobs_val`` / ``_idx``: only when some
      ``top_logprobs_nums[i] > 0``; per request, per entry above, the
      ``top_logprobs_nums[i]`` largest logprobs and their token ids (an empty
      list for requests that asked for none).
    - ``input_token_ids_logprobs_val``: only when some request names
      ``token_ids_logprobs[i]`` (SGLang's ``token_ids_logprob``); per request,
      per entry above, the logprobs of those ids in their order (None for
      requests that named none).
    """

    next_token_logits: torch.Tensor
    input_token_logprobs: torch.Tensor | None = None
    input_logprob_lens: list[int] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    input_token_ids_logprobs_val: list[list[list[float]] | None] | None = None


class LogitsProcessor(nn.Module):
    """Applies the LM head only where logits are needed (see :class:`LogitsProcessorOutput`)."""

    def __init__(self, vocab_size: int, tp_group: TPGroup | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_group = tp_group or TPGroup()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        lm_head: nn.Module,  # a VocabParallelEmbedding / ParallelLMHead
        forward_batch: ForwardBatch,
    ) -> LogitsProcessorOutput:
        if forward_batch.forward_mode.is_extend():
            last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            hidden_last = hidden_states[last]
        else:
            hidden_last = hidden_states
        out = LogitsProcessorOutput(next_token_logits=self._logits(hidden_last, lm_head))
        if forward_batch.return_logprob and forward_batch.forward_mode.is_extend():
            self._add_input_logprobs(out, input_ids, hidden_states, lm_head, forward_batch)
        return out

    def _logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = self.tp_group.all_gather(linear(hidden, lm_head.lm_head_weight()), dim=-1)
        return logits[:, : self.vocab_size].float()

    def _add_input_logprobs(self, out, input_ids, hidden_states, lm_head, fb: ForwardBatch) -> None:
        rows, lens = _input_logprob_rows(fb)
        nums = fb.top_logprobs_nums or [0] * fb.batch_size
        k = max((n for n, length in zip(nums, lens) if length > 0), default=0)
        token_logprobs, top_val, top_idx = [], [], []
        by_ids = _TokenIdsLogprobs(fb.token_ids_logprobs, lens, hidden_states.device)
        # In chunks, so a long prompt never holds [prompt_len, vocab] logits at once.
        for chunk in rows.split(LOGPROB_CHUNK_ROWS):
            logprobs = torch.log_softmax(self._logits(hidden_states[chunk], lm_head), dim=-1)
            token_logprobs.append(logprobs.gather(1, input_ids[chunk + 1].unsqueeze(1)).squeeze(1))
            by_ids.add(logprobs)
            if k > 0:
                val, idx = logprobs.topk(k, dim=-1)
                top_val.append(val)
                top_idx.append(idx)
        out.input_token_logprobs = torch.cat(token_logprobs)
        out.input_token_ids_logprobs_val = by_ids.values()
        out.input_logprob_lens = lens
        if k > 0:
            out.input_top_logprobs_val = _split_top(torch.cat(top_val).tolist(), lens, nums)
            out.input_top_logprobs_idx = _split_top(torch.cat(top_idx).tolist(), lens, nums)


def _input_logprob_rows(fb: ForwardBatch) -> tuple[torch.Tensor, list[int]]:
    """Token rows that get an input logprob, and how many per request."""
    starts = fb.extend_logprob_start_lens_cpu or [0] * fb.batch_size
    lens = [max(0, n - 1 - s) for n, s in zip(fb.extend_seq_lens_cpu, starts)]
    device = fb.input_ids.device
    first = fb.extend_start_loc + torch.tensor(starts, dtype=torch.int64, device=device)
    return ragged_arange(first, torch.tensor(lens, dtype=torch.int64, device=device)), lens


class _TokenIdsLogprobs:
    """Each request's logprobs of its ``token_ids_logprobs`` at its rows,
    gathered chunk by chunk (a request's rows may span chunks)."""

    def __init__(self, token_ids: list[list[int] | None] | None, lens: list[int], device: torch.device):
        self.wanted = [(i, torch.tensor(ids, dtype=torch.int64, device=device))
                       for i, ids in enumerate(token_ids or []) if ids is not None]
        self.bounds = list(itertools.accumulate(lens, initial=0))  # request i's rows: bounds[i] .. bounds[i+1]
        self.vals: list[list | None] = [None if ids is None else [] for ids in token_ids or [None] * len(lens)]
        self.start = 0  # the first row of the next chunk

    def add(self, logprobs: torch.Tensor) -> None:
        end = self.start + logprobs.shape[0]
        for i, ids in self.wanted:
            lo, hi = max(self.bounds[i], self.start), min(self.bounds[i + 1], end)
            if lo < hi:
                self.vals[i] += logprobs[lo - self.start : hi - self.start, ids].tolist()
        self.start = end

    def values(self) -> list[list | None] | None:
        return self.vals if self.wanted else None


def _split_top(rows: list[list], lens: list[int], nums: list[int]) -> list[list[list]]:
    out, offset = [], 0
    for length, k in zip(lens, nums):
        out.append([r[:k] for r in rows[offset : offset + length]] if k > 0 else [])
        offset += length
    return out
