"""The hierarchical cache behind the HTTP server (tiny-llama on the CPU, in
subprocesses): per-tier figures in /get_server_info and /metrics, and a
server restarted on the same file-tier directory that serves a known prefix
from it on its first request."""

from __future__ import annotations

import httpx

from server_harness import ServerProcess, wait_for

PROMPT = [(7 * i + 3) % 300 for i in range(200)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def hicache_server(storage_dir, log_path=None) -> ServerProcess:
    return ServerProcess("--model-path", "tiny-llama", "--max-total-tokens", "1024", "--enable-hierarchical-cache",
                         "--hicache-ratio", "2", "--hicache-storage-backend", "file",
                         "--hicache-storage-dir", str(storage_dir), log_path=log_path)


def generate(server: ServerProcess) -> dict:
    r = httpx.post(server.url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_restart_on_the_same_directory_serves_the_prefix_from_files(tmp_path):
    first = hicache_server(tmp_path)
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
    second = hicache_server(tmp_path)
    try:
        after = generate(second)
        assert after["meta_info"]["cached_tokens"] == 192  # every whole block but the one with the last token
        assert after["output_ids"] == before["output_ids"]
        state = second.wait_idle()
        assert state["memory_check"] == "ok"
        assert state["hicache_storage_prefetched"] == 192 and state["hicache_loaded_back"] == 192
    finally:
        assert second.stop() == 0


def test_a_server_stopped_at_once_lands_its_file_writes_first(tmp_path):
    """Stopping the server asks its scheduler to close, and the file tier
    finishes the writes in flight first: a server stopped right after its
    first reply, without waiting for the writes, leaves every whole block on
    file for the next one."""
    log = tmp_path / "first.log"
    first = hicache_server(tmp_path / "kv", log_path=log)
    try:
        before = generate(first)
    finally:
        assert first.stop() == 0
    assert "[scheduler] closed" in log.read_text()
    second = hicache_server(tmp_path / "kv")
    try:
        after = generate(second)
        assert after["meta_info"]["cached_tokens"] == 192 and after["output_ids"] == before["output_ids"]
    finally:
        assert second.stop() == 0
