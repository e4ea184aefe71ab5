"""The TokenizerManager's control requests (SGLang's
``TokenizerCommunicatorMixin``): a request sent to every data-parallel
replica's scheduler, whose replies are gathered until each replica has
answered, for ``/flush_cache``, the profiler, the elastic KV limit, LoRA
adapters loaded and unloaded, memory released and resumed, and the internal
state. The manager's receive loop hands the replies over (``_control_key``)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq

from radixserve.lora.options import LORA_NOT_ENABLED
from radixserve.managers.io_struct import (
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    KVLimitReq,
    KVLimitReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ProfileReq,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UnloadLoRAAdapterReqInput,
    encode,
)

FLUSH_RETRY_S = 0.05  # how often a /flush_cache with a timeout asks again whether the server is idle


class TokenizerCommunicatorMixin:
    """Control requests to every replica. Uses the manager's ``sends`` (one
    socket per replica), ``control`` (reply key -> (future, replies so
    far)), ``states``, ``dp``, the LoRA registry and ``start`` /
    ``_check_alive``."""

    async def _control(self, request, reply_type: type, timeout: float | None = 30.0) -> list:
        """Send a control request to every replica and await their replies.
        One request of a reply type at a time, unless its replies carry the
        request's id (``req_id``): those may overlap."""
        self.start()
        key = _control_key(request, reply_type)
        self._control_lock = self._control_lock or asyncio.Lock()
        async with self._control_lock if key == reply_type else contextlib.nullcontext():
            self._check_alive()
            fut = asyncio.get_running_loop().create_future()
            self.control[key] = (fut, [])
            for sock in self.sends:
                sock.send(encode(request), zmq.NOBLOCK)
            try:
                return await asyncio.wait_for(fut, timeout)
            finally:
                self.control.pop(key, None)

    async def flush_cache(self, timeout_s: float = 0.0) -> tuple[bool, str]:
        """Empty every replica's cache: ``(ok, message)``. As SGLang's
        ``/flush_cache``, refused while requests run or wait (every replica
        must be idle), unless they end within ``timeout_s`` (``?timeout=``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.states:
                replies: list[FlushCacheReqOutput] = await self._control(FlushCacheReq(), FlushCacheReqOutput)
                if all(r.success for r in replies):
                    self.dp.cache_flushed()
                    return True, ""
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(FLUSH_RETRY_S)
        waited = f"within {timeout_s:g} s" if timeout_s else "(pass ?timeout=SECONDS to wait for them)"
        return False, (f"the cache was not flushed: {len(self.states)} requests are running or queued, or the "
                       f"schedulers are finishing some; the server did not go idle {waited}")

    async def profile(self, action: str, options: dict) -> tuple[bool, str]:
        """Start or stop the profiler on every replica: ``(ok, message)``,
        the first failing replica's message if one failed."""
        self._profile_ids += 1
        request = ProfileReq(self._profile_ids, action, options)
        # a start with num_steps is answered when its profile ends: no time limit
        replies: list[ProfileReqOutput] = await self._control(request, ProfileReqOutput, timeout=None)
        failed = [r for r in replies if not r.success]
        return not failed, (failed or replies)[0].message

    async def kv_limit(self, apply: bool, limit_bytes: int | None) -> tuple[bool, str, list[dict]]:
        """Read or set each replica's elastic KV limit: ``(ok, message,
        per-replica figures in dp-rank order)``."""
        return _per_replica(await self._control(KVLimitReq(apply, limit_bytes), KVLimitReqOutput))

    async def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """Read a LoRA adapter on every replica's ranks (``/load_lora_adapter``):
        ``(ok, message naming the field)``; once it is loaded requests may name it.
        No time limit: reading the weights takes what it takes."""
        if not self.lora_enabled:
            return False, LORA_NOT_ENABLED
        replies = await self._control(LoadLoRAAdapterReqInput(name, path), LoRAUpdateOutput, timeout=None)
        failed = [r for r in replies if not r.success]
        if not failed:
            self.lora_adapters[name] = path
        return not failed, failed[0].error_message if failed else ""

    async def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """Unload a LoRA adapter on every replica (``/unload_lora_adapter``):
        requests naming it are refused from now on, those sent before finish
        first (the schedulers free it after them)."""
        if not self.lora_enabled:
            return False, LORA_NOT_ENABLED
        if self.lora_adapters.pop(name, None) is None:
            known = ", ".join(sorted(self.lora_adapters)) or "none"
            return False, f"lora_name: no LoRA adapter {name!r} is loaded (loaded: {known})"
        replies = await self._control(UnloadLoRAAdapterReqInput(name), LoRAUpdateOutput)
        failed = [r for r in replies if not r.success]
        return not failed, failed[0].error_message if failed else ""

    async def memory_occupation(self, release: bool, tags: list[str] | None) -> tuple[bool, str, list[dict]]:
        """Release or resume the memory of ``tags`` on every replica:
        ``(ok, message, per-replica state in dp-rank order)``. No time limit:
        copying weights to or from the host takes what it takes."""
        if release:
            request, reply = ReleaseMemoryOccupationReqInput(tags), ReleaseMemoryOccupationReqOutput
        else:
            request, reply = ResumeMemoryOccupationReqInput(tags), ResumeMemoryOccupationReqOutput
        ok, message, states = _per_replica(await self._control(request, reply, timeout=None))
        if release and any("kv_cache" in s.get("memory_released", ()) for s in states):
            self.dp.cache_flushed()  # the replicas' caches were flushed
        return ok, message, states

    async def get_internal_states(self) -> list[dict]:
        """Each replica's internal state, in dp-rank order."""
        replies: list[GetInternalStateReqOutput] = await self._control(GetInternalStateReq(), GetInternalStateReqOutput)
        return sorted((r.state for r in replies), key=lambda state: state.get("dp_rank", 0))


def _per_replica(replies: list) -> tuple[bool, str, list[dict]]:
    """Replies with ``success``, ``message`` and ``state`` from every replica:
    ``(all ok, the first failure's message, the states in dp-rank order)``."""
    failed = [r for r in replies if not r.success]
    states = sorted((r.state for r in replies), key=lambda state: state.get("dp_rank", 0))
    return not failed, (failed[0].message if failed else ""), states


def _control_key(msg, reply_type: type | None = None):
    """What a control reply is matched by: its type, and its request's id if it has one."""
    reply_type = reply_type or type(msg)
    return (reply_type, msg.req_id) if hasattr(msg, "req_id") else reply_type
