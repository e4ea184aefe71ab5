"""Prefill and decode worker processes for tests/test_disagg_transfer.py.

Each worker owns a tiny KV pool (2 layers x 64 slots x 8 dims, fp32, pages
of 2 slots, on the CPU unless given a CUDA device) holding its TP rank's
share of the model's KV heads (2 unless told), aux rows with up to 4 top
logprobs, and a TorchDistKVManager, and obeys commands sent over a pipe:
make a sender or receiver for a room, init, send, poll until a state, abort,
return its pool. A prefill rank's pool is its heads of one seeded random
model-wide pool (:func:`model_kv`), a decode pool is zeros, so a transfer's
effect is visible, head by head.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import torch

LAYERS, SLOTS, HEADS, DIM, PAGE_SIZE, AUX_ROWS, TOP_LOGPROBS = 2, 64, 2, 8, 2, 16, 4
STARTUP_TIMEOUT_S = 60.0


def model_kv(seed: int, num_kv_heads: int = HEADS) -> list[torch.Tensor]:
    """The K buffers then the V buffers of a seeded pool with every KV head."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((SLOTS, num_kv_heads, DIM), generator=gen) for _ in range(2 * LAYERS)]


def make_kv_args(role: str, seed: int, device: str = "cpu", tp_rank: int = 0, tp_size: int = 1,
                 num_kv_heads: int = HEADS, dp_rank: int = 0, dp_size: int = 1):
    from radixserve.disaggregation import KVArgs, MetadataBuffers
    from radixserve.disaggregation.head_map import rank_kv_heads

    heads = rank_kv_heads(num_kv_heads, tp_size, tp_rank)
    if role == "prefill":
        bufs = [b[:, heads.start : heads.stop].contiguous().to(device) for b in model_kv(seed, num_kv_heads)]
    else:
        bufs = [torch.zeros((SLOTS, len(heads), DIM), device=device) for _ in range(2 * LAYERS)]
    meta = MetadataBuffers(AUX_ROWS, TOP_LOGPROBS)
    args = KVArgs(bufs[:LAYERS], bufs[LAYERS:], page_size=PAGE_SIZE, aux_buffers=meta.buffers, tp_rank=tp_rank,
                  tp_size=tp_size, num_kv_heads=num_kv_heads, dp_rank=dp_rank, dp_size=dp_size)
    return args, meta


class _Worker:
    def __init__(self, role: str, bootstrap_addr: str, config: dict, seed: int, device: str, tp: tuple, dp: tuple):
        from radixserve.disaggregation import KVTransferConfig
        from radixserve.disaggregation.torch_dist import TorchDistKVManager

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        self.role = role
        self.args, self.meta = make_kv_args(role, seed, device, *tp, *dp)
        self.mgr = TorchDistKVManager(self.args, role, KVTransferConfig(**config),
                                      bootstrap_addr=bootstrap_addr if role == "prefill" else None)
        self.halves = {}

    def sender(self, room, bootstrap_addr, num_pages, aux_index, token, logprob, top=()):
        from radixserve.disaggregation.torch_dist import TorchDistKVSender

        self.meta.set(aux_index, token, logprob, top)
        self.halves[room] = TorchDistKVSender(self.mgr, bootstrap_addr, room)
        self.halves[room].init(num_pages, aux_index)

    def receiver(self, room, bootstrap_addr):
        from radixserve.disaggregation.torch_dist import TorchDistKVReceiver

        self.halves[room] = TorchDistKVReceiver(self.mgr, bootstrap_addr, room)

    def init(self, room, pages, aux_index):
        self.halves[room].init(torch.tensor(pages), aux_index)

    def send(self, room, pages):
        self.halves[room].send(torch.tensor(pages))

    def wait(self, room, states, timeout):
        """Poll until the state is one of ``states`` (names) or ``timeout``
        passes; returns (state name, seconds waited, failure text or None)."""
        half, start = self.halves[room], time.monotonic()
        while (state := half.poll()).name not in states and time.monotonic() - start < timeout:
            time.sleep(0.001)
        failure = None
        if state.name == "Failed":
            try:
                half.failure_exception()
            except Exception as e:  # noqa: BLE001  reported to the test as text
                failure = f"{type(e).__name__}: {e}"
        return state.name, time.monotonic() - start, failure

    def poll(self, room):
        return self.halves[room].poll()

    def wait_given_up(self, room, timeout):
        """Wait (without polling the room's sender) until this prefill rank's
        control thread has taken the decode side's abort of ``room``; its reason."""
        deadline = time.monotonic() + timeout
        while (reason := self.mgr.control.given_up(room)) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        return reason

    def abort(self, room):
        self.halves[room].abort()

    def info(self, room):
        half = self.halves[room]
        return {"messages_sent": getattr(half, "messages_sent", None), "pair_ids": getattr(half, "pair_ids", None)}

    def kv(self):
        return [b.cpu() for b in self.args.kv_buffers], [b.clone() for b in self.meta.buffers]

    def aux(self, index):
        """Aux row ``index`` as ``MetadataBuffers.get`` reads it."""
        return self.meta.get(index)


def worker_main(conn, role: str, bootstrap_addr: str, config: dict, seed: int, device: str, tp: tuple,
                dp: tuple) -> None:
    """A worker process: build the manager, then answer commands until "exit"."""
    logging.basicConfig(level=logging.WARNING, format=f"{role}[%(process)d] %(name)s: %(message)s")
    worker = _Worker(role, bootstrap_addr, config, seed, device, tp, dp)
    conn.send(("ok", os.getpid()))
    while True:
        cmd, kwargs = conn.recv()
        if cmd == "exit":
            break
        try:
            conn.send(("ok", getattr(worker, cmd)(**kwargs)))
        except Exception:  # noqa: BLE001  the test sees the traceback
            conn.send(("error", traceback.format_exc()))
    worker.mgr.close()
    conn.send(("ok", None))
    os._exit(0)  # skip interpreter teardown: a gloo group whose peer is gone may abort there


class Worker:
    """The test's handle on one worker process; ``tp`` is its (TP rank, tp
    size, the model's KV heads), ``dp`` its (dp group, dp size)."""

    def __init__(self, ctx, role: str, bootstrap_addr: str, config: dict, seed: int = 0, device: str = "cpu",
                 tp: tuple[int, int, int] = (0, 1, HEADS), dp: tuple[int, int] = (0, 1)):
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, role, bootstrap_addr, config, seed, device, tp, dp),
                                daemon=True)
        self.proc.start()
        child.close()
        self.pid = self._reply(STARTUP_TIMEOUT_S)

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} worker did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role} worker failed:\n{value}")
        return value

    def call(self, cmd: str, reply_timeout: float = 60.0, **kwargs):
        self.conn.send((cmd, kwargs))
        return self._reply(reply_timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        """Ask the worker to close its manager and exit; kill it when it does not."""
        try:
            if self.proc.is_alive():
                self.signal(signal.SIGCONT)
                self.call("exit", reply_timeout=10)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        finally:
            self.proc.join(5)
            self.kill()
            self.conn.close()


def start_workers(ctx, *specs: dict) -> list[Worker]:
    """A worker for each of ``specs`` (``Worker``'s arguments after ``ctx``,
    by name), started side by side (a start-up is mostly importing, on one
    core); if one fails to start, the others are stopped before the error
    propagates."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(len(specs), 1)) as pool:
        futures = [pool.submit(Worker, ctx, **spec) for spec in specs]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in futures]
