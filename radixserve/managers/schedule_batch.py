"""Scheduling state: ``Req``, ``ScheduleBatch`` and the ``ModelWorkerBatch``
handed to the model worker (see ARCHITECTURE.md, "Batch data flows one way").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class ModelWorkerBatch:
    """What one forward needs, still on the host. Built by ``ScheduleBatch``;
    turned into a device-side ``ForwardBatch`` by the ModelRunner."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64 (cpu)
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, lengths after this forward
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    seq_lens_cpu: list[int]
    extend_prefix_lens: list[int] | None = None
    extend_seq_lens: list[int] | None = None
    return_logprob: bool = False
    extend_logprob_start_lens: list[int] | None = None
    top_logprobs_nums: list[int] | None = None
    sampling_info: "SamplingBatchInfo | None" = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
