"""``bench.elastic_kv``, the elastic KV pool's cost benchmark, on the CPU:
the pages it maps, its figures, and a page the memory cannot hold."""

from __future__ import annotations

import json

import pytest


def test_the_cost_benchmark_maps_what_the_memory_holds(monkeypatch, capsys):
    """``bench.elastic_kv`` on the CPU: without ``--pages`` it maps as many
    pages as half the free memory holds (at most 64) and prints its four
    figures; pages the memory cannot hold fail with the free memory named."""
    from radixserve.bench import elastic_kv

    monkeypatch.setattr("sys.argv", ["elastic_kv", "--device", "cpu", "--layers", "2", "--page-mb", "2",
                                     "--rounds", "2"])
    monkeypatch.setattr(elastic_kv, "contention", lambda allocator: {"skipped": "timed elsewhere"})
    elastic_kv.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["bench"] for d in lines] == ["elastic_kv_map_rates", "elastic_kv_alloc", "elastic_kv_alloc",
                                           "elastic_kv_contention"]
    assert lines[0]["pages"] == elastic_kv.DEFAULT_PAGES and lines[0]["map_gb_per_s"] > 0

    class Full:  # an arena whose memory is gone
        bytes_per_page = 2**20
        stats = type("Stats", (), {"mapped": set()})()

        def map(self, page):
            return False

        def physical_free(self):
            return 0

    with pytest.raises(RuntimeError, match=r"page 1 could not be mapped: 0.0 GiB free, 1 MiB a page"):
        elastic_kv.map_rates(Full(), 4)
