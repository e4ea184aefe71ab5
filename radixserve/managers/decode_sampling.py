"""The running batch's sampling state across decodes.

A decode's ``SamplingBatchInfo`` (penalty counts, output lengths that key
seeded sampling) lives on the device and is carried from one decode to the
next instead of being rebuilt from the host's token lists. ``sync`` lines it
up with the running requests before each decode and returns them in the
state's row order; what it cannot do on the host (the rows of requests whose
token is still being sampled) is left as a pending update, which
``apply_pending`` queues on the forward stream just before the forward.

Requests join the running batch from an extend, whose own info (built for
its requests, then counting the token it samples) becomes their rows:
``absorb`` appends it to the state, and ``replace`` makes a mixed batch's
info (its new requests, then every running request) the state. Only a
request the state knows nothing of (it joined otherwise, e.g. with KV from a
prefill server) makes ``sync`` rebuild everything from the host's tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixserve.managers.schedule_batch import Req
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


class DecodeSamplingState:
    """Owns the decode ``SamplingBatchInfo`` and the requests its rows belong to."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.info: SamplingBatchInfo | None = None
        self.reqs: list[Req] = []  # row i of ``info`` is reqs[i], once the pending updates are applied
        self._pending: list[Callable[[], None]] = []  # device updates, in order, for the next forward

    def invalidate(self) -> None:
        """Forget the state (requests left the batch outside a step's results,
        e.g. aborted or cut by a full pool): the next ``sync`` rebuilds it."""
        self.info, self.reqs, self._pending = None, [], []

    def absorb(self, reqs: list[Req], info: SamplingBatchInfo) -> None:
        """An extend of ``reqs`` was launched with ``info``: its rows follow
        the state's (those of requests that do not join the running batch,
        such as a chunk of a longer prompt, are filtered out by ``sync``)."""
        if self.info is None:
            self.info, self.reqs = info, list(reqs)
            return
        state = self.info
        self._pending.append(lambda: state.merge(info))
        self.reqs = self.reqs + list(reqs)

    def replace(self, reqs: list[Req], info: SamplingBatchInfo) -> list[Callable[[], None]]:
        """A mixed batch of ``reqs`` (its new requests, then every running
        request) was launched with ``info``: that is the state now. Returns the
        updates still pending on the previous state, which the mixed batch
        must apply before it reads the riders' rows."""
        pending, self._pending = self._pending, []
        self.info, self.reqs = info, list(reqs)
        return pending

    def sync(self, running: list[Req], last_token: torch.Tensor) -> list[Req]:
        """The running requests in the order of the state's rows.

        When every running request has a row, the state is filtered to them.
        Otherwise it is rebuilt from the host's tokens, which lack the token
        still being sampled for requests with a forward in flight
        (``kv_inflight``): those go last, and their rows are completed from
        ``last_token`` (indexed by request row) and merged by ``apply_pending``."""
        if self.info is not None and self._filter_to(running):
            return self.reqs
        self._pending = []
        settled = [r for r in running if r.kv_inflight == 0]
        pending = [r for r in running if r.kv_inflight > 0]
        settled_info = self._build(settled)
        pending_info = self._build(pending)
        if pending_info is not None:
            rows = torch.tensor([r.req_pool_idx for r in pending], dtype=torch.int64).to(self.device)

            def complete_pending() -> None:
                pending_info.cumulate_output_tokens(last_token[rows])
                if settled_info is not None:
                    settled_info.merge(pending_info)

            self._pending.append(complete_pending)
        self.info = settled_info or pending_info
        self.reqs = settled + pending
        return self.reqs

    def apply_pending(self) -> None:
        """Queue what ``sync`` and ``absorb`` left for the device (on the current stream)."""
        pending, self._pending = self._pending, []
        for update in pending:
            update()

    def _filter_to(self, running: list[Req]) -> bool:
        """Keep the rows of ``running`` if each has exactly one in the state."""
        alive = {id(r) for r in running}
        keep = [i for i, r in enumerate(self.reqs) if id(r) in alive]
        if len(keep) != len(running) or len({id(self.reqs[i]) for i in keep}) != len(keep):
            return False
        if len(keep) < len(self.reqs):
            info, keep_dev = self.info, torch.tensor(keep, dtype=torch.int64).to(self.device)
            self._pending.append(lambda: info.filter(keep, keep_dev))
        self.reqs = [self.reqs[i] for i in keep]
        return True

    def _build(self, reqs: list[Req]) -> SamplingBatchInfo | None:
        return SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device) if reqs else None
