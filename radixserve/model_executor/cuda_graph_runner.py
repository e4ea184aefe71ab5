"""CUDA graphs for DECODE forwards.

A decode step of a small model, or of any model at a small batch, is bound by
kernel launches: the GPU waits on Python. The runner captures the whole
decode forward (attention metadata included) once per batch size in
``batch_sizes`` and replays it, copying the batch into static input buffers.
A batch is padded up to the next captured size; padding rows point at the
ModelRunner's padding row of ``req_to_token`` (all zeros: the dummy KV slot
0), have length 1 and write their K/V to slot 0, so they cost compute but
touch no request's memory. Batches larger than the largest captured size,
and every EXTEND, run eagerly.

All graphs share one memory pool and are captured largest first, so the pool
is sized by the largest batch. The outputs (logits) of a replay live in that
pool and are valid until the next replay.

Under tensor parallelism the graphs hold the layers' NCCL all-reduces and the
logits' all-gather: every rank captures the same sizes in the same order
(the collectives must match), and a replay on one rank needs the same replay
on all of them.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.model_executor.forward_batch_info import (
    AttentionBackendProtocol,
    ForwardBatch,
    ForwardMode,
    PrefixGroupTable,
)

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)


class ModelRunnerView(Protocol):
    """What the graph runners read of the ModelRunner that builds them, which
    imports them: declared here, so that they need not import it."""

    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    tp_size: int
    padding_req_row: int  # the req_to_token row of padded batches (all dummy slots)
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    attn_backend: AttentionBackendProtocol
    prefix_grouped_decode: bool  # --enable-prefix-grouped-decode
    lora_manager: Any  # lora.manager.LoRAManager with the triton backend, or None


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    return sorted(set(sizes + [max_bs]))


class GraphCapturer:
    """Captures CUDA graphs on one side stream into one memory pool (shared by
    every graph it captures: they must never run concurrently)."""

    def __init__(self, device: torch.device, tp_size: int):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        # Under TP, NCCL's watchdog thread queries the events of the warm-up's
        # collectives while we capture; "thread_local" keeps such calls from
        # other threads from invalidating the capture (older torch builds).
        self.mode = "thread_local" if tp_size > 1 else "global"

    def capture(self, fn, warmups: int = 2):
        """``(graph, what fn returned while captured)``; ``fn`` first runs
        ``warmups`` times outside the capture, where Triton compiles and autotunes."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(warmups):
                fn()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=self.mode):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out


class CudaGraphRunner:
    def __init__(self, model_runner: ModelRunnerView, batch_sizes: list[int]):
        self.runner = model_runner
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        dev, n = model_runner.device, self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.full((n,), model_runner.padding_req_row, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        # Prefix-grouped decode: the table is an input of every graph (a
        # batch without groups fills it empty), where the backend's grouped
        # decode runs in a graph; elsewhere graphs decode ungrouped.
        self.prefix_groups = None
        if model_runner.prefix_grouped_decode and getattr(model_runner.attn_backend, "graphs_prefix_groups", False):
            self.prefix_groups = PrefixGroupTable.static(n, model_runner.padding_req_row, dev)
        # --enable-lora: the segmented LoRA kernels' table is an input of every graph
        self.lora = None if model_runner.lora_manager is None else model_runner.lora_manager.static_table(n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capturer = GraphCapturer(model_runner.device, model_runner.tp_size)
        start = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):
                self._capture(bs)
        if self.lora is not None:
            model_runner.lora_manager.activate(None)
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.batch_sizes, time.perf_counter() - start,
        )

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
            prefix_groups=None if self.prefix_groups is None else self.prefix_groups.rows(bs),
        )

    def _run_once(self, fb: ForwardBatch) -> torch.Tensor:
        self.runner.attn_backend.init_forward_metadata(fb)
        return self.runner.model(fb.input_ids, fb.positions, fb).next_token_logits

    def _capture(self, bs: int) -> None:
        fb = self._static_batch(bs)
        if self.lora is not None:
            self.runner.lora_manager.capture_with(self.lora, bs)
        self.graphs[bs], self.outputs[bs] = self.capturer.capture(lambda: self._run_once(fb))

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """Run the decode ``fb`` through the graph of the smallest captured
        size that holds it. Only device copies: no host sync."""
        bs = fb.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        if self.prefix_groups is not None:
            self.prefix_groups.fill(fb.prefix_groups, bs, padded)
        if self.lora is not None:
            self.lora.fill(None if fb.lora is None else fb.lora.row_slots, padded)
        if padded > bs:
            self.req_pool_indices[bs:padded].fill_(self.runner.padding_req_row)
            self.seq_lens[bs:padded].fill_(1)
            self.out_cache_loc[bs:padded].zero_()
        self.graphs[padded].replay()
        return LogitsProcessorOutput(next_token_logits=self.outputs[padded][:bs])
