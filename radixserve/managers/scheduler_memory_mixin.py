"""SGLang's ``release_memory_occupation`` and ``resume_memory_occupation`` on
the Scheduler (``--enable-memory-saver``, docs/elastic_kv.md): an RL framework
gives the device's memory to its trainer between rollouts and takes it back.

- ``kv_cache``: the radix cache is flushed and the elastic pool gives back
  every page (``ElasticTokenToKVPoolAllocator.release``); resume maps the
  dummy page and the reserve again.
- ``weights``: the weight arena copies the weights to the host and unmaps
  them, their addresses kept (``model_executor/weight_arena.py``); resume
  maps them back and copies them in.

While any tag is released nothing is admitted and no forward runs: requests
that arrive wait in the queue (aborts still end them) and run after resume.
Release is refused while a request holds KV or a forward or cache copy is in
flight (SGLang asserts that the server is idle). Releasing what is released
already, or resuming what is not, changes nothing and succeeds (SGLang's
resume raises there, which RL frameworks wrap). A disaggregation server
refuses both: a transfer may need the KV at any time. Every tensor-parallel rank
handles the same message in the same order, and a refusal on one rank (no
host memory for the copy, no device memory to map back) is agreed on all.
"""

from __future__ import annotations

from radixserve.disaggregation.base import DisaggregationMode
from radixserve.managers.io_struct import MEMORY_TAGS


class SchedulerMemoryMixin:
    """The Scheduler's memory occupation (see the module docstring);
    ``offload_tags`` (SGLang's name) holds the tags released now."""

    offload_tags: set[str]

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str, dict]:
        """Give back the memory of ``tags`` (None or empty: all): ``(ok, message, state)``."""
        wanted, error = self._memory_tags(tags)
        if error is None and self._holds_memory():
            error = "cannot release memory while requests are running"
        todo = [t for t in wanted if t not in self.offload_tags]
        return self._each_tag(error, todo, self._release_tag, self.offload_tags.add)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str, dict]:
        """Take the memory of ``tags`` (None or empty: all) back: ``(ok, message, state)``."""
        wanted, error = self._memory_tags(tags)
        todo = [t for t in reversed(wanted) if t in self.offload_tags]  # the weights first, as SGLang
        return self._each_tag(error, todo, self._resume_tag, self.offload_tags.discard)

    def _each_tag(self, error: str | None, tags: list[str], change, record) -> tuple[bool, str, dict]:
        """``change`` each tag in turn (``record`` it when done) until one fails."""
        for tag in [] if error else tags:
            error = change(tag)
            if error:
                break
            record(tag)
        return error is None, error or "", self.memory_occupation()

    def _release_tag(self, tag: str) -> str | None:
        if tag == "weights":
            return self.model_runner.weight_arena.release()
        self.tree_cache.reset()  # SGLang flushes the cache too: every slot free
        self.allocator.release()
        self._publish_kv_events()
        return None

    def _resume_tag(self, tag: str) -> str | None:
        if tag == "weights":
            return self.model_runner.weight_arena.resume()
        return None if self.allocator.resume() else "no memory to map the KV cache back (on some rank)"

    def held(self) -> bool:
        """Memory is released: waiting requests cannot run until it is resumed,
        so the loop waits for messages rather than stepping."""
        return bool(self.offload_tags)

    def memory_occupation(self) -> dict:
        """What is released now and what the memory saver holds (``/get_server_info``)."""
        arena = self.model_runner.weight_arena
        return {"memory_saver": arena is not None, "memory_released": sorted(self.offload_tags),
                "weights_mapped_bytes": arena.mapped_bytes() if arena is not None else None}

    def memory_usage(self) -> dict:
        """SGLang's ``memory_usage`` in ``/get_server_info``: the weights' and
        the KV cache's GiB on this rank (an elastic pool's: what is mapped
        now) and the KV slots."""
        runner, gib = self.model_runner, 2**30
        pool = runner.token_to_kv_pool
        kv = pool.arena.mapped_bytes() if self.allocator.elastic else pool.mem_bytes()
        return {"weight": round(runner.weight_bytes / gib, 3), "kvcache": round(kv / gib, 3),
                "token_capacity": int(self.allocator.size)}

    def _memory_tags(self, tags: list[str] | None) -> tuple[list[str], str | None]:
        """The tags asked for, in release order, or why they cannot be."""
        tags = list(tags or MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            return [], f"tags: unknown tag {unknown[0]!r} (known: {', '.join(MEMORY_TAGS)})"
        if self.disagg.mode != DisaggregationMode.NULL:  # a transfer may take KV, and a decode run, at any time
            return [], "memory cannot be released on a --disaggregation-mode server"
        if "kv_cache" in tags and not self.allocator.elastic:
            return [], "tags: kv_cache is releasable with --enable-memory-saver (or --enable-elastic-kv)"
        if "weights" in tags and self.model_runner.weight_arena is None:
            return [], "tags: weights are releasable with --enable-memory-saver"
        return [t for t in MEMORY_TAGS if t in tags], None

    def _holds_memory(self) -> bool:
        """A request holds KV, or a forward or a cache tier's copy is in flight."""
        return bool(self.live_reqs() or self._in_flight or self.tree_cache.busy())
