"""From ``ServerArgs`` to a running Scheduler: the one place that resolves the
model, constructs the ``ModelRunner``, loads the tokenizer and works out the
EOS ids. The scheduler process and the offline Engine both build through
``build_scheduler``; ``bench.one_batch`` builds its runner with
``build_model_runner``, overriding only the pool sizes its cases need.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from radixserve.managers.scheduler import Scheduler
from radixserve.server_args import ServerArgs


def build_model_runner(args: ServerArgs, model_config, tp_rank: int = 0, dist_init_method: str | None = None,
                       dp_rank: int = 0, pp_rank: int = 0, **overrides: Any):
    """The ModelRunner that ``args`` describe, at TP rank ``tp_rank`` of
    pipeline stage ``pp_rank`` (``overrides`` replace its keyword arguments:
    ``max_total_tokens``, ``max_running_requests``, ``max_context_len``)."""
    from radixserve.distributed import DEFAULT_TIMEOUT_S
    from radixserve.mem_cache.memory_pool import resolve_kv_cache_dtype
    from radixserve.model_executor.model_runner import ModelRunner

    if args.tp_size * args.pp_size > 1 and dist_init_method is None:
        dist_init_method = f"tcp://{args.dist_init_addr}" if args.dist_init_addr else None
    options = dict(
        device=args.tp_device(tp_rank, dp_rank, pp_rank),
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        max_context_len=args.context_length,
        attention_backend=args.resolved_attention_backend(),
        mem_fraction_static=args.mem_fraction_static,
        seed=args.random_seed,
        cuda_graph_max_bs=args.resolved_cuda_graph_max_bs(),
        piecewise_cuda_graph_tokens=args.resolved_piecewise_cuda_graph_tokens(),
        kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, model_config.dtype),
        quantization=args.quantization,
        tp_rank=tp_rank,
        tp_size=args.tp_size,
        pp_rank=pp_rank,
        pp_size=args.pp_size,
        dist_init_method=dist_init_method,
        dist_timeout_s=args.dist_timeout or DEFAULT_TIMEOUT_S,
        nnodes=args.nnodes,
        elastic_kv=args.elastic_kv_config(),
        enable_memory_saver=args.enable_memory_saver,
        ep_size=args.ep_size,
        moe_a2a_backend=args.moe_a2a_backend,
        prefix_grouped_decode=args.enable_prefix_grouped_decode,
        lora=args.lora_options(),
    )
    return ModelRunner(model_config, **{**options, **overrides})


def load_tokenizer(model_config):
    """The model's HF tokenizer, or None for a model without one (dummy weights)."""
    if not model_config.tokenizer_dir:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer_dir)


def eos_token_ids(model_config, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the model config's, the tokenizer's and
    the generation config's (chat models often list several)."""
    ids: set[int] = set()
    for source in (getattr(model_config.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    if model_config.tokenizer_dir:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_config.tokenizer_dir).eos_token_id
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        except (OSError, ValueError):  # no generation_config.json
            pass
    return frozenset(ids)


def build_scheduler(args: ServerArgs, tp_rank: int = 0, dist_init_method: str | None = None,
                    dp_rank: int = 0, pp_rank: int = 0, **runner_options: Any) -> Scheduler:
    """Resolve the model, load weights and tokenizer, build the scheduler
    (of TP rank ``tp_rank`` of pipeline stage ``pp_rank`` of replica
    ``dp_rank``, whose ranks meet at ``dist_init_method``);
    ``runner_options`` go to ``build_model_runner``."""
    from radixserve.model_loader import resolve_model

    device = args.resolved_device()
    if device == "cpu":
        from radixserve.model_executor.cpu_malloc import reuse_freed_memory

        reuse_freed_memory()
        if args.processes_per_host() > 1:  # this host's scheduler processes share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.processes_per_host()))
    model_config = resolve_model(args.model_path, args.load_format, args.dtype, device, args.tokenizer_path,
                                 args.model_overrides())
    runner = build_model_runner(args, model_config, tp_rank, dist_init_method, dp_rank, pp_rank, **runner_options)
    tokenizer = load_tokenizer(model_config)
    publisher = kv_event_publisher(args, pp_rank * args.tp_size + tp_rank, dp_rank)
    return Scheduler(args, runner, tokenizer, eos_token_ids(model_config, tokenizer), publisher, dp_rank)


def kv_event_publisher(args: ServerArgs, tp_rank: int = 0, dp_rank: int = 0):
    """Replica ``dp_rank``'s KV event publisher (docs/kv_events.md), on its
    TP rank 0 only (the other ranks' caches are the same), at ``--host``
    unless the config names an endpoint; None when ``--kv-events-config`` is
    off. The scheduler's ``close`` stops it."""
    if tp_rank != 0 or not args.kv_events_config:
        return None
    from radixserve.mem_cache.kv_events import create_publisher

    return create_publisher(args.kv_events_config, dp_rank, args.page_size, args.host)
