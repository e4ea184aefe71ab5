"""Prometheus metrics of the server (prometheus-client, own registry),
named like SGLang's (``radixserve:prompt_tokens_total`` ...)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from radixserve.layers.moe.load_stats import PREFIX as MOE_PREFIX
from radixserve.layers.moe.load_stats import bucket_key as moe_bucket_key

from radixserve.mem_cache.kv_events.publisher import DROP_REASONS

HICACHE_GAUGES = (
    ("hicache_host_used", "hicache_host_used_tokens", "Host tier slots holding KV"),
    ("hicache_host_size", "hicache_host_size_tokens", "Host tier size in tokens"),
    ("hicache_backed_up", "hicache_backed_up_tokens", "Tokens copied device to host since start"),
    ("hicache_loaded_back", "hicache_loaded_back_tokens", "Tokens loaded back host to device since start (host hits)"),
    ("hicache_host_evicted", "hicache_host_evicted_tokens", "Tokens evicted from the host tier since start"),
    ("hicache_storage_prefetched", "hicache_storage_prefetched_tokens",
     "Tokens read from the file tier into the host since start (file hits)"),
    ("hicache_storage_writes", "hicache_storage_written_blocks", "Blocks written to the file tier since start"),
    ("hicache_storage_corrupt", "hicache_storage_corrupt_blocks", "Corrupt or stale files dropped since start"),
    ("hicache_storage_unreadable", "hicache_storage_unreadable_blocks",
     "Block paths that failed to read (a directory, EACCES, EIO...) since start, each once"),
)
GRAMMAR_GAUGES = (
    ("grammar_cache_bytes", "grammar_cache_bytes", "Bytes of compiled grammars the schedulers keep for reuse"),
    ("grammar_cache_entries", "grammar_cache_entries", "Compiled grammars the schedulers keep for reuse"),
)
ELASTIC_KV_GAUGES = tuple((key, key, text) for key, text in (
    ("elastic_kv_reserved_bytes", "Address space the elastic KV pool reserved"),
    ("elastic_kv_mapped_bytes", "Memory the elastic KV pool has mapped"),
    ("elastic_kv_used_bytes", "Mapped memory in pages that hold a used slot (a request's or a cached prefix's)"),
    ("elastic_kv_limit_bytes", "What the elastic KV pool may map"),
    ("elastic_kv_reserve_pages", "Empty pages the elastic KV pool keeps mapped ahead of need"),
    ("elastic_kv_maps", "Pages mapped since start"),
    ("elastic_kv_unmaps", "Pages unmapped since start"),
    ("elastic_kv_failed_maps", "Maps the device refused since start (no memory left)"),
    ("elastic_kv_map_seconds", "Seconds spent mapping since start"),
    ("elastic_kv_unmap_seconds", "Seconds spent unmapping since start"),
    ("elastic_kv_floor_bytes", "What the elastic KV pool keeps when other servers on its device ask for memory"),
    ("elastic_kv_given_pages", "Pages unmapped since start because other servers on the device asked"),
    ("elastic_kv_asks", "Times since start the pool asked the other servers on its device for memory"),
    ("elastic_kv_ahead_pages", "Pages asked of the mapper's thread ahead of need and not taken yet"),
    ("elastic_kv_step_maps", "Maps a scheduler step waited for since start (it outran the pages mapped ahead)"),
    ("elastic_kv_step_map_seconds", "Seconds scheduler steps spent waiting for maps since start"),
))
class ExpertLoadCollector:
    """A MoE model's tokens per expert per step (``layers/moe/load_stats.py``):
    a histogram the schedulers bin (they hold the counts) and report as
    cumulative figures, exposed as they last reported them; absent for a dense model."""

    def __init__(self):
        self.state: dict = {}

    def describe(self):
        return []  # figures appear only once a MoE model reports them

    def collect(self):
        if f"{MOE_PREFIX}_count" not in self.state:
            return
        bounds = [key.rsplit("_le_", 1)[1] for key in self.state if key.startswith(f"{MOE_PREFIX}_le_")]
        buckets = [("+Inf" if b == "inf" else f"{float(b)}", self.state[moe_bucket_key(float(b))]) for b in bounds]
        family = HistogramMetricFamily(
            "radixserve:" + MOE_PREFIX + "_per_step",
            "Tokens one expert of one MoE layer received per forward pass (an observation per layer and expert "
            "every stats report)")
        family.add_metric([], buckets, sum_value=self.state[f"{MOE_PREFIX}_sum"])
        yield family


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r, p = self.registry, "radixserve:"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(p + "num_requests", "Requests finished", ["finish_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(p + "num_running_reqs", "Requests in the running batch", registry=r)
        self.queued = Gauge(p + "num_queue_reqs", "Requests waiting", registry=r)
        self.token_usage = Gauge(p + "token_usage", "Share of the KV pool in use (not free, not evictable)", registry=r)
        self.cache_hit_rate = Gauge(p + "cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", registry=r)
        # The hierarchical cache's tiers (docs/hicache.md); present with --enable-hierarchical-cache.
        self.hicache = {key: Gauge(p + name, text, registry=r) for key, name, text in HICACHE_GAUGES}
        self.grammar = {key: Gauge(p + name, text, registry=r) for key, name, text in GRAMMAR_GAUGES}
        # The elastic KV pool (docs/elastic_kv.md); present with --enable-elastic-kv.
        self.elastic_kv = {key: Gauge(p + name, text, registry=r) for key, name, text in ELASTIC_KV_GAUGES}
        # KV events (docs/kv_events.md): a counter, fed by the schedulers' running totals; present with
        # --kv-events-config
        self.kv_events_dropped = Counter(p + "kv_events_dropped", "KV cache events not sent live since start: "
                                         "the publisher's queue was full, or its socket refused them",
                                         ["reason"], registry=r)
        self._kv_events_dropped_seen: dict[str, float] = {}
        # Load balance of a MoE model's experts (docs/moe.md).
        self.expert_load = ExpertLoadCollector()
        r.register(self.expert_load)

    def on_request(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, state, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        if state.first_token_time is None:
            state.first_token_time = now
            self.ttft.observe(now - state.created)
        elif state.last_token_time is not None:
            gap = (now - state.last_token_time) / n
            for _ in range(n):
                self.itl.observe(gap)
        state.last_token_time = now

    def on_finish(self, state, now: float) -> None:
        reason = (state.meta.get("finish_reason") or {}).get("type", "unknown")
        self.requests.labels(finish_reason=reason).inc()
        self.e2e.observe(now - state.created)

    def update_from_state(self, state: dict) -> None:
        self.expert_load.state = {k: v for k, v in state.items() if k.startswith(MOE_PREFIX)}
        self.running.set(state.get("running", 0))
        self.queued.set(state.get("waiting", 0))
        self.token_usage.set(state.get("kv_usage", 0.0))
        self.cache_hit_rate.set(state.get("cache_hit_rate", 0.0))
        for key, gauge in (*self.hicache.items(), *self.grammar.items(), *self.elastic_kv.items()):
            if key in state:
                gauge.set(state[key])
        for reason in DROP_REASONS:
            total = state.get(f"kv_events_dropped_{reason}")
            if total is not None:
                seen = self._kv_events_dropped_seen.get(reason, 0)
                self.kv_events_dropped.labels(reason=reason).inc(max(total - seen, 0))
                self._kv_events_dropped_seen[reason] = max(total, seen)

    def render(self) -> bytes:
        return generate_latest(self.registry)
