"""The Scheduler under pipeline parallelism (``--pp-size``): micro-batches in
flight, and the sampled tokens that come back from the last stage.

Every stage runs the same Scheduler over the same requests, as TP ranks do,
and takes the same decisions: the first stage relays what it received, and
any decision that depends on its own timing, to the stages after it
(``PPGroup.relay``). The running requests are split into
``--pp-micro-batches`` micro-batches, each with its own running batch,
decode sampling state and chunked prompt; the waiting queue, the radix cache
and the KV pool are shared. Each loop turn serves the next micro-batch
(round robin): it applies the results of that micro-batch's previous batch,
then schedules and launches its next one. So the first stage launches
micro-batch k+1 while later stages work on k, and waits only when it comes
back to a micro-batch whose tokens the last stage has not sent yet.

The last stage samples; right after, it sends each micro-batch's tokens
(with the logprobs asked for) to every other stage, whose turn on that
micro-batch applies them exactly as the last stage applies its own
(:class:`PipelineResult`). docs/pipeline_parallel.md has the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from radixserve.distributed import PPGroup
from radixserve.layers.sampler import SampleOutput
from radixserve.managers.decode_sampling import DecodeSamplingState
from radixserve.managers.profiler import phase
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.model_executor.forward_batch_info import ForwardMode


@dataclass
class MicroBatch:
    """One micro-batch's own state, while another micro-batch's is the Scheduler's."""

    running_batch: ScheduleBatch
    decode_sampling: DecodeSamplingState
    chunked_req: Req | None = None
    launched: object | None = None  # its batch in the pipeline (a ``Launched``), whose results its next turn applies


class PipelineResult:
    """A micro-batch's sampled tokens as every stage applies them: on the
    last stage, what it sampled (sent on at once); elsewhere, what the last
    stage sends, received when the micro-batch's next turn asks for it.
    Stands where a ``QueuedSample`` stands."""

    def __init__(self, pp: PPGroup, rows: torch.Tensor, last_token: torch.Tensor, payload: dict | None = None):
        self.pp = pp
        self.rows = rows  # the batch's request rows, on the device
        self.last_token = last_token  # the worker's: the next decode reads its input ids there
        self.payload = payload
        self.local = payload is not None  # sampled here, input logprobs recorded already

    @classmethod
    def sampled_here(cls, pp: PPGroup, queued, reqs: list[Req], last_token: torch.Tensor) -> "PipelineResult":
        """The last stage: wait for ``queued`` (a ``QueuedSample``), record
        the batch's input logprobs, and send both to every other stage."""
        ids = queued.wait()
        sample, batch = queued.sample, queued.forward.batch
        payload = {"ids": ids}
        if sample.next_token_logprobs is not None:
            payload.update(lp=sample.next_token_logprobs.tolist(), top_val=sample.top_logprobs_val,
                           top_idx=sample.top_logprobs_idx, ids_val=sample.token_ids_logprobs_val)
        if batch.forward_mode == ForwardMode.EXTEND and batch.return_logprob:
            payload["input"] = _recorded(reqs, lambda: queued.record_input_logprobs(reqs))
        data = msgpack.packb(payload)
        for stage in range(pp.size - 1):
            pp.send_bytes(data, stage)
        return cls(pp, queued.forward.forward_batch.req_pool_indices, last_token, payload)

    @phase("pp.wait_tokens")
    def wait(self) -> list[int]:
        """The next token ids; the first time on a stage other than the last,
        received from it (and stored where the next decode reads them)."""
        if self.payload is None:
            self.payload = msgpack.unpackb(self.pp.recv_bytes(self.pp.size - 1))
            self.last_token[self.rows] = torch.tensor(self.payload["ids"], dtype=torch.int64).to(self.rows.device)
        return self.payload["ids"]

    @property
    def sample(self) -> SampleOutput:
        self.wait()
        p = self.payload
        return SampleOutput(torch.tensor(p["ids"]), p.get("lp"), p.get("top_val"), p.get("top_idx"), p.get("ids_val"))

    def record_input_logprobs(self, reqs: list[Req]) -> None:
        """Append the entries the last stage recorded (there: nothing left to do)."""
        if self.local or "input" not in self.payload:
            return
        for req, (values, tops, by_ids) in zip(reqs, self.payload["input"]):
            req.input_token_logprobs += [tuple(v) for v in values]
            req.input_top_logprobs += [None if t is None else [tuple(x) for x in t] for t in tops]
            req.input_token_ids_logprobs += [None if b is None else [tuple(x) for x in b] for b in by_ids]


def _recorded(reqs: list[Req], record) -> list[list]:
    """The input-logprob entries that ``record()`` appends to each of ``reqs``."""
    fields = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
    before = [[len(getattr(r, f)) for f in fields] for r in reqs]
    record()
    return [[getattr(r, f)[n:] for f, n in zip(fields, lens)] for r, lens in zip(reqs, before)]


class SchedulerPipelineMixin:
    """Micro-batches of :class:`Scheduler` (whose state it uses); see the module docstring."""

    def _init_pipeline(self, pp: PPGroup, micro_batches: int) -> None:
        self.pp = pp
        self.micro_batches: list[MicroBatch] = []  # none: no pipeline, ``step`` as usual
        self._slot = 0  # the micro-batch whose state is the Scheduler's (running_batch, ...)
        self._pp_launched = None  # its batch in the pipeline
        if pp.size == 1:
            return
        self.micro_batches.append(MicroBatch(self.running_batch, self.decode_sampling))  # the Scheduler's own
        for _ in range(micro_batches - 1):
            running = ScheduleBatch([], ForwardMode.DECODE, self.pools, self.vocab_size)
            self.micro_batches.append(MicroBatch(running, DecodeSamplingState(self.vocab_size, self.device)))

    def _load(self, slot: int) -> None:
        """Make micro-batch ``slot``'s state the Scheduler's, parking the current one's."""
        if slot == self._slot:
            return
        cur = self.micro_batches[self._slot]
        cur.running_batch, cur.decode_sampling = self.running_batch, self.decode_sampling
        cur.chunked_req, cur.launched = self.chunked_req, self._pp_launched
        mb = self.micro_batches[slot]
        self.running_batch, self.decode_sampling = mb.running_batch, mb.decode_sampling
        self.chunked_req, self._pp_launched = mb.chunked_req, mb.launched
        self._slot = slot

    def barrier_all_ranks(self) -> None:
        """Wait for every rank of every stage (the TP group's, without stages)."""
        (self.pp if self.pp.size > 1 else self.tp_group).barrier()

    def parked(self) -> list[MicroBatch]:
        """The micro-batches whose state is not the Scheduler's now."""
        return [mb for i, mb in enumerate(self.micro_batches) if i != self._slot]

    def parked_reqs(self) -> list[Req]:
        """The running and chunked requests of the parked micro-batches."""
        return [r for mb in self.parked() for r in mb.running_batch.reqs + ([mb.chunked_req] if mb.chunked_req else [])]

    def micro_batch_share(self) -> int:
        """How many requests this micro-batch may run: an even share of the
        running and waiting requests, at most ``--pp-max-micro-batch-size``."""
        demand = len(self.running_batch) + len(self.parked_reqs()) + len(self.waiting)
        return min(self.micro_batch_cap, max(1, -(-demand // len(self.micro_batches))))

    def pipeline_busy(self) -> bool:
        """A batch of any micro-batch is in the pipeline, or a parked one has requests."""
        return self._pp_launched is not None or any(mb.launched is not None for mb in self.parked()) or bool(
            self.parked_reqs())

    def pp_step(self) -> list[Req]:
        """The next micro-batch's turn: apply its last batch's results, then
        schedule and launch its next batch (its results wait for its next turn)."""
        self._load((self._slot + 1) % len(self.micro_batches))
        launched, self._pp_launched = self._pp_launched, None
        out = self._process(launched) if launched is not None else []
        out += self._process_aborts()
        if self.grammar_queue:
            ready, failed = self.grammar_queue.pop_compiled(self._agree_on_rids)
            self.waiting += ready
            out += failed
        batch = self.get_next_batch_to_run()
        if batch is None and self.grammar_queue and not self.pipeline_busy():
            self.grammar_queue.wait()  # only compilations to wait for
        out += self._finished_outside_batch
        self._finished_outside_batch = []
        if batch is not None:
            self._pp_launched = self.launch_batch(batch)
            self._launch_sample(self._pp_launched)
        if self.args.check_invariants or self.is_idle():
            self.check_memory()
        return out

    def pp_sample(self, launched) -> None:
        """The end of ``_launch_sample`` on a pipeline stage: the last stage
        has queued the sampling and sends the tokens on; the others wait for
        them in the micro-batch's next turn."""
        rows, last_token = launched.forward.forward_batch.req_pool_indices, self.worker.last_token
        if self.pp.is_last:
            launched.sampled = PipelineResult.sampled_here(self.pp, launched.sampled, launched.reqs, last_token)
        else:
            launched.sampled = PipelineResult(self.pp, rows, last_token)
