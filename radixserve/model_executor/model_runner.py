"""The ModelRunner: one rank's model, KV memory and attention backend.

Under tensor parallelism (``tp_size > 1``) each rank runs one ModelRunner in
its own process: it joins the TP group, holds its shard of the weights and a
KV pool of only its KV heads, and every forward returns the same, full logits
on every rank (docs/tensor_parallel.md). Under pipeline parallelism
(``pp_size > 1``) it runs one stage: its layers, and a KV pool of only those.

It turns a host-side ``ModelWorkerBatch`` into a device ``ForwardBatch`` and
runs the model on it. Sampling is the Sampler's job, scheduling the
Scheduler's; the runner only owns the memory they share:

- ``req_to_token_pool``: ``max_running_requests + 1`` rows of
  ``max_context_len`` slots. Row 0 is taken at start-up as the padding row
  (all zeros, i.e. the dummy KV slot 0) for padded batches such as CUDA-graph
  decode, so exactly ``max_running_requests`` rows are free for requests.
- ``token_to_kv_pool``: an ``MHATokenToKVPool`` of ``max_total_tokens`` slots
  (plus the dummy page) in ``kv_cache_dtype`` (default the model's dtype),
  of this rank's KV heads.
- ``token_to_kv_pool_allocator``: hands out those slots in pages.
"""

from __future__ import annotations

import gc
import os
import logging
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed import DEFAULT_TIMEOUT_S, PPGroup, TPGroup, check_tp_devices, init_model_parallel
from radixserve.distributed.expert_flags import check_expert_parallel
from radixserve.distributed.expert_parallel import MoEParallel
from radixserve.distributed.pipeline import PPHidden, PPStage
from radixserve.feature_args import ElasticKVConfig
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.linear import prepack_linears_for_cpu, quantize_linears
from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.layers.moe.load_stats import ExpertLoadHistogram
from radixserve.layers.quantization import check_quantization
from radixserve.lora.manager import LoRAManager
from radixserve.lora.options import LoRAOptions
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_floor
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.mem_cache.virtual_memory import available_ram
from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner, default_batch_sizes
from radixserve.model_executor.forward_batch_info import ForwardBatch, ragged_arange
from radixserve.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner, supports_pieces

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)

CPU_MAX_KV_TOKENS = 32768  # default cap of the CPU KV pool
CPU_KV_RAM_FRACTION = 0.25  # share of available RAM the CPU KV pool may take by default


class ModelRunner:
    """Runs forwards of one model over a paged KV pool.

    ``max_total_tokens`` is the KV pool size in tokens. On CUDA the pool is
    sized from the memory free after the weights, keeping
    ``1 - mem_fraction_static`` of the device's memory for activations, and
    ``max_total_tokens`` (if given) caps it. On CPU it is ``max_total_tokens``
    or, by default, ``min(CPU_KV_RAM_FRACTION * available RAM, 32k tokens)``.
    ``max_context_len`` defaults to the model's context length; it is capped
    by the pool size. With ``cuda_graph_max_bs > 0`` on CUDA, decodes of up
    to that many requests replay CUDA graphs (``cuda_graph_runner.py``); with
    ``piecewise_cuda_graph_tokens``, extends of up to the largest of those
    token counts replay graphs of the pieces between attentions
    (``piecewise_cuda_graph_runner.py``); with ``prefix_grouped_decode``
    the decode graphs take a batch's prefix groups as an input where the
    attention backend can (docs/prefix_grouped_decode.md). ``quantization`` ``"fp8"`` quantizes
    the linear layers once loaded (``layers/quantization.py``), before the
    pool is sized, so the memory it frees goes to KV. ``enable_memory_saver``
    moves the weights into a virtual arena whose memory can be released and
    resumed (``weight_arena.py``; on a CPU they are then not prepacked).
    ``lora`` (``--enable-lora``) hooks LoRA adapter slots into the linear
    layers (``lora_manager``, docs/lora.md); under CUDA graphs with the triton
    backend only.
    ``model`` may be passed ready-made (tests); otherwise it is loaded with
    ``radixserve.model_loader.get_model``.

    Tensor parallelism: rank ``tp_rank`` of ``tp_size`` joins the group at
    ``dist_init_method`` (``tcp://HOST:PORT``, the same on every rank; a
    collective or the rendezvous fails after ``dist_timeout_s``), or takes a
    ready ``tp_group``; ``nnodes`` hosts share the ranks equally. Every rank
    is built with the same arguments but its rank and device (a plain
    ``"cuda"`` means device ``tp_rank`` of this host). The pool size
    is agreed (the smallest rank's), so all ranks hold as many KV slots. A
    model that cannot be split, or more CUDA ranks than devices, is a
    ValueError before any rank waits for another. Rank 0 asks
    ``tp_rank_failure`` while it waits for the others (``init_tp_group``'s
    ``rank_failure``). ``shutdown`` leaves the group.

    Pipeline parallelism: stage ``pp_rank`` of ``pp_size`` (``self.pp``, a
    :class:`PPStage`) loads only its layers (``distributed/pipeline.py``);
    its KV pool holds those layers, so it fits more tokens than the whole
    model's. A stage other than the first takes the previous stage's
    ``PPHidden`` as ``forward_batch.pp_hidden``, and one other than the last
    returns its own from :meth:`forward`. Stages run eagerly (no CUDA graphs)
    and without LoRA for now.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        max_total_tokens: int | None = None,
        max_running_requests: int,
        max_context_len: int | None = None,
        attention_backend: str = "torch_native",
        mem_fraction_static: float = 0.8,
        seed: int = 0,
        model: nn.Module | None = None,
        cuda_graph_max_bs: int = 0,
        piecewise_cuda_graph_tokens: list[int] | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        quantization: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: TPGroup | None = None,
        dist_init_method: str | None = None,
        dist_timeout_s: float = DEFAULT_TIMEOUT_S,
        nnodes: int = 1,
        tp_rank_failure: Callable[[], str | None] | None = None,
        elastic_kv: ElasticKVConfig | None = None,
        enable_memory_saver: bool = False,
        ep_size: int = 1,
        moe_a2a_backend: str = "none",
        prefix_grouped_decode: bool = False,
        lora: LoRAOptions | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ):
        if page_size < 1 or max_running_requests < 1:
            raise ValueError(f"page_size and max_running_requests must be >= 1, got {page_size}, {max_running_requests}")
        self.model_config = model_config
        self.device = torch.device(device)
        self.pp = PPStage.of(model_config.num_hidden_layers, pp_rank, pp_size)
        self._check_pipeline(cuda_graph_max_bs, piecewise_cuda_graph_tokens, lora)
        self.owns_tp_group = tp_group is None
        self.ep_size = ep_size
        check_expert_parallel(tp_group.size if tp_group is not None else tp_size, ep_size, moe_a2a_backend)
        self.tp_group, self.pp_group = self._join_tp_group(tp_rank, tp_size, tp_group, dist_init_method,
                                                           dist_timeout_s, nnodes, tp_rank_failure)
        self.moe_parallel = MoEParallel(self.tp_group, ep_size, moe_a2a_backend)  # MoE models' expert split
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.size
        self.head_layout = model_config.head_layout(self.tp_size, self.tp_rank)
        torch.manual_seed(seed)
        self.dtype = model_config.dtype
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.page_size = page_size
        self.elastic_kv = elastic_kv  # None: the KV pool is allocated whole
        self.max_running_requests = max_running_requests
        self._expert_load_histogram = None  # built on the first expert_load_stats of a MoE model
        check_quantization(quantization, self.device)
        self.quantization = quantization
        self.model = (model if model is not None else self._load_model()).eval()
        self.weight_bytes = sum(t.numel() * t.element_size()  # tied weights once: parameters() yields each once
                                for t in (*self.model.parameters(), *self.model.buffers()))
        if getattr(self.model, "pp_stage", self.pp) != self.pp:
            raise ValueError(f"the model given is pipeline stage {self.model.pp_stage}, not {self.pp}")
        if quantization:
            logger.info("%s: %d linear layers quantized", quantization, quantize_linears(self.model))
        if self.device.type == "cpu" and not enable_memory_saver:  # oneDNN's packed weights cannot live in an arena
            packed = prepack_linears_for_cpu(self.model)
            logger.info("CPU: %d weights prepacked for oneDNN GEMMs", packed)
        self.weight_arena = None  # --enable-memory-saver: the weights, releasable (weight_arena.py)
        if enable_memory_saver:
            from radixserve.model_executor.weight_arena import WeightArena

            self.weight_arena = WeightArena(self.model, self.device, self.tp_group.agree_min)
        self.lora_manager = self._lora_manager(lora, cuda_graph_max_bs, piecewise_cuda_graph_tokens)
        self.max_total_tokens = self._kv_pool_tokens(max_total_tokens, mem_fraction_static)
        self.mem_fraction_static = mem_fraction_static
        self.max_context_len = min(max_context_len or model_config.context_len, self.max_total_tokens)
        self._init_memory_pools()
        self.prefix_grouped_decode = prefix_grouped_decode  # decode batches may carry prefix groups
        self.attn_backend = create_attention_backend(attention_backend, self)
        self.cuda_graph_runner = None
        if cuda_graph_max_bs > 0 and self.device.type == "cuda":
            max_bs = min(cuda_graph_max_bs, max_running_requests)
            self.cuda_graph_runner = CudaGraphRunner(self, default_batch_sizes(max_bs))
        self.piecewise_runner = None
        if piecewise_cuda_graph_tokens and self.device.type == "cuda":
            self.piecewise_runner = self._piecewise_runner(piecewise_cuda_graph_tokens)

    # -- set-up ------------------------------------------------------------
    def _join_tp_group(self, tp_rank, tp_size, tp_group, init_method, timeout_s, nnodes,
                       rank_failure) -> tuple[TPGroup, PPGroup]:
        """Check that the model splits over the ranks first, so a bad
        configuration fails at once on every rank; then join the groups:
        this stage's TP group and the pipeline (the trivial pipeline with a
        ``tp_group`` passed in: a stage run alone, by tests)."""
        if tp_group is not None:
            if (tp_rank, tp_size) not in ((0, 1), (tp_group.rank, tp_group.size)):
                raise ValueError(f"tp_rank {tp_rank} / tp_size {tp_size} contradict the given group's "
                                 f"{tp_group.rank} / {tp_group.size}")
            tp_rank, tp_size = tp_group.rank, tp_group.size
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.model_config.check_tensor_parallel(tp_size, self.ep_size)
        world, rank = tp_size * self.pp.size, self.pp.rank * tp_size + tp_rank
        check_tp_devices(world, self.device, nnodes)
        if self.device.type == "cuda" and self.device.index is None and world > 1:
            self.device = torch.device("cuda", rank % (world // nnodes))  # one device per rank of this host
        if tp_group is not None:
            return tp_group, PPGroup()
        return init_model_parallel(tp_rank, tp_size, self.device, init_method, timeout_s, nnodes, rank_failure,
                                   self.pp.rank, self.pp.size)

    def _check_pipeline(self, cuda_graph_max_bs: int, piecewise_tokens, lora: LoRAOptions | None) -> None:
        """Refuse what a pipeline stage cannot run yet (graphs are built on CUDA only)."""
        if self.pp.size == 1:
            return
        if self.device.type == "cuda" and (cuda_graph_max_bs > 0 or piecewise_tokens):
            raise ValueError("pipeline parallelism runs eagerly for now: turn CUDA graphs off "
                             "(cuda_graph_max_bs 0, no piecewise CUDA graph tokens)")
        if lora is not None:
            raise ValueError("pipeline parallelism does not support LoRA yet")

    def _lora_manager(self, options: LoRAOptions | None, cuda_graph_max_bs: int, piecewise_tokens) -> LoRAManager | None:
        """The adapters and their device slots (``lora/manager.py``), before the
        KV pool is sized so that the slots' memory is counted."""
        if options is None:
            return None
        if options.backend == "triton" and self.device.type != "cuda":
            raise ValueError(f"lora_backend: triton runs on CUDA only; this runner's device is {self.device}")
        if options.backend != "triton" and self.device.type == "cuda" and (cuda_graph_max_bs > 0 or piecewise_tokens):
            raise ValueError(f"lora_backend: {options.backend} runs eagerly; turn CUDA graphs off or use triton")
        # the slots' A go under the base weights (LoRALayer.stack), except those of the memory saver's arena
        return LoRAManager(self.model, self.model_config.num_hidden_layers, options, self.tp_rank, self.dtype,
                           self.device, stack=self.weight_arena is None)

    def _piecewise_runner(self, token_sizes: list[int]) -> PiecewiseCudaGraphRunner | None:
        if not supports_pieces(self.model):
            logger.warning("%s cannot be cut into pieces: extends run eagerly", type(self.model).__name__)
            return None
        return PiecewiseCudaGraphRunner(self, token_sizes)

    def _load_model(self) -> nn.Module:
        from radixserve.model_loader import get_model  # the loader imports the model registry

        return get_model(self.model_config, self.device, self.tp_group, self.moe_parallel, self.pp)

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on this rank (its KV heads and pipeline stage's layers only)."""
        c = self.model_config
        return self.pp.num_layers * self.head_layout.num_kv_heads * c.head_dim * 2 * self.kv_cache_dtype.itemsize

    def _kv_pool_tokens(self, max_total_tokens: int | None, mem_fraction_static: float) -> int:
        if self.device.type == "cuda":
            tokens = self._cuda_kv_budget(mem_fraction_static) // self.kv_bytes_per_token()
            tokens = min(tokens, max_total_tokens) if max_total_tokens else tokens
        elif max_total_tokens:
            tokens = max_total_tokens
        else:
            tokens = min(int(available_ram() * CPU_KV_RAM_FRACTION) // self.kv_bytes_per_token(), CPU_MAX_KV_TOKENS)
        if self.elastic_kv is not None and self.elastic_kv.max_gb is not None:  # only address space until used
            tokens = int(self.elastic_kv.max_gb * 2**30) // self.kv_bytes_per_token()
        tokens = page_floor(self._agree_min(tokens), self.page_size)
        if tokens < self.page_size:
            raise ValueError(f"no room for a KV cache: {tokens} tokens fit (page_size {self.page_size})")
        return tokens

    def _cuda_kv_budget(self, mem_fraction_static: float) -> int:
        """Bytes for the KV pool: what the device has free, plus what torch's
        allocator holds cached but unused (a previous engine's pools in this
        process), less the share kept back."""
        gc.collect()  # a previous engine's pools that only reference cycles still hold
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(free + cached - total * (1 - mem_fraction_static))

    def _elastic_keep_free(self) -> int:
        """Device memory an elastic pool never maps: the ``1 - mem_fraction_static``
        share a static pool leaves for activations, so that neither this
        server's activations nor another process's on the device find it taken."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.mem_get_info(self.device)[1] * (1 - self.mem_fraction_static))

    def _init_memory_pools(self) -> None:
        c = self.model_config
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.max_context_len, self.device)
        self.padding_req_row = self.req_to_token_pool.alloc(1)[0]
        shape = (self.max_total_tokens, self.page_size, self.kv_cache_dtype, self.head_layout.num_kv_heads, c.head_dim,
                 self.pp.num_layers, self.device)
        if self.elastic_kv is not None:
            from radixserve.mem_cache.elastic_allocator import build_elastic_pool

            self.token_to_kv_pool, self.token_to_kv_pool_allocator = build_elastic_pool(
                *shape, config=self.elastic_kv, agree_min=self.tp_group.agree_min, keep_free=self._elastic_keep_free(),
                tenant=self.tp_group.agree_min(os.getpid() if self.tp_rank == 0 else 2**62))  # the server: rank 0's pid
        else:
            self.token_to_kv_pool = MHATokenToKVPool(*shape)
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
                size=self.max_total_tokens, page_size=self.page_size, device=self.device
            )
        logger.info(
            "KV pool: %d tokens (%.2f GiB, %s, %d KV heads on TP rank %d of %d, layers %d..%d), "
            "%d request rows of %d tokens",
            self.max_total_tokens, self.token_to_kv_pool.mem_bytes() / 2**30, self.kv_cache_dtype,
            self.head_layout.num_kv_heads, self.tp_rank, self.tp_size, self.pp.start, self.pp.end - 1,
            self.max_running_requests, self.max_context_len,
        )

    # -- forward -----------------------------------------------------------
    def forward_batch_from(self, batch: "ModelWorkerBatch") -> ForwardBatch:
        """Move ``batch`` to the device and derive positions and extend offsets."""
        dev = self.device
        extend = self._extend_fields(batch) if batch.forward_mode.is_extend() else {}
        positions = extend.pop("positions") if extend else batch.seq_lens - 1
        return ForwardBatch(
            forward_mode=batch.forward_mode,
            batch_size=batch.batch_size,
            input_ids=None if batch.input_ids is None else batch.input_ids.to(dev, torch.int64, non_blocking=True),
            positions=positions.to(dev, torch.int64, non_blocking=True),
            req_pool_indices=batch.req_pool_indices.to(dev, torch.int64, non_blocking=True),
            seq_lens=batch.seq_lens.to(dev, torch.int64, non_blocking=True),
            out_cache_loc=batch.out_cache_loc.to(dev, torch.int64, non_blocking=True),
            seq_lens_cpu=list(batch.seq_lens_cpu),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            return_logprob=batch.return_logprob,
            extend_logprob_start_lens_cpu=batch.extend_logprob_start_lens,
            top_logprobs_nums=batch.top_logprobs_nums,
            token_ids_logprobs=batch.token_ids_logprobs,
            num_decoding=batch.num_decoding,
            prefix_groups=None if batch.prefix_groups is None else batch.prefix_groups.to(dev),
            lora=None if self.lora_manager is None else self.lora_manager.prepare(
                batch.lora_ids, batch.lora_slots, batch.extend_seq_lens or [1] * batch.batch_size),
            **extend,
        )

    def _extend_fields(self, batch: "ModelWorkerBatch") -> dict:
        """Positions ``prefix_len .. seq_len-1`` of each request, concatenated,
        and the EXTEND-only fields of :class:`ForwardBatch`."""
        prefix, extend = list(batch.extend_prefix_lens), list(batch.extend_seq_lens)
        if sum(extend) != len(batch.input_ids) or any(p + n != s for p, n, s in zip(prefix, extend, batch.seq_lens_cpu)):
            raise ValueError(
                f"inconsistent EXTEND batch: {len(batch.input_ids)} input ids, prefix lens {prefix}, "
                f"extend lens {extend}, seq lens {batch.seq_lens_cpu}"
            )
        prefix_t, extend_t = torch.tensor(prefix, dtype=torch.int64), torch.tensor(extend, dtype=torch.int64)
        to_dev = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return dict(
            positions=ragged_arange(prefix_t, extend_t),
            extend_prefix_lens=to_dev(prefix_t),
            extend_seq_lens=to_dev(extend_t),
            extend_start_loc=to_dev(torch.cumsum(extend_t, 0) - extend_t),
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=extend,
        )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput | PPHidden:
        """Run the model (a pipeline stage other than the last returns its
        :class:`PPHidden`). Outputs are inference-mode tensors: modify them in
        place only inside ``torch.inference_mode()`` (or copy them)."""
        if self.lora_manager is not None:  # fills the slots it needs, here on the forward's stream
            self.lora_manager.activate(forward_batch.lora)
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        if self.piecewise_runner is not None and self.piecewise_runner.can_run(forward_batch):
            return self.piecewise_runner.forward(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def expert_load_stats(self) -> dict[str, float]:
        """A MoE model's tokens per expert per step since start, as histogram
        figures (``layers/moe/load_stats.py``); {} for a dense model. Reads
        the device's counts once: call it when stats are reported, not per step."""
        load = getattr(self.model, "expert_load", None)
        if load is None:
            return {}
        if self._expert_load_histogram is None:
            self._expert_load_histogram = ExpertLoadHistogram()
        return self._expert_load_histogram.update(*load.read())

    def _agree_min(self, value: int) -> int:
        """The smallest ``value`` over every rank: the TP group's, and every
        pipeline stage's (whose schedulers hand out the same KV slots)."""
        return self.pp_group.agree_min(value) if self.pp_group.size > 1 else self.tp_group.agree_min(value)

    def stage_info(self) -> dict:
        """This pipeline stage's layers and KV pool (``/get_server_info``'s ``pp_stages``)."""
        return {"pp_rank": self.pp.rank, "layers": [self.pp.start, self.pp.end], "max_total_tokens": self.max_total_tokens,
                "kv_pool_bytes": self.token_to_kv_pool.mem_bytes(), "kv_bytes_per_token": self.kv_bytes_per_token()}

    def shutdown(self) -> None:
        """Leave the groups this runner joined (a no-op with one rank or for a group passed in)."""
        if self.owns_tp_group:
            self.tp_group.destroy()
            self.pp_group.destroy()
