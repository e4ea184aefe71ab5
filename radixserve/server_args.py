"""All start-up options of the engine and the server, validated once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields

from radixserve.disaggregation import check_transfer_backend
from radixserve.distributed.expert_flags import MOE_A2A_BACKENDS, check_expert_parallel
# The flags' choices are the parsers' registries (SGLang's names), which import nothing of the engine.
from radixserve.entrypoints.openai.reasoning_parser import REASONING_FORMATS
from radixserve.entrypoints.openai.tool_parser import TOOL_CALL_PARSERS
from radixserve.feature_args import (HICACHE_STORAGE_BACKENDS, HICACHE_WRITE_POLICIES, CompileLimits,
                                     ElasticKVConfig, FeatureArgs, one_of)

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
EVICTION_POLICIES = ("lru", "lfu")
CHARS_PER_TOKEN_LIMIT = 32  # default --max-prompt-chars per token of context
TOOL_CALL_PARSER_NAMES = tuple(sorted(TOOL_CALL_PARSERS))
REASONING_PARSER_NAMES = tuple(sorted(REASONING_FORMATS))
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
# SGLang's names; auto is the model's dtype. fp8 values are stored unscaled (scale 1.0).
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("fp8",)  # online methods of layers/quantization.py
# the largest extend captured in pieces by default: past it, an 8B extend keeps the GPU
# busier than its launches keep the host
PIECEWISE_MAX_TOKENS = 4096
GRAMMAR_CACHE_MB = 256  # default --grammar-cache-max-mb



@dataclass
class ServerArgs(FeatureArgs):
    """Options shared by ``Engine``, the CLI and (later) the HTTP server.
    Names follow SGLang's command-line flags (``--max-running-requests`` ...)."""

    model_path: str | None = field(default=None, metadata={"help": "HF folder, .gguf file or dummy name (default SmolLM2)"})
    tokenizer_path: str | None = field(default=None, metadata={
        "help": "a folder with the tokenizer to use instead of the model's (a dummy model has none)"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name in the OpenAI API"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP server address"})
    port: int = field(default=30000, metadata={"help": "HTTP server port"})
    api_key: str | None = field(default=None, metadata={"help": "require this key (Authorization: Bearer ...)"})
    log_level: str = field(default="info", metadata={"help": "logging level of the server"})
    load_format: str = field(default="auto", metadata={"help": "auto, safetensors, gguf or dummy"})
    json_model_override_args: str = field(default="{}", metadata={
        "help": "a JSON object of model config fields to override, e.g. '{\"vocab_size\": 49152}'"})
    dtype: str = field(default="auto", metadata={"help": "auto, float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu or cuda"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "the KV cache's dtype: auto (the model's), bf16, or fp8_e4m3 / fp8_e5m2 (half the bytes of "
                "bf16: twice the tokens in the pool, half the KV read per decode step)", "choices": KV_CACHE_DTYPES})
    quantization: str | None = field(default=None, metadata={
        "help": "fp8: quantize the linear layers' weights per channel to fp8 e4m3 once loaded, and their inputs "
                "per token (W8A8, a GPU of compute capability 8.9+; half the weight bytes)",
        "choices": QUANTIZATIONS})
    context_length: int | None = field(default=None, metadata={"help": "max tokens per request (prompt + output)"})
    page_size: int = field(default=1, metadata={"help": "KV pool page size in tokens"})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens"})
    max_running_requests: int = field(default=256, metadata={"help": "max requests in the running batch"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "max new tokens in one prefill batch"})
    chunked_prefill_size: int | None = field(default=None, metadata={
        "help": "max prompt tokens per prefill step; -1 disables; default 8192 on GPU, 2048 on CPU"})
    schedule_policy: str = field(default="fcfs", metadata={"help": "fcfs, lpm or dfs-weight"})
    schedule_conservativeness: float = field(default=1.0, metadata={"help": "scales the output-length estimate"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "no prefix reuse (ablation)"})
    eviction_policy: str = field(default="lru", metadata={"help": "lru or lfu"})
    # The hierarchical cache (docs/hicache.md): host memory, then files, under the device's radix tree.
    enable_hierarchical_cache: bool = field(default=False, metadata={
        "help": "keep KV evicted from the device in a host-memory pool and load it back on a prefix match"})
    hicache_ratio: float = field(default=2.0, metadata={"help": "host pool tokens per device pool token"})
    hicache_size: float = field(default=0, metadata={"help": "host pool size in GB (overrides --hicache-ratio)"})
    hicache_write_policy: str = field(default="write_through", metadata={
        "help": "when KV is copied to the host", "choices": HICACHE_WRITE_POLICIES})
    hicache_storage_backend: str | None = field(default=None, metadata={
        "help": "a tier below host memory that survives restarts", "choices": HICACHE_STORAGE_BACKENDS})
    hicache_storage_backend_extra_config: str | None = field(default=None, metadata={
        "help": "the storage backend's options, a JSON object; the file tier takes max_gb, the most its files "
                "may hold (least recently used ones go first; default: no limit)"})
    hicache_storage_dir: str | None = field(default=None, metadata={
        "help": "the file tier's directory (default $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
                "else hicache/ in radixserve's cache directory)"})
    attention_backend: str = field(default="auto", metadata={
        "help": "attention kernels: triton (GPU), torch_native (CPU and GPU) or auto (triton on CUDA)"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run decodes eagerly (no CUDA graphs)"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={
        "help": "largest decode batch replayed from a CUDA graph (default min(256, max-running-requests))"})
    enable_piecewise_cuda_graph: bool = field(default=False, metadata={
        "help": "accepted for SGLang command lines: on CUDA, extends (prefills and mixed steps) up to "
                "--piecewise-cuda-graph-max-tokens run through CUDA graphs of the pieces between attentions "
                "by default"})
    disable_piecewise_cuda_graph: bool = field(default=False, metadata={
        "help": "run extends eagerly (so does --disable-cuda-graph)"})
    piecewise_cuda_graph_max_tokens: int | None = field(default=None, metadata={
        "help": "largest extend, in tokens, replayed from piecewise CUDA graphs "
                "(default min(chunked-prefill-size, 4096))"})
    piecewise_cuda_graph_tokens: str | None = field(default=None, metadata={
        "help": "the token counts to capture piecewise CUDA graphs for, a JSON list "
                "(default: steps up to --piecewise-cuda-graph-max-tokens)"})
    enable_prefix_grouped_decode: bool = field(default=False, metadata={
        "help": "decode attention reads a prefix that running requests share in the radix cache once per group "
                "and merges it with each request's own suffix (cascade attention, docs/prefix_grouped_decode.md)"})
    enable_mixed_chunk: bool = field(default=False, metadata={
        "help": "let the running requests decode inside a prefill batch instead of waiting for it"})
    mixed_chunk_min_size: int = field(default=0, metadata={
        "help": "with --enable-mixed-chunk, size each mixed step by the queue: the running requests plus an "
                "eighth of the prompt tokens waiting, at least this many tokens, at most --chunked-prefill-size "
                "(radixserve's; default 0: every mixed step takes --chunked-prefill-size)"})
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "process each batch's results before scheduling the next (no CPU/GPU overlap)"})
    mem_fraction_static: float = field(default=0.8, metadata={"help": "GPU memory share for weights + KV"})
    # The elastic KV pool (docs/elastic_kv.md): memory mapped as slots are handed out, returned when free.
    enable_elastic_kv: bool = field(default=False, metadata={
        "help": "reserve the KV pool's address space and map memory in pages as it is used; a page whose "
                "slots are all free (no request, no cached prefix) goes back"})
    elastic_kv_page_mb: float = field(default=ElasticKVConfig.page_mb, metadata={
        "help": "an elastic page in each layer's K and V buffer, in MB (rounded to whole slots and to the "
                "device's granularity: 2 MB on CUDA, the OS page on a CPU); larger pages map and unmap faster"})
    elastic_kv_max_gb: float | None = field(default=None, metadata={
        "help": "KV memory the elastic pool may grow to, in GB (default: the static pool's size, from "
                "--max-total-tokens / --mem-fraction-static)"})
    elastic_kv_min_reserve_pages: int = field(default=ElasticKVConfig.min_reserve_pages, metadata={
        "help": "empty elastic pages kept mapped ahead of need"})
    elastic_kv_max_reserve_pages: int = field(default=ElasticKVConfig.max_reserve_pages, metadata={
        "help": "empty elastic pages kept mapped before they are given back"})
    elastic_kv_min_gb: float = field(default=ElasticKVConfig.min_gb, metadata={
        "help": "KV memory this server keeps when another server on its device asks for memory (its floor), "
                "in GB; above it, cached prefixes are evicted and their pages given back"})
    elastic_kv_group: str = field(default=ElasticKVConfig.group, metadata={
        "help": "servers with elastic pools on one device that share its memory: each gives cached KV back "
                "when another of the group cannot map ('none': this server asks and gives nothing)"})
    elastic_kv_group_gb: float | None = field(default=None, metadata={
        "help": "KV memory the group's servers on one device may map together, in GB (default: what the "
                "device has)"})
    enable_memory_saver: bool = field(default=False, metadata={
        "help": "SGLang's: the weights live in virtual memory and the KV in the elastic pool (this implies "
                "--enable-elastic-kv), so /release_memory_occupation can give their memory back and "
                "/resume_memory_occupation take it again"})
    # Multi-LoRA serving (docs/lora.md), SGLang's flags.
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters over the base model; requests name one with lora_path (or an OpenAI model "
                "'BASE:ADAPTER')"})
    lora_paths: list[str] | None = field(default=None, metadata={
        "help": "adapters to load at start-up (PEFT folders), each NAME=PATH, a PATH (named by its folder) or "
                "JSON {\"lora_name\": ..., \"lora_path\": ...}; implies --enable-lora", "nargs": "+"})
    max_loras_per_batch: int = field(default=8, metadata={
        "help": "adapter slots on the device: the most adapters one batch uses (requests without one need none)"})
    max_lora_rank: int | None = field(default=None, metadata={
        "help": "the largest adapter rank the slots hold (default: the largest of --lora-paths)"})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "the projections that take LoRA (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or "
                "all; default: those the --lora-paths adapters target)", "nargs": "+"})
    lora_backend: str | None = field(default=None, metadata={
        "help": "how adapters' deltas run: triton (segmented GEMMs, under CUDA graphs; CUDA only) or torch_native "
                "(a loop over adapters, graphs off); default: triton on CUDA, torch_native elsewhere"})
    max_loaded_loras: int | None = field(default=None, metadata={
        "help": "the most adapters held in host memory (at least --max-loras-per-batch; default: no limit)"})
    random_seed: int = field(default=0, metadata={"help": "seed of the global RNG"})
    # Tensor parallelism (docs/tensor_parallel.md): one scheduler process per rank.
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks (one process and device each)"})
    # Pipeline parallelism (docs/pipeline_parallel.md): --pp-size stages of --tp-size ranks each.
    pp_size: int = field(default=1, metadata={
        "help": "pipeline stages, each holding a contiguous range of layers (SGLANG_PP_LAYER_PARTITION sets "
                "their sizes) on --tp-size ranks of its own"})
    pp_micro_batches: int | None = field(default=None, metadata={
        "help": "micro-batches in flight through the pipeline (default --pp-size; 1: one batch at a time)"})
    pp_max_micro_batch_size: int | None = field(default=None, metadata={
        "help": "the most requests one micro-batch runs (default --max-running-requests divided by the "
                "micro-batches), so that a burst of requests spreads over them"})
    # Mixture of experts (docs/moe.md), SGLang's flags.
    ep_size: int = field(default=1, metadata={
        "help": "expert-parallel ranks among the --tp-size ranks: each holds whole experts of 1/ep-size of them "
                "(sharded over tp-size/ep-size ranks); attention stays tensor parallel. 1: every expert sharded "
                "over all ranks"})
    moe_a2a_backend: str = field(default="none", metadata={
        "help": "how tokens reach experts on other ranks: none (every rank holds every token; one all-reduce "
                "sums the experts' outputs) or all_to_all (torch.distributed.all_to_all_single; needs --ep-size "
                "equal to --tp-size). deepep and mooncake need RDMA libraries this build lacks",
        "choices": MOE_A2A_BACKENDS})
    base_gpu_id: int = field(default=0, metadata={"help": "the first GPU this node's ranks use"})
    gpu_id_step: int = field(default=1, metadata={"help": "GPU ids between consecutive ranks of this node"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port where the ranks meet (torch.distributed TCP store); default a free local port"})
    nnodes: int = field(default=1, metadata={"help": "hosts the TP ranks span"})
    node_rank: int = field(default=0, metadata={"help": "this host's index among --nnodes (0 serves HTTP)"})
    dist_timeout: float | None = field(default=None, metadata={
        "help": "seconds before a collective that a rank never joins fails (default 600)"})
    # Prefill/decode disaggregation (docs/disaggregation.md), with SGLang's flags.
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null (prefill and decode here), prefill (compute prompts and send their KV to a decode server) "
                "or decode (receive the KV, then generate)", "choices": DISAGGREGATION_MODES})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={
        "help": "the bootstrap server a prefill server runs for decode servers to find its ranks"})
    disaggregation_transfer_backend: str = field(default="torch", metadata={
        "help": "how KV moves between servers: torch (torch.distributed point-to-point, gloo on CPU)"})
    # Data parallelism (docs/data_parallel.md): replicas behind one TokenizerManager.
    dp_size: int = field(default=1, metadata={"help": "scheduler replicas (each with --tp-size ranks) in one server"})
    load_balance_method: str = field(default="round_robin", metadata={
        "help": "how requests are spread over --dp-size replicas (on a prefill server, a request with a "
                "bootstrap room goes to replica room %% dp-size)", "choices": LOAD_BALANCE_METHODS})
    kv_events_config: str | None = field(default=None, metadata={
        "help": "publish KV cache events for routers, a JSON object, e.g. "
                "'{\"publisher\": \"zmq\", \"replay_endpoint\": \"tcp://127.0.0.1:5558\"}' "
                "(without an endpoint, the PUB socket listens at --host, port 5557)"})
    torch_profiler_dir: str | None = field(default=None, metadata={
        "help": "the directory /start_profile writes traces under; a request's output_dir must lie inside it "
                "(default $SGLANG_TORCH_PROFILER_DIR, else the system's temporary directory)"})
    check_invariants: bool = field(default=False, metadata={"help": "check the memory invariant after every step"})
    stream_interval: int = field(default=1, metadata={
        "help": "output tokens between a streamed request's events (a request's sampling_params.stream_interval "
                "overrides it); larger values cost the server less per token with many streams"})
    incremental_streaming_output: bool = field(default=False, metadata={
        "help": "each event of a native /generate stream carries only what is new: text, output_ids, logprobs"})
    # Limits on what clients may ask (docs/limits.md).
    max_queued_requests: int | None = field(default=4096, metadata={
        "help": "requests (each prompt and sample counts) that may wait beyond --max-running-requests; "
                "more get HTTP 429"})
    request_timeout: float | None = field(default=None, metadata={
        "help": "seconds from a request's arrival to its last token; a request that takes longer is aborted "
                "(HTTP 504, or an error event in a stream); default: no limit"})
    max_request_body_bytes: int = field(default=32 << 20, metadata={"help": "larger HTTP bodies get HTTP 413"})
    max_prompt_chars: int | None = field(default=None, metadata={
        "help": "characters of one text prompt, checked before tokenizing; default 32 per token of the context length"})
    grammar_compile_max_mb: int = field(default=CompileLimits.max_mb, metadata={
        "help": "memory one grammar's compile may take (json_schema, regex, ebnf, tools), tried in a child "
                "process before it is queued; a grammar over it gets HTTP 400"})
    grammar_compile_timeout: float = field(default=CompileLimits.timeout_s, metadata={
        "help": "seconds one grammar's compile may take; a grammar over it gets HTTP 400"})
    grammar_cache_max_mb: int = field(default=GRAMMAR_CACHE_MB, metadata={
        "help": "compiled grammars each scheduler keeps for reuse, in MB (least recently used out; "
                "/flush_cache empties it)"})
    http_header_timeout: float = field(default=30.0, metadata={
        "help": "seconds a connection may take to send a request's headers before it is closed"})
    max_connections: int | None = field(default=None, metadata={
        "help": "open HTTP connections (and requests in progress) beyond which requests get HTTP 503; "
                "default 4096, or fewer where the open-file limit is lower"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress bar for batches"})
    skip_server_warmup: bool = field(default=False, metadata={
        "help": "report healthy at once, without first generating a few tokens of a warm-up request "
                "(servers with --disaggregation-mode prefill or decode never warm up)"})
    # OpenAI chat output (docs/api.md): tool calls and reasoning parsed out of the text
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "the format of the model's tool calls, parsed into tool_calls with tool_choice auto",
        "choices": TOOL_CALL_PARSER_NAMES})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "the format of the model's reasoning, returned as reasoning_content", "choices": REASONING_PARSER_NAMES})

    def __post_init__(self) -> None:
        one_of("load_format", self.load_format, ("auto", "safetensors", "gguf", "dummy"))
        one_of("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        one_of("device", self.device, ("auto", "cpu", "cuda"))
        one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization is not None:
            one_of("quantization", self.quantization, QUANTIZATIONS)
        one_of("attention_backend", self.attention_backend, ("auto", "triton", "torch_native"))
        one_of("load_balance_method", self.load_balance_method, LOAD_BALANCE_METHODS)
        for name, allowed in (("tool_call_parser", TOOL_CALL_PARSER_NAMES), ("reasoning_parser", REASONING_PARSER_NAMES)):
            if getattr(self, name) is not None:
                one_of(name, getattr(self, name), allowed)
        for name in ("page_size", "max_running_requests", "max_prefill_tokens", "tp_size", "pp_size", "nnodes",
                     "gpu_id_step", "dp_size", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise ValueError(f"chunked_prefill_size must be positive or -1, got {self.chunked_prefill_size}")
        if self.mixed_chunk_min_size < 0 or (self.mixed_chunk_min_size and not self.enable_mixed_chunk):
            raise ValueError(f"mixed_chunk_min_size must be >= 0 and needs --enable-mixed-chunk, "
                             f"got {self.mixed_chunk_min_size}")
        self._check_elastic_kv()
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens {self.max_total_tokens} is smaller than one page ({self.page_size})")
        for name in ("max_queued_requests", "max_prompt_chars", "max_connections"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("request_timeout", "http_header_timeout", "max_request_body_bytes", "grammar_compile_max_mb",
                     "grammar_compile_timeout", "grammar_cache_max_mb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.piecewise_cuda_graph_max_tokens is not None and self.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError(f"piecewise_cuda_graph_max_tokens must be >= 1, got {self.piecewise_cuda_graph_max_tokens}")
        self._piecewise_token_list()  # fail at start-up, naming the flag
        self._check_distributed()
        self._check_disaggregation()
        self._check_hicache()
        self._check_lora()
        self.model_overrides()  # fail at start-up, naming the flag
        if self.kv_events_config:
            from radixserve.mem_cache.kv_events.publisher import KVEventsConfig
            from radixserve.mem_cache.kv_events.recorder import event_block_size

            try:
                event_block_size(self.page_size, KVEventsConfig.from_json(self.kv_events_config).block_size)
            except ValueError as exc:  # the config's own errors name the flag already
                raise ValueError(str(exc) if "kv-events-config" in str(exc) else f"kv_events_config: {exc}") from None
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")

    def _check_distributed(self) -> None:
        check_expert_parallel(self.tp_size, self.ep_size, self.moe_a2a_backend)
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if (self.tp_size * self.pp_size) % self.nnodes:
            ranks = f"tp_size {self.tp_size}" + (f" x pp_size {self.pp_size}" if self.pp_size > 1 else "")
            raise ValueError(f"{ranks} is not divisible by nnodes {self.nnodes}")
        self._check_pipeline()
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError("dp_size: data parallelism runs on one host; with several, run a server per host "
                             "behind a router")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr: several nodes need the address where their ranks meet (host:port)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.dist_timeout is not None and not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")

    def _check_pipeline(self) -> None:
        """What pipeline stages do not combine with (docs/pipeline_parallel.md): each of these
        takes decisions on one rank's timing or state that the stages would have to share."""
        for name in ("pp_micro_batches", "pp_max_micro_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_size == 1:
            return
        refused = {"dp_size": self.dp_size > 1, "disaggregation_mode": self.disaggregation_mode != "null",
                   "enable_hierarchical_cache": self.enable_hierarchical_cache,
                   "enable_elastic_kv": self.enable_elastic_kv, "enable_lora": self.enable_lora,
                   "enable_prefix_grouped_decode": self.enable_prefix_grouped_decode}
        for name, on in refused.items():
            if on:
                raise ValueError(f"{name}: not supported with pipeline parallelism (--pp-size {self.pp_size})")

    def resolved_pp_micro_batches(self) -> int:
        return self.pp_micro_batches or self.pp_size

    def resolved_pp_max_micro_batch_size(self) -> int:
        return self.pp_max_micro_batch_size or max(1, self.max_running_requests // self.resolved_pp_micro_batches())

    def _check_disaggregation(self) -> None:
        one_of("disaggregation_mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        try:
            check_transfer_backend(self.disaggregation_transfer_backend)
        except ValueError as e:
            raise ValueError(f"disaggregation_transfer_backend: {e}") from None
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port must be a port, got {self.disaggregation_bootstrap_port}")
        # A mode takes any --tp-size, --dp-size and --nnodes, each server its own: disaggregation/head_map.py
        # maps the KV heads between the tp sizes; a prefill server serves room r on replica r % dp_size, where
        # the decode side looks; its ranks on other nodes register with the bootstrap server of node 0.

    def local_ranks(self) -> list[tuple[int, int]]:
        """The ``(pp_rank, tp_rank)`` of each rank this node runs: global
        ranks ``pp_rank * tp_size + tp_rank`` split evenly over the nodes, so
        that a stage's ranks share a node where they fit (rank 0, which talks
        to the tokenizer and detokenizer, is on node 0)."""
        per_node = self.tp_size * self.pp_size // self.nnodes
        return [divmod(g, self.tp_size) for g in range(self.node_rank * per_node, (self.node_rank + 1) * per_node)]

    def tp_device(self, tp_rank: int, dp_rank: int = 0, pp_rank: int = 0) -> str:
        """The device of TP rank ``tp_rank`` of stage ``pp_rank`` of replica
        ``dp_rank``: this host's ``i``-th scheduler process (replica by
        replica) gets ``cuda:<base_gpu_id + i * gpu_id_step>``; or cpu."""
        device = self.resolved_device()
        if device != "cuda":
            return device
        local = self.local_ranks()
        i = dp_rank * len(local) + local.index((pp_rank, tp_rank))
        return f"cuda:{self.base_gpu_id + i * self.gpu_id_step}"

    def processes_per_host(self) -> int:
        """Scheduler processes on this host: every replica's local ranks."""
        return self.dp_size * len(self.local_ranks())

    def model_name(self) -> str:
        """The name clients use: --served-model-name, else the model path's base name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model_path is None:
            return "SmolLM2-135M-Instruct"
        return os.path.basename(os.path.normpath(self.model_path)) or self.model_path

    def model_names(self, model_path: str) -> set[str]:
        """Every name a client may give for the model: the served name, the
        path given on the command line, and ``model_path`` (the resolved one
        that /get_model_info reports and SGLang's router lists)."""
        return {self.model_name(), model_path, *([self.model_path] if self.model_path else [])}

    def resolved_chunked_prefill_size(self) -> int:
        """A CPU prefills ~10^3 tokens/s: smaller chunks keep decodes (and TTFT) moving."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 8192 if self.resolved_device() == "cuda" else 2048

    def resolved_cuda_graph_max_bs(self) -> int:
        """0 when CUDA graphs are off: on CPU, with torch_native attention
        (its decode reads lengths on the host), with --disable-cuda-graph, or
        with pipeline stages (which run eagerly for now)."""
        if (self.disable_cuda_graph or self.resolved_device() != "cuda" or self.resolved_attention_backend() != "triton"
                or self.pp_size > 1):
            return 0
        return min(self.cuda_graph_max_bs or 256, self.max_running_requests)

    def resolved_piecewise_cuda_graph_tokens(self) -> list[int]:
        """The token counts extends are captured for; [] when they run
        eagerly: with --disable-piecewise-cuda-graph or --disable-cuda-graph,
        off CUDA, on a decode server (it never prefills), or with pipeline stages."""
        if (self.disable_piecewise_cuda_graph or self.disable_cuda_graph or self.pp_size > 1
                or self.resolved_device() != "cuda" or self.disaggregation_mode == "decode"):
            return []
        if self.piecewise_cuda_graph_tokens:
            return self._piecewise_token_list()
        chunk = self.resolved_chunked_prefill_size()
        return piecewise_token_sizes(self.piecewise_cuda_graph_max_tokens or min(
            chunk if chunk > 0 else PIECEWISE_MAX_TOKENS, PIECEWISE_MAX_TOKENS))

    def _piecewise_token_list(self) -> list[int]:
        if not self.piecewise_cuda_graph_tokens:
            return []
        try:
            sizes = json.loads(self.piecewise_cuda_graph_tokens)
        except ValueError:
            sizes = None
        if not isinstance(sizes, list) or not sizes or not all(type(t) is int and t > 0 for t in sizes):
            raise ValueError("piecewise_cuda_graph_tokens must be a JSON list of positive integers, "
                             f"got {self.piecewise_cuda_graph_tokens!r}")
        return sorted(set(sizes))

    def resolved_max_prompt_chars(self, context_len: int) -> int:
        """A prompt longer than this many characters cannot fit the context
        (a token is rarely more than a few characters), so it is refused
        before the tokenizer spends seconds on it."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN_LIMIT * context_len

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch_native"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            helptext = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=helptext)
            elif "nargs" in f.metadata:  # a list of strings
                parser.add_argument(flag, type=str, nargs=f.metadata["nargs"], default=f.default, help=helptext)
            else:
                parser.add_argument(flag, type=_cli_type(f), default=f.default, choices=f.metadata.get("choices"),
                                    help=f"{helptext} (default {f.default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def model_overrides(self) -> dict:
        """``--json-model-override-args`` as a dict of config fields."""
        try:
            overrides = json.loads(self.json_model_override_args)
        except ValueError as exc:
            raise ValueError(f"json_model_override_args is not JSON: {exc}") from None
        if not isinstance(overrides, dict):
            raise ValueError("json_model_override_args must be a JSON object")
        return overrides

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """The extend sizes to capture piecewise CUDA graphs for, up to
    ``max_tokens`` (and ``max_tokens`` itself): steps of 4 to 32, 16 to 256,
    32 to 512, 64 to 1,024, 128 to 2,048, then 256: past 128 tokens padding
    adds at most an eighth of a batch; below, a step is bound by its launches anyway."""
    steps = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1152, 2048, 128), (2304, max_tokens, 256))
    sizes = [t for start, stop, step in steps for t in range(start, stop + 1, step) if t <= max_tokens]
    return sorted(set(sizes + [max_tokens]))



def _cli_type(f: dataclasses.Field):
    t = str(f.type)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str
