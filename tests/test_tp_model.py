"""Tensor parallelism, the model side (CPU, gloo, fp32): ranks run as
processes (tests/tp_harness.py) and their logits are compared with tp 1's on
the same weights, through ModelRunner: a chunked prefill with input logprobs,
a prefill on a cached prefix, then decodes. Also: each rank's weight shards,
the start-up errors of configurations that cannot be split, a rank that never
joins, a rank that dies, and that tp 1 runs no collective at all."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from tp_harness import forward_scenario, group_rank, join_rank, model_rank, run_ranks
from transformers import AutoModelForCausalLM

from radixserve.distributed import HeadLayout, TPGroup, head_layout
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import default_model_path, dummy_config, fill_dummy_weights, resolve_model
from radixserve.models.registry import ModelRegistry

LOGIT_ATOL = 1e-4  # fp32 logits and logprobs; only the order of the reductions differs
CLEAR_MARGIN = 1e-3  # where tp 1's top two logits are further apart, the greedy token must be equal
STEPS = 4


@contextlib.contextmanager
def one_thread():
    """tp 1 on one thread, as each rank runs, so the GEMMs block alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def random_prompts(vocab: int, lengths=(13, 5, 9)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def compare_with_tp1(model_path: str, tp_size: int, prompts, overrides=None, steps=STEPS, backend="torch_native",
                     pieces: tuple[int, ...] = ()):
    """Run the scenario at tp 1 here (greedy) and at ``tp_size`` in processes
    (fed tp 1's tokens, ``backend`` attention, extends through ``pieces``);
    assert equal logits and tokens; return the figures."""
    with one_thread():
        ref = model_rank(0, 1, None, model_path, overrides, prompts, None, steps)
    ranks = run_ranks(model_rank, tp_size, model_path, overrides, prompts, ref["fed"], steps, backend, pieces)
    for out in ranks[1:]:  # every rank samples from the same bytes
        assert all(torch.equal(x, y) for x, y in zip(out["logits"], ranks[0]["logits"]))
    out, worst, flips, clear = ranks[0], 0.0, 0, 0
    for ref_logits, logits in zip(ref["logits"], out["logits"]):
        assert logits.shape == ref_logits.shape and logits.dtype == torch.float32
        diff = max((logits - ref_logits).abs().max().item(),
                   (logits.log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max().item())
        worst = max(worst, diff)
        top2 = ref_logits.topk(2, dim=-1).values
        sure = top2[:, 0] - top2[:, 1] > CLEAR_MARGIN
        same = logits.argmax(-1) == ref_logits.argmax(-1)
        assert same[sure].all(), "a greedy token differs from tp 1's where tp 1's choice was clear"
        flips, clear = flips + int((~same).sum()), clear + int(sure.sum())
    assert worst <= LOGIT_ATOL, f"logits differ from tp 1 by {worst:.2e}"
    torch.testing.assert_close(out["input_logprobs"], ref["input_logprobs"], atol=LOGIT_ATOL, rtol=0)
    assert out["top_idx"] == ref["top_idx"]
    return {"ref": ref, "ranks": ranks, "worst": worst, "flips": flips, "clear": clear}


# -- the same logits as tp 1 ---------------------------------------------------


@pytest.mark.parametrize(
    "name, tp_size, overrides",
    [
        ("tiny-llama", 2, None),  # 4 heads, 2 KV heads: one KV head per rank
        ("tiny-qwen3", 4, None),  # 2 KV heads over 4 ranks: replicated; q/k norms
        ("tiny-qwen2", 4, {"vocab_size": 510}),  # vocabulary padded to 512; tied embedding, qkv biases
    ],
)
def test_tiny_models_match_tp1(name, tp_size, overrides):
    config = resolve_model(name, overrides=overrides)
    result = compare_with_tp1(name, tp_size, random_prompts(config.vocab_size), overrides)
    layout = config.head_layout(tp_size)
    for out in result["ranks"]:  # the pool holds the rank's KV heads only, and as many slots as tp 1
        assert out["kv_heads"] == layout.num_kv_heads < config.num_key_value_heads
        assert out["max_total_tokens"] == result["ref"]["max_total_tokens"]
        assert out["weight_numel"] < 1.25 * result["ref"]["weight_numel"] / tp_size  # norms are replicated
        assert out["prepacked"] == torch.backends.mkldnn.is_available()  # oneDNN GEMMs on the shards


def test_triton_backend_under_tp(monkeypatch):
    """The Triton attention backend sizes itself from the rank's heads (Triton's interpreter on the CPU)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the ranks import triton
    compare_with_tp1("tiny-qwen3", 4, random_prompts(512), steps=2, backend="triton")


def test_piecewise_pieces_under_tp():
    """Extends through the piecewise runner's pieces (eager here; on CUDA each
    is a graph holding the layers' all-reduces) at tp 2, padded to 8, 16 or
    32 tokens, against plain tp 1: padding rows stay out of the real ones
    through the all-reduces and the vocabulary-parallel embedding."""
    result = compare_with_tp1("tiny-qwen2", 2, random_prompts(510), {"vocab_size": 510}, pieces=(8, 16, 32))
    assert all(out["piece_runs"] >= 2 for out in result["ranks"])


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1():
    """SmolLM2-135M (9 heads, 3 KV heads) from its converted GGUF, at tp 3:
    the safetensors path, sharded at load, on real text."""
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(path).tokenizer_dir)
    texts = ["The capital of France is", "Three primary colors are red,", "Write a haiku about the sea. The waves"]
    result = compare_with_tp1(path, 3, [tokenizer.encode(t) for t in texts], steps=6)
    assert tokenizer.decode([fed[0] for fed in result["ref"]["fed"]]).startswith(" Paris")
    assert result["flips"] == 0 and result["clear"] > 0
    print(f"SmolLM2 tp 3: logits within {result['worst']:.1e} of tp 1; "
          f"{result['flips']} greedy flips, {result['clear']} clear choices")


# -- each rank's shard of the weights -------------------------------------------


def sentinel_group(rank: int, size: int) -> TPGroup:
    """A group whose process groups are never used: building and loading a model communicate nothing."""
    return TPGroup(rank, size, device_group=object(), cpu_group=object())


def expected_shard(name: str, full: torch.Tensor, config, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of the tp-1 parameter ``full``, worked out independently of the layers."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if "qkv_proj" in name:
        q, k, v = full.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        first_kv, n_kv = rank * kv_heads // size, max(1, kv_heads // size)
        # the KV head(s) of this rank are the ones its query heads attend with
        q_heads = range(rank * heads // size, (rank + 1) * heads // size)
        assert {h // (heads // kv_heads) for h in q_heads} <= set(range(first_kv, first_kv + n_kv))
        kv = slice(first_kv * head_dim, (first_kv + n_kv) * head_dim)
        return torch.cat([q.chunk(size)[rank], k[kv], v[kv]])
    if "gate_up_proj" in name:
        return torch.cat([half.chunk(size)[rank] for half in full.chunk(2)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(size, dim=1)[rank]
    if "embed_tokens" in name or "lm_head" in name:
        rows = -(-full.shape[0] // size) * size
        padded = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        return padded.chunk(size)[rank]
    return full


@pytest.mark.parametrize("source", ["dummy", "checkpoint"])
@pytest.mark.parametrize("name, size, overrides", [("tiny-llama", 4, {}), ("tiny-qwen2", 4, {"vocab_size": 510}),
                                                   ("tiny-qwen3", 2, {"num_key_value_heads": 4})])
def test_each_rank_holds_its_shard(source, name, size, overrides):
    config = dummy_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    model_cls = ModelRegistry.resolve(config.architectures)
    hf_state = AutoModelForCausalLM.from_config(config).state_dict() if source == "checkpoint" else None

    def build(group):
        model = model_cls(config, tp_group=group)
        fill_dummy_weights(model) if hf_state is None else model.load_weights(hf_state.items())
        return dict(model.named_parameters())

    full = build(None)
    for rank in range(size):
        shards = build(sentinel_group(rank, size))
        assert shards.keys() == full.keys()
        for key, param in shards.items():
            assert torch.equal(param, expected_shard(key, full[key], config, rank, size)), (key, rank)


def test_ranks_converting_one_gguf_take_turns(tmp_path, monkeypatch):
    """Ranks that miss the GGUF cache together: one hashes the file and one
    converts it, the others wait and reuse its record and folder."""
    from test_model_loader import write_tiny_gguf

    from radixserve.model_loader import gguf_cache, gguf_loader

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    real_convert, real_lock, calls = gguf_loader.convert_gguf, gguf_cache._lock_if_possible, []
    real_key, hashed = gguf_cache.content_key, []
    all_missed = threading.Barrier(3, timeout=60)

    def counted_key(source):
        hashed.append(source)
        return real_key(source)

    def counted_convert(source, out_dir):
        calls.append(out_dir)
        real_convert(source, out_dir)

    def lock_once_all_missed(file):  # every rank has found no folder before any of them takes the lock
        all_missed.wait()
        real_lock(file)

    monkeypatch.setattr(gguf_loader, "convert_gguf", counted_convert)
    monkeypatch.setattr(gguf_cache, "content_key", counted_key)
    monkeypatch.setattr(gguf_cache, "_lock_if_possible", lock_once_all_missed)
    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: gguf_cache.load_gguf(str(path), str(tmp_path / "cache")), range(3)))
    assert len(set(folders)) == 1 and gguf_cache.is_converted(folders[0]) and len(calls) == 1 and len(hashed) == 1


def test_head_layout():
    assert [head_layout(32, 8, 4, r).kv_head_start for r in range(4)] == [0, 2, 4, 6]
    replicated = [head_layout(4, 2, 4, r) for r in range(4)]
    assert [(h.num_heads, h.num_kv_heads, h.kv_head_start, h.kv_replicas) for h in replicated] == [
        (1, 1, 0, 2), (1, 1, 0, 2), (1, 1, 1, 2), (1, 1, 1, 2)]
    assert head_layout(9, 3, 3, 2) == HeadLayout(num_heads=3, num_kv_heads=1, q_head_start=6, kv_head_start=2,
                                                 kv_replicas=1)


# -- start-up errors, missing and dying ranks --------------------------------------


@pytest.mark.parametrize(
    "overrides, tp_size, message",
    [
        ({}, 3, "num_attention_heads 4 is not divisible by tp_size 3"),
        ({"num_attention_heads": 6}, 3, "num_key_value_heads 2 and tp_size 3 do not divide one another"),
        ({"intermediate_size": 130}, 4, "intermediate_size 130 is not divisible by tp_size 4"),
    ],
)
def test_models_that_cannot_be_split_fail_at_start_up(overrides, tp_size, message, monkeypatch):
    from radixserve.model_executor import model_runner

    def join(*args, **kwargs):
        raise AssertionError("the rank went to meet the others before checking the split")

    monkeypatch.setattr(model_runner, "init_model_parallel", join)
    config = resolve_model("tiny-llama", overrides=overrides)
    with pytest.raises(ValueError, match=message):
        ModelRunner(config, max_total_tokens=64, max_running_requests=1, tp_rank=0, tp_size=tp_size,
                    dist_init_method="tcp://127.0.0.1:9")
    assert not dist.is_initialized()


def test_bad_rank_arguments_fail_at_start_up(monkeypatch):
    config = resolve_model("tiny-llama")
    kw = dict(max_total_tokens=64, max_running_requests=1)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        ModelRunner(config, tp_rank=2, tp_size=2, dist_init_method="tcp://127.0.0.1:9", **kw)
    with pytest.raises(ValueError, match="tp_size 2 needs an init method"):
        ModelRunner(config, tp_rank=0, tp_size=2, **kw)
    with pytest.raises(ValueError, match="contradict the given group"):
        ModelRunner(config, tp_rank=1, tp_size=2, tp_group=TPGroup(), **kw)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tp_size 2 needs 2 CUDA devices on this host \(one per rank\); 1 visible"):
        ModelRunner(config, device="cuda:0", tp_rank=0, tp_size=2, dist_init_method="tcp://127.0.0.1:9", **kw)
    with pytest.raises(ValueError, match="tp_size 4 needs 2 CUDA devices on this host"):
        ModelRunner(config, device="cuda:0", tp_rank=0, tp_size=4, nnodes=2, dist_init_method="tcp://127.0.0.1:9", **kw)
    assert not dist.is_initialized()


def test_a_rank_that_never_joins_fails_within_the_timeout():
    # rank 0 listens and its peer never comes; rank 1 alone finds nobody at the address (each at an
    # address of its own: the two cases run side by side, as they mostly wait)
    cases = ((0, 10), (1, 15))
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(lambda rank: run_ranks(join_rank, 2, 3.0, ranks=[rank]), [rank for rank, _ in cases]))
    for (lonely_rank, limit), [(error, seconds)] in zip(cases, runs):
        assert "could not join the group at tcp://127.0.0.1:" in error and "within 3 s" in error, (lonely_rank, error)
        assert seconds < limit, lonely_rank


def test_group_helpers_and_a_dying_rank():
    out, gone = run_ranks(group_rank, 2)
    assert gone is None  # rank 1 left with os._exit
    assert out["bytes"] == b"\x00msgpack\xff" and out["empty"] == b"" and out["min"] == 99
    assert torch.equal(out["gather_last"], torch.tensor([[0.0, 0, 1, 1]] * 2))
    assert torch.equal(out["gather_first"], torch.tensor([[0.0] * 3, [1.0] * 3]))
    assert torch.equal(out["sum"], torch.full((3,), 2.0))
    assert out["dead_peer"] != "no error" and out["dead_peer_s"] < 20


def test_tp1_runs_no_collective(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran at tp 1")

    for name in ("init_process_group", "new_group", "all_reduce", "broadcast", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, refuse)
    monkeypatch.setattr("radixserve.distributed.tp_group._all_gather_single", refuse)
    config = resolve_model("tiny-qwen2")
    runner = ModelRunner(config, max_total_tokens=256, max_running_requests=4)
    out = forward_scenario(runner, random_prompts(config.vocab_size), None, 2)
    assert len(out["logits"]) == 4 and not dist.is_initialized()
    assert runner.token_to_kv_pool.head_num == config.num_key_value_heads
