"""Start the engine's processes (the scheduler ranks, the detokenizer) and
connect a TokenizerManager to them; stop them again.

This module loads neither torch nor the HTTP server, so that ``serve.py``
can start the scheduler ranks before the main process imports them (the
ranks' start-up then overlaps those imports). The children's entry points
import their managers in the child."""

from __future__ import annotations

import logging
import multiprocessing as mp
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.managers.tokenizer_manager import RequestLimits, TokenizerManager

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900
STOP_TIMEOUT_S = 10  # a child that has not exited this long after SIGTERM is killed


@dataclass
class EngineProcesses:
    tokenizer_manager: TokenizerManager
    processes: list[mp.Process]
    ipc_dir: str
    model_info: dict

    def dead(self) -> list[str]:
        return [p.name for p in self.processes if not p.is_alive()]

    def shutdown(self) -> None:
        """Stop every child and remove the IPC directory. While every child is
        alive, the schedulers are first asked to close (their cache tiers'
        writes land) and given ``STOP_TIMEOUT_S`` to exit; then what is left
        gets SIGTERM, and SIGKILL ``STOP_TIMEOUT_S`` later."""
        if self.tokenizer_manager is not None and not self.dead():
            self.tokenizer_manager.close_schedulers()
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.processes:
                if p.name.startswith("scheduler"):
                    p.join(timeout=max(deadline - time.monotonic(), 0))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.processes:
            p.join(timeout=max(deadline - time.monotonic(), 0))
            if p.is_alive():
                logger.error("%s did not stop within %ds; killing it", p.name, STOP_TIMEOUT_S)
                p.kill()
                p.join(timeout=5)
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _wait_ready(procs_pipes: list[tuple[mp.Process, object]]) -> dict:
    """Wait until every child reports ready; the first that fails or exits
    (a TP rank that cannot load its shard, say) fails the start-up at once,
    while the others may still be waiting for it."""
    info: dict = {}
    waiting = list(procs_pipes)
    deadline = time.monotonic() + START_TIMEOUT_S
    while waiting:
        for proc, pipe in list(waiting):
            if pipe.poll(0.05):
                msg = pipe.recv()
                if msg.get("status") != "ready":
                    raise RuntimeError(f"{proc.name} failed to start: {msg.get('error')}")
                stage = msg.pop("pp_stage", None)  # each pipeline stage's layers and pool
                if stage is not None:
                    info.setdefault("pp_stages", {})[stage["pp_rank"]] = stage
                info.update({k: v for k, v in msg.items() if k != "status"})
                waiting.remove((proc, pipe))
            elif not proc.is_alive():
                raise RuntimeError(exited_silently(proc))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(p.name for p, _ in waiting)} did not start within {START_TIMEOUT_S}s")
    if "pp_stages" in info:
        info["pp_stages"] = [info["pp_stages"][s] for s in sorted(info["pp_stages"])]
    return info


def start_failure(procs_pipes: list[tuple[mp.Process, object]]) -> str | None:
    """Why one of the children will never report ready, once its process
    has ended (the error it reported, if any), else None. Reads only the
    pipes of ended children: a live one's ``ready`` stays for ``_wait_ready``."""
    for proc, pipe in procs_pipes:
        if proc.exitcode is None:
            continue
        msg = pipe.recv() if pipe.poll() else {}
        return f"{proc.name} failed to start: {msg['error']}" if "error" in msg else exited_silently(proc)
    return None


def exited_silently(proc: mp.Process) -> str:
    """What a child that ended during start-up without reporting an error
    says: killed, or else most likely failed while Python's spawn start
    method bootstrapped it, before it ran any of radixserve."""
    if proc.exitcode is not None and proc.exitcode < 0:
        return f"{proc.name} was killed by signal {-proc.exitcode} during start-up"
    return (f"{proc.name} exited during start-up (exit code {proc.exitcode}) without reporting an error (its "
            "traceback, if any, is above). A spawned process first imports the main script again, so a script "
            "that creates an Engine with tp_size > 1, or starts a server, must do it under "
            "`if __name__ == \"__main__\":` (as SGLang's engine examples say too); without it, the new process "
            "tries to start the engine again while it is still starting, and Python stops it")


def free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dist_init_method(args: ServerArgs, dp_rank: int = 0) -> str | None:
    """Where replica ``dp_rank``'s ranks (TP ranks of every pipeline stage)
    meet: ``--dist-init-addr`` (its port plus ``dp_rank``), or a free local port."""
    if args.tp_size * args.pp_size == 1:
        return None
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        return f"tcp://{host}:{int(port) + dp_rank}"
    return f"tcp://127.0.0.1:{free_local_port()}"


def scheduler_addr(ipc_dir: str, dp_rank: int) -> str:
    """Where replica ``dp_rank``'s rank 0 receives requests."""
    return f"ipc://{ipc_dir}/scheduler-{dp_rank}"


def _run_scheduler(*args) -> None:
    """A spawned scheduler rank's entry point (``run_scheduler_process``)."""
    from radixserve.managers.scheduler_process import run_scheduler_process

    run_scheduler_process(*args)


def _run_detokenizer(*args) -> None:
    """The spawned detokenizer's entry point (``run_detokenizer_process``)."""
    from radixserve.managers.detokenizer_manager import run_detokenizer_process

    run_detokenizer_process(*args)


def scheduler_processes(ctx, args: ServerArgs, addr: dict, ipc_dir: str) -> list[tuple[mp.Process, object]]:
    """This node's scheduler processes (every replica's local ranks), each
    with the read end of its ready pipe; each replica's rank 0 gets the
    socket addresses."""
    out = []
    for dp_rank in range(args.dp_size):
        init = dist_init_method(args, dp_rank)
        for pp_rank, rank in args.local_ranks():
            first = pp_rank == rank == 0
            recv, send = (scheduler_addr(ipc_dir, dp_rank), addr["detokenizer"]) if first else (None, None)
            reader, writer = ctx.Pipe(duplex=False)
            name = "scheduler" + (f"-dp{dp_rank}" if args.dp_size > 1 else "") + (
                f"-pp{pp_rank}" if args.pp_size > 1 and pp_rank else "") + (f"-tp{rank}" if args.tp_size > 1 and rank else "")
            proc = ctx.Process(target=_run_scheduler, name=name, daemon=True,
                               args=(args, recv, send, writer, ipc_dir, rank, init, dp_rank, pp_rank))
            out.append((proc, reader))
    return out


@dataclass
class SchedulerRanks:
    """This node's scheduler processes (see :func:`scheduler_processes`), their
    IPC directory and socket addresses, and the spawn context they came from.
    :func:`start_engine_processes` adds the detokenizer to ``children``, so
    that :meth:`start` and :meth:`stop` take it too."""

    ctx: object
    ipc_dir: str
    addr: dict[str, str]
    children: list[tuple[mp.Process, object]]

    def started(self) -> list[mp.Process]:
        return [p for p, _ in self.children if p.pid is not None]

    def start(self) -> None:
        for p, _ in self.children:
            if p.pid is None:
                p.start()

    def stop(self) -> None:
        EngineProcesses(None, self.started(), self.ipc_dir, {}).shutdown()


def scheduler_ranks(args: ServerArgs) -> SchedulerRanks:
    """This node's scheduler ranks, not yet started, with a new IPC directory."""
    ipc_dir = tempfile.mkdtemp(prefix="radixserve-ipc-")
    addr = {name: f"ipc://{ipc_dir}/{name}" for name in ("detokenizer", "tokenizer")}
    ctx = mp.get_context("spawn")
    return SchedulerRanks(ctx, ipc_dir, addr, scheduler_processes(ctx, args, addr, ipc_dir))


def start_ranks_early(args: ServerArgs) -> SchedulerRanks | None:
    """The scheduler ranks, started now, so that their start-up (imports, the
    model, the weights) overlaps the main process's imports; None under
    disaggregation, where they register with a bootstrap server that is not
    up yet."""
    if args.disaggregation_mode != "null":
        return None
    ranks = scheduler_ranks(args)
    try:
        ranks.start()
    except BaseException:
        ranks.stop()
        raise
    return ranks


def start_engine_processes(args: ServerArgs, ranks: SchedulerRanks | None = None) -> EngineProcesses:
    """Start the scheduler ranks (or take ``ranks``, started by
    :func:`start_ranks_early`), resolve the model here meanwhile, start the
    detokenizer, wait until the model is loaded. Each rank's start-up
    (imports, its own ``resolve_model``, the weights) overlaps this process's
    ``resolve_model``, whose imports (transformers' configs) alone take
    seconds; a GGUF file that is not converted yet is converted by whichever
    of them comes first while the others wait (``load_gguf``'s lock). A node
    other than node 0 (``--node-rank``) runs only its scheduler ranks."""
    ranks = ranks or scheduler_ranks(args)
    ctx, ipc_dir, addr, children = ranks.ctx, ranks.ipc_dir, ranks.addr, ranks.children
    try:
        ranks.start()
        from radixserve.model_loader import resolve_model

        model_config = resolve_model(args.model_path, args.load_format, args.dtype, args.resolved_device(),
                                     args.tokenizer_path, args.model_overrides())
        if args.node_rank == 0:
            reader, writer = ctx.Pipe(duplex=False)
            detok = ctx.Process(
                target=_run_detokenizer, name="detokenizer", daemon=True,
                args=(model_config.tokenizer_dir, addr["detokenizer"], addr["tokenizer"], writer, ipc_dir),
            )
            children.insert(0, (detok, reader))
        ranks.start()  # the detokenizer
        info = _wait_ready(children)
    except BaseException:
        ranks.stop()
        raise
    procs = [p for p, _ in children]
    if args.node_rank > 0:
        return EngineProcesses(None, procs, ipc_dir, info)
    info["max_running_requests"] *= args.dp_size  # every replica reported its own
    info["dp_size"] = args.dp_size
    tokenizer = None
    if model_config.tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer_dir)
    info.update(model_path=model_config.model_path, tokenizer_path=model_config.tokenizer_dir,
                weights_dir=model_config.weights_dir, dtype=str(model_config.dtype).replace("torch.", ""))
    from radixserve.managers.tokenizer_manager import TokenizerManager

    sends = [scheduler_addr(ipc_dir, d) for d in range(args.dp_size)]
    tm = TokenizerManager(tokenizer, info, args.model_name(), sends, addr["tokenizer"],
                          request_limits(args, info), args.model_names(model_config.model_path),
                          load_balance_method=args.load_balance_method,
                          disaggregation_mode=args.disaggregation_mode,
                          default_bootstrap_port=args.disaggregation_bootstrap_port,
                          lora_adapters=lora.paths if (lora := args.lora_options()) is not None else None)
    return EngineProcesses(tm, procs, ipc_dir, info)


def request_limits(args: ServerArgs, info: dict) -> RequestLimits:
    """The TokenizerManager's limits from the options and what the scheduler reported."""
    from radixserve.managers.tokenizer_manager import RequestLimits

    queued = args.max_queued_requests
    return RequestLimits(
        max_prompt_chars=args.resolved_max_prompt_chars(info["context_len"]),
        max_in_flight=None if queued is None else info["max_running_requests"] + queued,
        request_timeout=args.request_timeout,
        grammar=args.grammar_compile_limits(),
    )


def raise_open_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
