"""What the prefill and decode servers' parts of a Scheduler share
(``disagg_prefill.py``, ``disagg_decode.py``; docs/disaggregation.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from radixserve.disaggregation.base import DisaggregationMode, MetadataBuffers
from radixserve.disaggregation.torch_dist import TorchDistKVManager
from radixserve.disaggregation.utils import AuxRows, advertised_host, pool_kv_args, transfer_config_from_env
from radixserve.managers.io_struct import MAX_TOP_LOGPROBS
from radixserve.managers.schedule_batch import Req


class DisaggregationQueues(ABC):
    """A Scheduler's (``s``) requests in transfer, the rows of their first
    tokens' metadata, and the rank's KV manager (over the scheduler's KV
    pool). Subclasses hold the queues and say which of their requests hold
    KV (``holding``) and which are in any queue (``queued``)."""

    mode: DisaggregationMode

    def __init__(self, scheduler, bootstrap_addr: str | None = None):
        self.s = s = scheduler
        rows = s.req_to_token_pool.size  # every request in transfer also holds a request row
        # the first token's top logprobs: as many as any request may ask (io_struct, a 400 beyond), so none is cut
        self.metadata, self.aux_rows = MetadataBuffers(rows, MAX_TOP_LOGPROBS), AuxRows(rows)
        kv_args = pool_kv_args(s.model_runner.token_to_kv_pool, s.page_size, self.metadata, advertised_host(s.args.host))
        self.kv_manager = TorchDistKVManager(kv_args, self.mode, transfer_config_from_env(), bootstrap_addr=bootstrap_addr)

    @abstractmethod
    def queued(self) -> list[Req]: ...

    @abstractmethod
    def holding(self) -> list[Req]: ...

    def close(self) -> None:
        self.kv_manager.close()
