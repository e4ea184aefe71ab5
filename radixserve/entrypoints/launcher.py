"""Start the engine's processes (scheduler, detokenizer) and connect a
TokenizerManager to them; stop them again."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import dataclass

from radixserve.managers.detokenizer_manager import run_detokenizer_process
from radixserve.managers.scheduler_process import run_scheduler_process
from radixserve.managers.tokenizer_manager import RequestLimits, TokenizerManager
from radixserve.server_args import ServerArgs

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
        """Stop every child (SIGTERM, then SIGKILL) and remove the IPC directory;
        returns within about ``STOP_TIMEOUT_S`` whatever state they are in."""
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
    info: dict = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    for proc, pipe in procs_pipes:
        while not pipe.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} exited during start-up (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} did not start within {START_TIMEOUT_S}s")
        msg = pipe.recv()
        if msg.get("status") != "ready":
            raise RuntimeError(f"{proc.name} failed to start: {msg.get('error')}")
        info.update({k: v for k, v in msg.items() if k != "status"})
    return info


def start_engine_processes(args: ServerArgs) -> EngineProcesses:
    """Resolve the model (converting a GGUF once, here), start the scheduler
    and detokenizer processes, wait until the model is loaded."""
    from radixserve.model_loader import resolve_model

    model_config = resolve_model(args.model_path, args.load_format, args.dtype, args.resolved_device(),
                                 args.tokenizer_path, args.model_overrides())
    tokenizer = None
    if model_config.tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer_dir)
    ipc_dir = tempfile.mkdtemp(prefix="radixserve-ipc-")
    addr = {name: f"ipc://{ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer")}
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    detok = ctx.Process(
        target=run_detokenizer_process, name="detokenizer", daemon=True,
        args=(model_config.tokenizer_dir, addr["detokenizer"], addr["tokenizer"], pipes[0][1], ipc_dir),
    )
    sched = ctx.Process(
        target=run_scheduler_process, name="scheduler", daemon=True,
        args=(args, addr["scheduler"], addr["detokenizer"], pipes[1][1], ipc_dir),
    )
    procs = [detok, sched]
    for p in procs:
        p.start()
    try:
        info = _wait_ready([(detok, pipes[0][0]), (sched, pipes[1][0])])
    except Exception:
        EngineProcesses(None, procs, ipc_dir, {}).shutdown()
        raise
    info.update(model_path=model_config.model_path, tokenizer_path=model_config.tokenizer_dir,
                weights_dir=model_config.weights_dir, dtype=str(model_config.dtype).replace("torch.", ""))
    tm = TokenizerManager(tokenizer, info, args.model_name(), addr["scheduler"], addr["tokenizer"],
                          request_limits(args, info), args.model_names(model_config.model_path))
    return EngineProcesses(tm, procs, ipc_dir, info)


def request_limits(args: ServerArgs, info: dict) -> RequestLimits:
    """The TokenizerManager's limits from the options and what the scheduler reported."""
    queued = args.max_queued_requests
    return RequestLimits(
        max_prompt_chars=args.resolved_max_prompt_chars(info["context_len"]),
        max_in_flight=None if queued is None else info["max_running_requests"] + queued,
        request_timeout=args.request_timeout,
    )
