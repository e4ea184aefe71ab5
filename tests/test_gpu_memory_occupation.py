"""The memory saver on a CUDA device (GPU only): the weights in a CudaArena
give their memory back to the device at release and come back bit for bit
at resume at the same addresses, so a CUDA graph captured over them before
still replays, with the same outputs; through the Engine (CUDA graphs, the
elastic KV pool), greedy tokens and their logprobs are identical after a
round trip, and the device's free memory rises by the weights and the KV."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import radixserve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MB = 1 << 20


def device_free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what torch's own allocator keeps does not count
    return torch.cuda.mem_get_info()[0]


def test_a_captured_graph_replays_after_the_weights_come_back():
    from radixserve.model_executor.weight_arena import WeightArena

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 8192), nn.GELU(), nn.Linear(8192, 4096)).cuda().to(torch.bfloat16)
    model[2].weight = nn.Parameter(model[0].weight.data.T)  # a view of another weight: it stays one in the arena
    arena = WeightArena(model, torch.device("cuda"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    pointers = [p.data_ptr() for p in model.parameters()]
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
    graph.replay()
    expected = y.clone()
    before = device_free()
    assert arena.release() is None and arena.released and arena.mapped_bytes() == 0
    assert device_free() - before >= arena.nbytes - 2 * MB  # 64 MB of weights back to the device
    assert arena.resume() is None and not arena.released
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    y.zero_()
    graph.replay()
    assert torch.equal(y, expected)


DUMMY = dict(model_path="tiny-llama", load_format="dummy", dtype="bfloat16", disable_tqdm=True, check_invariants=True,
             max_total_tokens=1 << 16, max_running_requests=16,
             # 0.5 GB of bf16 weights; 4 KB of KV a token and layer
             json_model_override_args='{"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 4, '
                                      '"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}')
PROMPTS = [[(13 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 300, 1, 77, 1000, 33, 700, 9))]
PARAMS = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (24, 3, 17, 40, 32, 9, 24, 12)]


def _greedy(eng) -> list[tuple[list[int], list]]:
    """Tokens and their logprobs, from an empty cache."""
    outs = eng.generate(input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=True)
    assert eng.flush_cache()
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]


def test_engine_round_trip_on_the_gpu_gives_identical_tokens_and_logprobs(monkeypatch):
    from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner

    replays = {"n": 0}
    original = CudaGraphRunner.replay

    def counted(self, fb):
        replays["n"] += 1
        return original(self, fb)

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    with radixserve.Engine(**DUMMY, enable_memory_saver=True) as eng:
        runner = eng.scheduler.model_runner
        graphs = runner.cuda_graph_runner
        assert graphs is not None
        expected = _greedy(eng)
        assert _greedy(eng) == expected  # the same from an empty cache: the comparison below can hold
        eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)  # leave the prompts cached: KV to give back
        kv = eng.get_stats()["elastic_kv_mapped_bytes"]
        weights = runner.weight_arena.mapped_bytes()
        assert weights >= 400 * MB and kv >= 32 * MB
        before = device_free()
        state = eng.release_memory_occupation()
        assert state["memory_released"] == ["kv_cache", "weights"]
        assert device_free() - before >= weights + kv - 8 * MB
        eng.resume_memory_occupation()
        replays_before = replays["n"]
        assert _greedy(eng) == expected
        assert runner.cuda_graph_runner is graphs and replays["n"] > replays_before  # the graphs captured at start
