"""The options of the engine's optional parts: LoRA, the hierarchical
cache, the elastic KV pool, grammar compilation and the profiler. Their
option objects, and the checks of their flags, which ``ServerArgs`` (a
``FeatureArgs``) runs at start-up, each error naming its flag."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.lora.options import LoRAOptions

HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # HiRadixCache's (hiradix_cache.py)
HICACHE_STORAGE_BACKENDS = ("file",)
ELASTIC_KV_GROUP = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # an --elastic-kv-group: part of a file name


@dataclass(frozen=True)
class ElasticKVConfig:
    """The elastic KV pool's options (``--enable-elastic-kv``, docs/elastic_kv.md)."""

    page_mb: float = 8.0  # one elastic page in each K or V buffer (the driver's cost is per mapping: docs/elastic_kv.md)
    max_gb: float | None = None  # address space to reserve, beyond the static pool's size
    min_reserve_pages: int = 1  # empty pages kept mapped ahead of need
    max_reserve_pages: int = 2  # empty pages kept before unmapping
    min_gb: float = 0.0  # what another server's ask leaves this one (its floor)
    group: str | None = "default"  # the servers on a device that give each other memory (None: none)
    group_gb: float | None = None  # what the group's servers may map together (None: what the device has)


@dataclass(frozen=True)
class CompileLimits:
    """What compiling one grammar may take (``--grammar-compile-max-mb``,
    ``--grammar-compile-timeout``; ``sampling/grammar_sandbox.py``)."""

    max_mb: int = 1024
    timeout_s: float = 30.0


def one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


class FeatureArgs:
    """``ServerArgs``'s methods for those parts; it holds their flags."""

    def _check_elastic_kv(self) -> None:
        if self.enable_memory_saver:  # the KV side of the memory saver is the elastic pool
            self.enable_elastic_kv = True
        if not self.elastic_kv_page_mb > 0 or (self.elastic_kv_max_gb is not None and not self.elastic_kv_max_gb > 0):
            raise ValueError("elastic_kv_page_mb and elastic_kv_max_gb must be > 0")
        if not self.elastic_kv_min_gb >= 0 or (self.elastic_kv_group_gb is not None and not self.elastic_kv_group_gb > 0):
            raise ValueError("elastic_kv_min_gb must be >= 0 and elastic_kv_group_gb > 0")
        if not ELASTIC_KV_GROUP.fullmatch(self.elastic_kv_group):
            raise ValueError(f"elastic_kv_group: letters, digits, '_', '.' and '-' (at most 64), "
                             f"got {self.elastic_kv_group!r}")
        if not 0 <= self.elastic_kv_min_reserve_pages <= self.elastic_kv_max_reserve_pages:
            raise ValueError("elastic KV reserve: need 0 <= --elastic-kv-min-reserve-pages <= "
                             "--elastic-kv-max-reserve-pages")

    def _check_lora(self) -> None:
        if isinstance(self.lora_paths, str):  # the Engine's keyword may be one entry
            self.lora_paths = [self.lora_paths]
        if self.lora_paths:  # SGLang's rule too
            self.enable_lora = True
        options = self.lora_options()  # every flag parsed, each error naming it
        if options is None:
            return
        if self.disaggregation_mode != "null":
            raise ValueError("enable_lora: not with --disaggregation-mode (the KV sent between servers is not keyed "
                             "by adapter)")
        if self.enable_hierarchical_cache:
            raise ValueError("enable_lora: not with --enable-hierarchical-cache (its tiers do not key prefixes by "
                             "adapter yet)")
        if self.kv_events_config:
            raise ValueError("enable_lora: not with --kv-events-config (its block hashes do not tell adapters apart "
                             "yet)")
        if options.backend == "torch_native" and not self.disable_cuda_graph:  # graphs would freeze one batch's loop
            if self.resolved_device() == "cuda":
                logging.getLogger(__name__).warning("--lora-backend torch_native: CUDA graphs are turned off (it "
                                                    "loops over a batch's adapters on the host, docs/lora.md)")
            self.disable_cuda_graph = True

    def lora_options(self) -> "LoRAOptions | None":
        """The LoRA flags checked (``lora/options.py``), or None without ``--enable-lora``."""
        from radixserve.lora.options import LORA_BACKENDS, LoRAOptions, parse_lora_paths, parse_target_modules

        if not self.enable_lora:
            for name in ("max_lora_rank", "lora_target_modules", "max_loaded_loras", "lora_backend"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: needs --enable-lora")
            return None
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        paths = parse_lora_paths(self.lora_paths)
        modules = parse_target_modules(self.lora_target_modules)
        if not paths and (self.max_lora_rank is None or modules is None):
            raise ValueError("enable_lora: without --lora-paths, give --max-lora-rank and --lora-target-modules "
                             "(the adapters loaded later must fit them)")
        if self.max_loaded_loras is not None and self.max_loaded_loras < max(self.max_loras_per_batch, len(paths)):
            raise ValueError(f"max_loaded_loras must be at least --max-loras-per-batch ({self.max_loras_per_batch}) "
                             f"and the number of --lora-paths ({len(paths)}), got {self.max_loaded_loras}")
        on_cuda = self.resolved_device() == "cuda"
        backend = self.lora_backend or ("triton" if on_cuda else "torch_native")
        one_of("lora_backend", backend, LORA_BACKENDS)
        if backend == "triton" and not on_cuda:
            raise ValueError(f"lora_backend: triton runs on CUDA only (device {self.resolved_device()}); "
                             "use torch_native")
        return LoRAOptions(paths, self.max_loras_per_batch, self.max_lora_rank, modules, self.max_loaded_loras,
                           backend)

    def _check_hicache(self) -> None:
        one_of("hicache_write_policy", self.hicache_write_policy, HICACHE_WRITE_POLICIES)
        if self.hicache_storage_backend is not None:
            one_of("hicache_storage_backend", self.hicache_storage_backend, HICACHE_STORAGE_BACKENDS)
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                raise ValueError("hicache_storage_backend: the file tier sits under the host tier; "
                                 "add --enable-hierarchical-cache")
            return
        if self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache: the hierarchical cache is a radix cache; "
                             "drop --disable-radix-cache")
        self.hicache_storage_options()  # fail at start-up, naming the flag
        if self.hicache_size < 0 or (self.hicache_size == 0 and not self.hicache_ratio > 1):
            raise ValueError(f"hicache_ratio must be > 1 (or --hicache-size > 0 GB), got {self.hicache_ratio}")

    def hicache_storage_options(self) -> dict:
        """``--hicache-storage-backend-extra-config`` checked: ``{"max_gb": float}`` or ``{}``."""
        if not self.hicache_storage_backend_extra_config:
            return {}
        try:
            options = json.loads(self.hicache_storage_backend_extra_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"hicache_storage_backend_extra_config: not JSON ({exc})") from None
        if not isinstance(options, dict) or set(options) - {"max_gb"}:
            raise ValueError("hicache_storage_backend_extra_config: a JSON object whose only key is max_gb, "
                             f"got {self.hicache_storage_backend_extra_config!r}")
        max_gb = options.get("max_gb")
        if max_gb is not None and (isinstance(max_gb, bool) or not isinstance(max_gb, (int, float)) or max_gb <= 0):
            raise ValueError(f"hicache_storage_backend_extra_config: max_gb must be a positive number, got {max_gb!r}")
        return options

    def resolved_hicache_storage_dir(self) -> str:
        from radixserve.cache_dir import cache_root

        return (self.hicache_storage_dir or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
                or os.path.join(cache_root(), "hicache"))

    def elastic_kv_config(self) -> ElasticKVConfig | None:
        """The elastic pool's options, or None for a pool allocated whole."""
        if not self.enable_elastic_kv:
            return None
        return ElasticKVConfig(self.elastic_kv_page_mb, self.elastic_kv_max_gb, self.elastic_kv_min_reserve_pages,
                               self.elastic_kv_max_reserve_pages, self.elastic_kv_min_gb,
                               None if self.elastic_kv_group == "none" else self.elastic_kv_group,
                               self.elastic_kv_group_gb)

    def grammar_compile_limits(self) -> CompileLimits:
        return CompileLimits(self.grammar_compile_max_mb, self.grammar_compile_timeout)

    def resolved_torch_profiler_dir(self) -> str:
        # SGLang's variable and default, so that its scripts find the traces
        return self.torch_profiler_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()
