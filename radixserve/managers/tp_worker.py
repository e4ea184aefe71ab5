"""The TpModelWorker: queues one batch's forward and sampling on the device.

The Scheduler decides what runs; the worker runs it, on a stream of its own
(``forward_stream``, CUDA only) so that the host can prepare the next batch
while the device computes. Sampled ids stay on the device in ``last_token``
(indexed by request row): a decode, and a request decoding inside an extend
(a mixed batch), read their input ids from it, so the host need not know the
previous token before queueing the next forward.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from radixserve.distributed.pipeline import PPHidden
from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.layers.sampler import SampleOutput, Sampler
from radixserve.managers.input_logprobs import record_input_logprobs
from radixserve.managers.profiler import phase
from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass
class QueuedForward:
    """A batch whose forward is queued on the device, its sampling not yet."""

    batch: ModelWorkerBatch
    forward_batch: ForwardBatch  # holds the device inputs until the forward is done
    logits: LogitsProcessorOutput | None  # read back only for extends (a graph replay reuses a decode's buffer);
    # None on a pipeline stage but the last


@dataclass
class QueuedSample:
    """A batch whose forward and sampling are queued on the device."""

    forward: QueuedForward
    sample: SampleOutput
    next_ids: torch.Tensor  # [bs] on the host (pinned on CUDA), valid once ``done`` is reached
    done: Any  # torch.cuda.Event, or None off CUDA

    def wait(self) -> list[int]:
        """Block until the batch is sampled; its next token ids."""
        if self.done is not None:
            self.done.synchronize()
        return self.next_ids.tolist()

    def record_input_logprobs(self, reqs: list) -> None:
        """Append the prompt logprobs of an extend's ``reqs`` (``input_logprobs.py``)."""
        record_input_logprobs(reqs, self.forward.batch, self.forward.logits)


class TpModelWorker:
    """One rank's ModelRunner and Sampler, and the device state between batches."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.pp = model_runner.pp_group  # a pipeline stage takes hidden states from the one before, if any
        self.device = model_runner.device
        self.sampler = Sampler()
        self.forward_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.last_token = torch.zeros(model_runner.req_to_token_pool.size, dtype=torch.int64, device=self.device)

    def launch_forward(self, batch: ModelWorkerBatch, before_forward: Callable[[], None] | None = None) -> QueuedForward:
        """Queue the forward of ``batch``. Host-to-device copies are issued
        on the current stream; the device work runs on ``forward_stream``
        after them, starting with ``before_forward`` (device-side updates of
        the sampling state), and nothing waits for it."""
        fb = self.model_runner.forward_batch_from(batch)
        with self._on_forward_stream():
            if batch.forward_mode == ForwardMode.DECODE:
                fb.input_ids = self.last_token[fb.req_pool_indices]
            elif batch.num_decoding:  # the batch's last requests decode one token each (a mixed batch)
                n = batch.num_decoding
                fb.input_ids[-n:] = self.last_token[fb.req_pool_indices[-n:]]
            if before_forward is not None:
                before_forward()
            if not self.pp.is_first:
                fb.pp_hidden = self._recv_hidden(len(fb.positions))
            logits = self._forward(fb)
            if not self.pp.is_last:  # the next stage's input; no logits here
                self._send_hidden(logits)
                logits = None
        return QueuedForward(batch, fb, logits)

    @phase("worker.forward")
    def _forward(self, fb: ForwardBatch):
        return self.model_runner.forward(fb)

    @phase("pp.wait_hidden")
    def _recv_hidden(self, tokens: int) -> PPHidden:
        """The previous stage's hidden states and residual for ``tokens`` tokens."""
        shape = (tokens, self.model_runner.model_config.hidden_size)
        dtype, stage = self.model_runner.dtype, self.pp.rank - 1
        return PPHidden(*(self.pp.recv_tensor(shape, dtype, self.device, stage) for _ in range(2)))

    def _send_hidden(self, hidden: PPHidden) -> None:
        for t in (hidden.hidden_states, hidden.residual):
            self.pp.send_tensor(t, self.pp.rank + 1)

    def launch_sample(self, fwd: QueuedForward, return_logprob: bool, top_logprobs_nums: list[int],
                      apply_mask: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                      token_ids_logprobs: list[list[int] | None] | None = None) -> QueuedSample:
        """Queue the sampling of a queued forward, behind it on the same
        stream; ``apply_mask(logits, mask)`` applies ``batch.vocab_mask`` if
        set (structured output). The logprob arguments are the Sampler's."""
        batch, fb = fwd.batch, fwd.forward_batch
        want_lp, tops = return_logprob, top_logprobs_nums
        with self._on_forward_stream(), torch.inference_mode():
            logits = fwd.logits.next_token_logits
            if want_lp and batch.forward_mode == ForwardMode.EXTEND:  # read again for chunked prompts' input logprobs
                logits = logits.clone()
            if batch.vocab_mask is not None:
                apply_mask(logits, batch.vocab_mask)
            # The sampler penalizes and scales ``logits`` in place.
            sample = self.sampler(logits, batch.sampling_info, return_logprob=want_lp, top_logprobs_nums=tops,
                                  token_ids_logprobs=token_ids_logprobs)
            self.last_token[fb.req_pool_indices] = sample.next_token_ids
            batch.sampling_info.cumulate_output_tokens(sample.next_token_ids)
            next_ids = sample.next_token_ids.to("cpu", non_blocking=True)
            done = None
            if self.forward_stream is not None:
                done = torch.cuda.Event()
                done.record()
        return QueuedSample(fwd, sample, next_ids, done)

    def _on_forward_stream(self):
        if self.forward_stream is None:
            return nullcontext()
        self.forward_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.forward_stream)
