"""Tensor-parallel ranks as processes, for CPU tests (gloo).

``run_ranks`` spawns one process per rank (torch.multiprocessing, spawn),
each joining the group at a free port of its own, and returns what each
rank's function returned. A rank that raises fails the call with its
traceback, the others are stopped at once, and every process is gone when
it returns, whatever happened. ``forward_scenario`` is the workload the
model tests run at every tp size: a chunked prefill with input logprobs,
a prefill on top of a cached prefix, then decode steps.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.model_executor.model_runner import ModelRunner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank raised, died or ran past the deadline."""


def _rank_main(fn: Callable, rank: int, tp_size: int, init_method: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        result = fn(rank, tp_size, init_method, *args)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # done: skip the interpreter's teardown, where a gloo group a peer has left may abort


def run_ranks(fn: Callable, tp_size: int, *args: Any, ranks: list[int] | None = None, timeout_s: float = 50.0) -> list:
    """``fn(rank, tp_size, init_method, *args)`` in one process per rank of
    ``ranks`` (default: all); returns their results in rank order."""
    ranks = list(range(tp_size)) if ranks is None else ranks
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(fn, r, tp_size, init_method, out_dir, args), daemon=True)
                 for r in ranks]
        try:
            for p in procs:
                p.start()
            _wait(procs, ranks, out_dir, time.monotonic() + timeout_s)
            return [_result(out_dir, r) for r in ranks]
        finally:
            for p in procs:
                if p.pid is None:  # never started
                    continue
                if p.is_alive():
                    p.kill()
                p.join(5)


def _wait(procs: list, ranks: list[int], out_dir: str, deadline: float) -> None:
    while any(p.is_alive() for p in procs):
        for p, r in zip(procs, ranks):
            if p.exitcode not in (None, 0):
                raise RankFailed(f"rank {r} failed (exit code {p.exitcode}):\n{_error(out_dir, r)}")
        if time.monotonic() > deadline:
            raise RankFailed(f"ranks {[r for p, r in zip(procs, ranks) if p.is_alive()]} still running at the deadline")
        time.sleep(0.05)
    for p, r in zip(procs, ranks):
        if p.exitcode != 0:
            raise RankFailed(f"rank {r} failed (exit code {p.exitcode}):\n{_error(out_dir, r)}")


def _result(out_dir: str, rank: int) -> Any:
    """What the rank returned; None for one that exited cleanly without returning (os._exit)."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def _error(out_dir: str, rank: int) -> str:
    path = os.path.join(out_dir, f"rank{rank}.err")
    return open(path).read() if os.path.exists(path) else "(no traceback: the process died)"


# -- the workload -------------------------------------------------------------


@dataclass
class Request:
    """Test-side stand-in for the scheduler's bookkeeping of one request."""

    runner: ModelRunner
    ids: list[int]
    row: int = -1
    cached: int = 0  # tokens whose KV is in the pool

    def __post_init__(self):
        self.row = self.runner.req_to_token_pool.alloc(1)[0]

    def take_slots(self, n: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool_allocator.alloc(n)
        self.runner.req_to_token_pool.write(self.row, self.cached, slots)
        self.cached += n
        return slots


def extend(runner: ModelRunner, chunks: list[tuple[Request, int]], logprobs: bool = False):
    """One EXTEND forward of each request's next ``n`` tokens (input logprobs
    and the top 3 for the first request when ``logprobs``)."""
    prefix = [r.cached for r, _ in chunks]
    ids = torch.tensor([t for r, n in chunks for t in r.ids[r.cached : r.cached + n]])
    slots = torch.cat([r.take_slots(n) for r, n in chunks])
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=ids,
        req_pool_indices=torch.tensor([r.row for r, _ in chunks]), seq_lens=torch.tensor([r.cached for r, _ in chunks]),
        out_cache_loc=slots, seq_lens_cpu=[r.cached for r, _ in chunks], extend_prefix_lens=prefix,
        extend_seq_lens=[n for _, n in chunks], return_logprob=logprobs,
        extend_logprob_start_lens=[0] * len(chunks) if logprobs else None,
        top_logprobs_nums=[3] + [0] * (len(chunks) - 1) if logprobs else None,
    )
    return runner.forward(runner.forward_batch_from(batch))


def decode(runner: ModelRunner, requests: list[Request]):
    slots = torch.cat([r.take_slots(1) for r in requests])
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE, input_ids=torch.tensor([r.ids[-1] for r in requests]),
        req_pool_indices=torch.tensor([r.row for r in requests]), seq_lens=torch.tensor([r.cached for r in requests]),
        out_cache_loc=slots, seq_lens_cpu=[r.cached for r in requests],
    )
    return runner.forward(runner.forward_batch_from(batch))


def forward_scenario(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None, steps: int) -> dict:
    """Prefill ``prompts[0]`` in two chunks (the first with input logprobs,
    alongside ``prompts[1]``; the second alongside ``prompts[2]``), then
    ``steps`` decodes of all three. Decode inputs are the greedy tokens, or
    ``forced[step]`` (tp 1's greedy tokens, so a flipped token cannot change
    later inputs). Returns every step's logits and the tokens fed."""
    a, b, c = (Request(runner, list(p)) for p in prompts)
    cut = len(a.ids) // 2
    first = extend(runner, [(a, cut), (b, len(b.ids))], logprobs=True)
    second = extend(runner, [(a, len(a.ids) - cut), (c, len(c.ids))])
    logits = [first.next_token_logits.clone(), second.next_token_logits.clone()]
    last = torch.stack([logits[1][0], logits[0][1], logits[1][1]])  # the next-token logits of a, b, c
    fed = []
    for step in range(steps):
        tokens = forced[step] if forced is not None else last.argmax(-1).tolist()
        fed.append(tokens)
        for r, t in zip((a, b, c), tokens):
            r.ids.append(t)
        last = decode(runner, [a, b, c]).next_token_logits.clone()
        logits.append(last)
    return {
        "logits": logits, "fed": fed, "input_logprobs": first.input_token_logprobs.clone(),
        "top_val": first.input_top_logprobs_val, "top_idx": first.input_top_logprobs_idx,
    }


def model_rank(
    rank: int, tp_size: int, init_method: str, model_path: str, overrides: dict | None, prompts, forced, steps: int,
    attention_backend: str = "torch_native", pieces: tuple[int, ...] = (),
) -> dict:
    """One rank's :func:`forward_scenario` on ``model_path`` (fp32, CPU; config
    fields replaced by ``overrides``), and the size of its KV pool and weights.
    With ``pieces`` (token counts), extends go through the piecewise runner,
    its pieces run eagerly; ``piece_runs`` counts them."""
    from radixserve.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
    from radixserve.model_loader import resolve_model

    runner = ModelRunner(
        resolve_model(model_path, dtype="float32", overrides=overrides), max_total_tokens=512, max_running_requests=4,
        attention_backend=attention_backend, tp_rank=rank, tp_size=tp_size, dist_init_method=init_method,
        dist_timeout_s=30,
    )
    piece_runs = []
    if pieces:
        runner.piecewise_runner = PiecewiseCudaGraphRunner(runner, list(pieces), use_graphs=False)
        forward = runner.piecewise_runner.forward
        runner.piecewise_runner.forward = lambda fb: (piece_runs.append(fb.num_tokens), forward(fb))[1]
    try:
        out = forward_scenario(runner, prompts, forced, steps)
        out["piece_runs"] = len(piece_runs)
        out["kv_heads"] = runner.token_to_kv_pool.head_num
        out["max_total_tokens"] = runner.max_total_tokens
        out["weight_numel"] = sum(p.numel() for p in runner.model.parameters())
        out["prepacked"] = runner.model.model.layers[0].mlp.down_proj.weight.is_mkldnn
        runner.tp_group.barrier()  # no rank leaves the group while another still talks to it
        return out
    finally:
        runner.shutdown()


def join_rank(rank: int, tp_size: int, init_method: str, timeout_s: float) -> tuple[str, float]:
    """Build a tiny-llama ModelRunner as ``rank`` of ``tp_size``; returns the
    error it raised (expected: a peer never comes) and how long it took."""
    from radixserve.model_loader import resolve_model

    start = time.monotonic()
    try:
        ModelRunner(resolve_model("tiny-llama"), max_total_tokens=64, max_running_requests=1, tp_rank=rank,
                    tp_size=tp_size, dist_init_method=init_method, dist_timeout_s=timeout_s)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "joined", time.monotonic() - start


def group_rank(rank: int, tp_size: int, init_method: str) -> dict:
    """The TPGroup helpers the scheduler side uses, then rank 1 leaves without
    a word and rank 0's next all-reduce must fail, not hang."""
    from radixserve.distributed import init_tp_group

    group = init_tp_group(rank, tp_size, "cpu", init_method, timeout_s=20)
    out = {
        "bytes": group.broadcast_bytes(b"\x00msgpack\xff" if rank == 0 else None),
        "empty": group.broadcast_bytes(b"" if rank == 0 else None),
        "min": group.agree_min(100 - rank),
        "gather_last": group.all_gather(torch.full((2, 2), float(rank)), dim=-1),
        "gather_first": group.all_gather(torch.full((1, 3), float(rank)), dim=0),
        "sum": group.all_reduce(torch.ones(3)),
    }
    group.barrier()
    if rank != 0:
        os._exit(0)  # a rank that dies: no goodbye to the group
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(3))
        out["dead_peer"] = "no error"
    except RuntimeError as e:
        out["dead_peer"] = str(e)
    out["dead_peer_s"] = time.monotonic() - start
    group.destroy()  # a gloo group left with a broken peer aborts the process at exit
    return out
