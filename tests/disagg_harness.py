"""Prefill and decode worker processes for tests/test_disagg_transfer.py.

Each worker owns a tiny KV pool (2 layers x 64 slots x 2 heads x 8 dims,
fp32, pages of 2 slots, on the CPU unless given a CUDA device), aux rows with
up to 4 top logprobs, and a TorchDistKVManager, and obeys commands sent
over a pipe: make a sender or receiver for a room, init, send, poll until a
state, abort, return its pool. The prefill pool is filled with seeded random
values, the decode pool with zeros, so a transfer's effect is visible.
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


def make_kv_args(role: str, seed: int, device: str = "cpu"):
    from radixserve.disaggregation import KVArgs, MetadataBuffers

    gen = torch.Generator().manual_seed(seed)

    def buf():
        if role == "prefill":
            return torch.randn((SLOTS, HEADS, DIM), generator=gen).to(device)
        return torch.zeros((SLOTS, HEADS, DIM), device=device)

    meta = MetadataBuffers(AUX_ROWS, TOP_LOGPROBS)
    args = KVArgs([buf() for _ in range(LAYERS)], [buf() for _ in range(LAYERS)], page_size=PAGE_SIZE,
                  aux_buffers=meta.buffers)
    return args, meta


class _Worker:
    def __init__(self, role: str, bootstrap_addr: str, config: dict, seed: int, device: str):
        from radixserve.disaggregation import KVTransferConfig
        from radixserve.disaggregation.torch_dist import TorchDistKVManager

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        self.role = role
        self.args, self.meta = make_kv_args(role, seed, device)
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

    def abort(self, room):
        self.halves[room].abort()

    def info(self, room):
        half = self.halves[room]
        return {"messages_sent": getattr(half, "messages_sent", None), "pair_id": getattr(half, "pair_id", None)}

    def kv(self):
        return [b.cpu() for b in self.args.kv_buffers], [b.clone() for b in self.meta.buffers]

    def aux(self, index):
        """Aux row ``index`` as ``MetadataBuffers.get`` reads it."""
        return self.meta.get(index)


def worker_main(conn, role: str, bootstrap_addr: str, config: dict, seed: int, device: str) -> None:
    """A worker process: build the manager, then answer commands until "exit"."""
    logging.basicConfig(level=logging.WARNING, format=f"{role}[%(process)d] %(name)s: %(message)s")
    worker = _Worker(role, bootstrap_addr, config, seed, device)
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
    """The test's handle on one worker process."""

    def __init__(self, ctx, role: str, bootstrap_addr: str, config: dict, seed: int = 0, device: str = "cpu"):
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, role, bootstrap_addr, config, seed, device), daemon=True)
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
