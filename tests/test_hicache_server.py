"""The hierarchical cache behind the HTTP server (tiny-llama on the CPU, in
subprocesses): per-tier figures in /get_server_info and /metrics, and a
server restarted on the same file-tier directory that serves a known prefix
from it on its first request."""

from __future__ import annotations

import httpx
import pytest

from server_harness import ServerProcess, start_all, wait_for

PROMPT = [(7 * i + 3) % 300 for i in range(200)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def hicache_args(storage_dir) -> tuple[str, ...]:
    return ("--model-path", "tiny-llama", "--max-total-tokens", "1024", "--enable-hierarchical-cache",
            "--hicache-ratio", "2", "--hicache-storage-backend", "file", "--hicache-storage-dir", str(storage_dir))


def hicache_server(storage_dir, log_path=None) -> ServerProcess:
    return ServerProcess(*hicache_args(storage_dir), log_path=log_path)


@pytest.fixture(scope="module")
def first_servers(tmp_path_factory):
    """The first server of each test below, on a file-tier directory
    (``.storage``) of its own, started side by side; the second test's logs
    to ``.log``. Each test stops its own; whatever is left is stopped at the end."""
    dirs = [tmp_path_factory.mktemp("restart"), tmp_path_factory.mktemp("stopped")]
    log = dirs[1] / "first.log"
    servers = start_all(hicache_args(dirs[0] / "kv"), hicache_args(dirs[1] / "kv"), options=[{}, {"log_path": log}])
    for srv, folder in zip(servers, dirs):
        srv.storage = folder / "kv"
    servers[1].log_path = log
    try:
        yield dict(zip(["restart", "stopped"], servers))
    finally:
        for srv in servers:
            srv.stop()


def generate(server: ServerProcess) -> dict:
    r = httpx.post(server.url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_restart_on_the_same_directory_serves_the_prefix_from_files(first_servers):
    first = first_servers["restart"]
    try:
        before = generate(first)
        assert before["meta_info"]["cached_tokens"] == 0
        state = wait_for(lambda: (s := first.wait_idle())["hicache_storage_writes"] >= 3 and s, 60,
                         "the file tier's writes")  # 3 whole 64-token blocks of the prompt
        assert state["memory_check"] == "ok"
        assert state["hicache_host_size"] == 2048 and state["hicache_host_used"] > 0
        def metrics_with_the_writes():
            text = httpx.get(first.url + "/metrics", timeout=10).text
            return text if "radixserve:hicache_storage_written_blocks 3.0" in text else None

        # /metrics serves the figures the scheduler last pushed: the last write may land after it went idle
        metrics = wait_for(metrics_with_the_writes, 10, "the file tier's writes in /metrics")
        assert "radixserve:hicache_host_used_tokens" in metrics
    finally:
        assert first.stop() == 0
    second = hicache_server(first.storage)
    try:
        after = generate(second)
        assert after["meta_info"]["cached_tokens"] == 192  # every whole block but the one with the last token
        assert after["output_ids"] == before["output_ids"]
        state = second.wait_idle()
        assert state["memory_check"] == "ok"
        assert state["hicache_storage_prefetched"] == 192 and state["hicache_loaded_back"] == 192
    finally:
        assert second.stop() == 0


def test_a_server_stopped_at_once_lands_its_file_writes_first(first_servers):
    """Stopping the server asks its scheduler to close, and the file tier
    finishes the writes in flight first: a server stopped right after its
    first reply, without waiting for the writes, leaves every whole block on
    file for the next one."""
    first = first_servers["stopped"]
    try:
        before = generate(first)
    finally:
        assert first.stop() == 0
    assert "[scheduler] closed" in first.log_path.read_text()
    second = hicache_server(first.storage)
    try:
        after = generate(second)
        assert after["meta_info"]["cached_tokens"] == 192 and after["output_ids"] == before["output_ids"]
    finally:
        assert second.stop() == 0
