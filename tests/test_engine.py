"""The offline Engine end to end on tiny random models, against HF
transformers greedy decoding (CPU, float32): batches of mixed lengths, radix
cache hits, chunked prefill, page sizes, retraction, policies, abort, seeds,
logprobs. The memory invariant is checked after every scheduler step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import radixserve
from radixserve.managers import scheduler as scheduler_module
from radixserve.managers.schedule_policy import PrefillAdder

SHAPE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]),
}
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(folder with an HF checkpoint, the HF model) for each architecture."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return str(folder), hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return str(folder), hf


def engine(folder, overlap=False, **kw):
    """A CPU engine; ``overlap`` forces overlap scheduling (see the section at the end)."""
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("max_running_requests", 16)
    eng = radixserve.Engine(model_path=folder, check_invariants=True, disable_tqdm=True, device="cpu", **kw)
    eng.scheduler.overlap = overlap
    return eng


def prompts(lengths, seed=0, shared=()):
    gen = torch.Generator().manual_seed(seed)
    return [list(shared) + torch.randint(0, 320, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def check_against_hf(eng, hf, batch, params=GREEDY):
    outs = eng.generate(input_ids=batch, sampling_params=params)
    for ids, out in zip(batch, outs):
        assert out["output_ids"] == hf_greedy(hf, ids, params["max_new_tokens"])
    eng.scheduler.check_memory()
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_batch_matches_hf(tiny, page_size):
    folder, hf = tiny
    with engine(folder, page_size=page_size) as eng:
        check_against_hf(eng, hf, prompts([5, 37, 1, 80, 17]))


def test_radix_cache_hits_keep_outputs_exact(llama):
    folder, hf = llama
    shared = prompts([48], seed=1)[0]
    with engine(folder) as eng:
        first = check_against_hf(eng, hf, [shared + [7, 8]])
        again = check_against_hf(eng, hf, [shared + [7, 8]])
        assert first[0]["meta_info"]["cached_tokens"] == 0
        assert again[0]["meta_info"]["cached_tokens"] >= 48
        outs = check_against_hf(eng, hf, prompts([3, 9, 20], seed=2, shared=shared))
        assert all(o["meta_info"]["cached_tokens"] >= 48 for o in outs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_with_tiny_chunks(llama, page_size):
    folder, hf = llama
    with engine(folder, chunked_prefill_size=8, page_size=page_size) as eng:
        check_against_hf(eng, hf, prompts([40, 3, 29]))


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_under_a_tiny_pool_keeps_outputs(llama, overlap):
    folder, hf = llama
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with engine(folder, overlap, max_total_tokens=160, max_running_requests=8) as eng:
        check_against_hf(eng, hf, prompts([20, 25, 18, 30, 22, 16]), params)
        assert eng.scheduler.stats.retractions > 0


def test_a_retraction_leaves_room_for_twenty_steps_and_raises_the_token_ratio(llama, monkeypatch):
    """As SGLang: a decode that does not fit retracts until the requests left
    have room for RETRACT_DECODE_STEPS tokens each (one retraction where
    retracting to the next token would retract again a step later), and
    admission then reserves what they decoded plus those steps of their
    budgets."""
    from radixserve.managers.schedule_batch import RETRACT_DECODE_STEPS, ScheduleBatch

    folder, hf = llama
    after: list[tuple[int, int]] = []  # (requests left, slots short of their 20 steps) after each retraction
    plain = ScheduleBatch.retract_decode

    def checked(self, others_hold=False):
        retracted, cut = plain(self, others_hold)
        if retracted:
            pools = self.pools
            after.append((len(self.reqs), pools.decode_pages_needed(self.reqs, RETRACT_DECODE_STEPS)
                          - pools.allocator.available_size()))
        return retracted, cut

    monkeypatch.setattr(ScheduleBatch, "retract_decode", checked)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with engine(folder, max_total_tokens=160, max_running_requests=8) as eng:
        check_against_hf(eng, hf, prompts([20, 25, 18, 30, 22, 16]), params)
        assert eng.scheduler.stats.retractions > 0 and after
        assert all(short <= 0 or left == 1 for left, short in after), after
        assert eng.scheduler.new_token_ratio > 0.1  # set from the running requests at the last retraction


def record_admissions(monkeypatch) -> list[list[int]]:
    """Record the prompts PrefillAdder admits, in the order it admits them."""
    admitted: list[list[int]] = []

    class Recording(PrefillAdder):
        def add_one_req(self, req):
            result = super().add_one_req(req)
            if req in self.can_run:
                admitted.append(req.origin_input_ids)
            return result

    monkeypatch.setattr(scheduler_module, "PrefillAdder", Recording)
    return admitted


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_policies(llama, policy, monkeypatch):
    """Arrival order interleaves prompts without a cache hit and two cached
    prefixes; fcfs would admit them as they came."""
    folder, hf = llama
    shared_a, shared_b = prompts([40], seed=3)[0], prompts([40], seed=4)[0]
    on_a = prompts([4, 6, 5], seed=5, shared=shared_a)
    on_b = prompts([5, 7], seed=6, shared=shared_b)
    cold = prompts([9, 11], seed=9)
    batch = [cold[0], on_b[0], on_a[0], cold[1], on_a[1], on_b[1], on_a[2]]
    with engine(folder, schedule_policy=policy) as eng:
        check_against_hf(eng, hf, [shared_a + [1], shared_b + [2]])
        admitted = record_admissions(monkeypatch)
        outs = check_against_hf(eng, hf, batch)
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 5 * 40
    if policy == "lpm":  # longest cached prefix first, stable among equals
        assert admitted == [on_b[0], on_a[0], on_a[1], on_b[1], on_a[2], cold[0], cold[1]]
    else:  # no hit first; then A's subtree (3 waiting) before B's (2)
        assert admitted == [cold[0], cold[1], on_a[0], on_a[1], on_a[2], on_b[0], on_b[1]]


def test_in_batch_prefix_sharing_prefills_one_first(llama):
    folder, hf = llama
    shared = prompts([64], seed=7)[0]
    with engine(folder, schedule_policy="lpm") as eng:
        outs = check_against_hf(eng, hf, prompts([3, 4, 5, 6], seed=8, shared=shared))
        assert sum(o["meta_info"]["cached_tokens"] >= 64 for o in outs) >= 3


@pytest.mark.parametrize("overlap", [False, True])
def test_stream_and_abort_return_memory(llama, overlap):
    folder, hf = llama
    ids = prompts([10])[0]
    with engine(folder, overlap) as eng:
        chunks = list(eng.generate(input_ids=ids, sampling_params=GREEDY, stream=True))
        assert chunks[-1]["output_ids"] == hf_greedy(hf, ids, 12)
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
        it = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 100}, stream=True)
        next(it), next(it)
        it.close()  # the consumer goes away: the request is aborted
        assert eng.scheduler.is_idle()
        eng.scheduler.check_memory()
        eng.scheduler.tree_cache.evict(10**9)
        assert eng.scheduler.allocator.available_size() == eng.scheduler.allocator.size


def test_abort_waiting_and_running(llama):
    folder, _ = llama
    from radixserve.managers.schedule_batch import Req
    from radixserve.sampling.sampling_params import SamplingParams

    with engine(folder, max_running_requests=1) as eng:
        sched = eng.scheduler
        reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=50, ignore_eos=True).normalize(320))
                for i, p in enumerate(prompts([8, 9]))]
        for r in reqs:
            sched.add_request(r)
        sched.step()
        sched.step()
        assert sched.abort_request("r1") and reqs[1].finished_reason.type == "abort"  # waiting
        assert sched.abort_request("r0")  # running
        while not sched.is_idle():
            sched.step()
        assert reqs[0].finished_reason.type == "abort" and len(reqs[0].output_ids) < 50
        sched.check_memory()


class _StopCheckFails:
    """A tokenizer whose decode fails for one token, as a broken vocabulary might."""

    def encode(self, text, add_special_tokens=True):
        return [1]

    def decode(self, ids, **kwargs):
        if 7 in ids:
            raise KeyError("no text for token 7")
        return " ".join(map(str, ids))


def test_an_error_while_serving_one_request_aborts_only_that_one(llama):
    folder, _ = llama
    from radixserve.managers.schedule_batch import Req
    from radixserve.sampling.sampling_params import SamplingParams

    with engine(folder) as eng:
        sched = eng.scheduler
        sched.tokenizer = _StopCheckFails()
        bias = {"logit_bias": {7: 100.0}, "max_new_tokens": 6, "ignore_eos": True}
        doomed = Req("doomed", prompts([8])[0], SamplingParams(stop=["x"], **bias).normalize(320))
        fine = Req("fine", prompts([9])[0], SamplingParams(**bias).normalize(320))
        for r in (doomed, fine):
            sched.add_request(r)
        while not sched.is_idle():
            sched.step()
        assert doomed.finished_reason.type == "abort" and "no text for token 7" in doomed.finished_reason.message
        assert fine.finished_reason.type == "length" and fine.output_ids == [7] * 6
        sched.check_memory()


def test_seeds_reproduce_alone_and_in_batch(llama):
    folder, _ = llama
    params = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 1234}
    ids = prompts([12])[0]
    with engine(folder) as eng:
        alone = eng.generate(input_ids=ids, sampling_params=params)["output_ids"]
        other = {**params, "sampling_seed": 99}
        batch = eng.generate(input_ids=prompts([30, 12, 7], seed=9)[:1] + [ids] + prompts([7], seed=10),
                             sampling_params=[other, params, other])
        assert batch[1]["output_ids"] == alone
        assert eng.generate(input_ids=ids, sampling_params={**params, "sampling_seed": 5})["output_ids"] != alone


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_match_hf(llama, overlap):
    """Chunks of 8: with overlap, each chunk's logits score the next chunk's
    first token while that chunk is already queued."""
    folder, hf = llama
    ids = prompts([20])[0]
    with engine(folder, overlap, chunked_prefill_size=8) as eng:
        out = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 5}, return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=3)
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert inp[0] == (None, ids[0]) and len(inp) == len(ids)
    for q, (lp, tok) in enumerate(inp[1:], start=1):
        assert tok == ids[q] and lp == pytest.approx(float(ref[q - 1, tok]), abs=1e-4)
    for k, (lp, tok) in enumerate(meta["output_token_logprobs"]):
        assert lp == pytest.approx(float(ref[len(ids) - 1 + k, tok]), abs=1e-4)
        top = meta["output_top_logprobs"][k]
        assert [t for _, t in top] == ref[len(ids) - 1 + k].topk(3).indices.tolist()


@pytest.mark.parametrize("overlap", [False, True])
def test_token_ids_logprobs_match_hf(llama, overlap):
    """SGLang's ``token_ids_logprob``: the logprobs of the ids named, in their
    order, at every prompt position (the first None, as for the top
    logprobs; chunks of 8 score the next chunk's first token from their last
    logits) and at every output position, per prompt in a batch; one list
    for every prompt; ignored without ``return_logprob``, as in SGLang."""
    folder, hf = llama
    batch = prompts([20, 11, 9], seed=3)
    named = [[7, 300, batch[0][0], 7], [0, 319], []]
    params = {**GREEDY, "max_new_tokens": 5}
    with engine(folder, overlap, chunked_prefill_size=8) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=params, return_logprob=True, logprob_start_len=0,
                            token_ids_logprob=named)
        shared = eng.generate(input_ids=batch, sampling_params=params, return_logprob=True, token_ids_logprob=[1, 2])
        quiet = eng.generate(input_ids=batch[0], sampling_params=params, token_ids_logprob=[5])
    for ids, ask, out in zip(batch, named, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids + out["output_ids"]])).logits[0].float(), -1)
        meta = out["meta_info"]
        inp, outp = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
        assert inp[0] is None and len(inp) == len(ids) and len(outp) == len(out["output_ids"]) == 5
        for q, entry in enumerate(inp[1:], start=1):
            assert [t for _, t in entry] == ask
            assert [lp for lp, _ in entry] == pytest.approx([float(ref[q - 1, t]) for t in ask], abs=1e-4)
        for k, entry in enumerate(outp):
            assert [t for _, t in entry] == ask
            assert [lp for lp, _ in entry] == pytest.approx([float(ref[len(ids) - 1 + k, t]) for t in ask], abs=1e-4)
    for out, want in zip(shared, outs):  # no prompt positions scored (logprob_start_len -1)
        meta = out["meta_info"]
        assert meta["input_token_ids_logprobs"] == [] and out["output_ids"] == want["output_ids"]
        assert [[t for _, t in entry] for entry in meta["output_token_ids_logprobs"]] == [[1, 2]] * 5
    assert "input_token_ids_logprobs" not in quiet["meta_info"]


@pytest.mark.parametrize("start", [5, 8, 13])
def test_input_logprobs_from_a_start_follow_sglang(llama, start):
    """``logprob_start_len > 0``, in chunks of 8 (8 opens the second one) and
    behind a cached prefix: one entry per token from ``start`` on, the first
    None as SGLang has it (its frontend's ``select`` relies on that), the
    others as scored from position 0."""
    folder, _ = llama
    ids = prompts([20])[0]
    with engine(folder, chunked_prefill_size=8) as eng:
        whole, part = (eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                    logprob_start_len=s, top_logprobs_num=2)["meta_info"] for s in (0, start))
    inp = part["input_token_logprobs"]
    assert [t for _, t in inp] == ids[start:] and inp[0][0] is None and part["input_top_logprobs"][0] is None
    expected = [lp for lp, _ in whole["input_token_logprobs"][start + 1:]]
    assert [lp for lp, _ in inp[1:]] == pytest.approx(expected, abs=1e-4)
    assert len(part["input_top_logprobs"]) == len(inp) and all(part["input_top_logprobs"][1:])


def test_n_samples_and_limits(llama):
    folder, _ = llama
    with engine(folder) as eng:
        outs = eng.generate(input_ids=prompts([6])[0], sampling_params={"n": 3, "temperature": 1.0,
                            "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 1})
        assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) > 1
        out = eng.generate(input_ids=prompts([6])[0], sampling_params={"max_new_tokens": 0})
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.generate(input_ids=[1, 2, 5000])
        with pytest.raises(ValueError, match="context window is 512"):
            eng.generate(input_ids=[1] * 600)
        with pytest.raises(ValueError, match="temperature"):
            eng.generate(input_ids=[1, 2], sampling_params={"temperature": -1})
        with pytest.raises(ValueError, match="max_tokens: unknown field"):
            eng.generate(input_ids=[1, 2], sampling_params={"max_tokens": 3})
        eng.scheduler.check_memory()


# -- overlap scheduling -----------------------------------------------------------------
# On CUDA a decode is queued before the previous one's results are processed.
# The CPU has no asynchronous device, but the bookkeeping is the same: forcing
# `overlap` here runs it (one extra decode for requests that just finished,
# deferred release of their last slot, device-side input ids, filtered
# sampling state), with the invariant checked after every step. Retraction
# and abort run with overlap too (parametrized above).
def overlap_engine(folder, **kw):
    return engine(folder, overlap=True, **kw)


@pytest.mark.parametrize("page_size, max_running", [(1, 16), (4, 16), (1, 2), (4, 3)])
def test_overlap_greedy_matches_hf_with_staggered_finishes(llama, page_size, max_running):
    """Few running slots make prefills (queued while a decode runs) and
    decodes (queued while a prefill runs) interleave."""
    folder, hf = llama
    batch = prompts([5, 37, 1, 80, 17, 9])
    params = [{**GREEDY, "max_new_tokens": n} for n in (1, 3, 12, 7, 2, 12)]
    with overlap_engine(folder, page_size=page_size, max_running_requests=max_running) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=params)
        for ids, p, out in zip(batch, params, outs):
            assert out["output_ids"] == hf_greedy(hf, ids, p["max_new_tokens"])
        assert eng.scheduler.is_idle()
        eng.scheduler.tree_cache.evict(10**9)
        assert eng.scheduler.allocator.available_size() == eng.scheduler.allocator.size


@pytest.mark.parametrize("max_running", [16, 2])
def test_overlap_equals_sync_with_sampling_penalties_and_stops(llama, max_running):
    folder, _ = llama
    batch = prompts([12, 30, 7, 21], seed=11)
    params = [
        {"temperature": 0.8, "max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 7, "frequency_penalty": 0.5},
        {"temperature": 1.0, "max_new_tokens": 14, "ignore_eos": True, "sampling_seed": 8, "presence_penalty": 1.0},
        {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "repetition_penalty": 1.3},
        {"temperature": 0.7, "top_k": 5, "max_new_tokens": 11, "ignore_eos": True, "sampling_seed": 9},
    ]
    with engine(folder, max_running_requests=max_running) as eng:
        sync = eng.generate(input_ids=batch, sampling_params=params)
    # Stop on a token the second request emits mid-way: it then finishes early.
    params[1] = {**params[1], "stop_token_ids": [sync[1]["output_ids"][5]]}
    with engine(folder, max_running_requests=max_running) as eng:
        sync = eng.generate(input_ids=batch, sampling_params=params)
    with overlap_engine(folder, max_running_requests=max_running, chunked_prefill_size=16) as eng:
        over = eng.generate(input_ids=batch, sampling_params=params)
    assert [o["output_ids"] for o in over] == [s["output_ids"] for s in sync]
    assert [o["meta_info"]["finish_reason"] for o in over] == [s["meta_info"]["finish_reason"] for s in sync]



@torch.no_grad()
def hf_greedy_penalized(hf, ids, n, penalty):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      repetition_penalty=penalty)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("overlap, mixed", [(False, False), (True, False), (True, True)])
def test_repetition_penalty_matches_hf_as_requests_join(llama, overlap, mixed):
    """Greedy with HF's repetition penalty (over prompt and outputs), against
    HF's generate: requests join the running batch at different steps, in
    chunks, mixed or not, so the penalty's state is carried, extended and
    filtered on the device rather than rebuilt from the tokens."""
    folder, hf = llama
    batch = prompts([30, 9, 44, 17, 5, 26], seed=13)
    lens = (20, 32, 14, 24, 28, 18)
    params = [{**GREEDY, "max_new_tokens": n, "repetition_penalty": 3.0} for n in lens]
    with engine(folder, overlap, max_running_requests=3, chunked_prefill_size=16, enable_mixed_chunk=mixed) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=params)
    for ids, n, out in zip(batch, lens, outs):
        assert out["output_ids"] == hf_greedy_penalized(hf, ids, n, 3.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_decode_sampling_state_keeps_only_what_may_decode(llama, overlap):
    """Requests that end with their prefill (max_new_tokens 1) never decode:
    their rows do not pile up in the running batch's sampling state."""
    folder, _ = llama
    with engine(folder, overlap) as eng:
        for seed in range(6):
            eng.generate(input_ids=prompts([8, 9, 10], seed=seed), sampling_params={"max_new_tokens": 1})
        state = eng.scheduler.decode_sampling
        assert len(state.reqs) <= 3 and len(state._pending) <= 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_queues_the_next_chunk_behind_the_one_in_flight(llama, page_size):
    """Long prompts in chunks of 16, two of them identical (so one's chunks
    find the other's in the cache, or duplicate it): every next chunk is
    launched while the previous one is still in flight, and the outputs and
    the invariant are those of HF and of the sync loop."""
    folder, hf = llama
    batch = prompts([70, 45], seed=5)
    batch.append(list(batch[0]))
    params = {**GREEDY, "max_new_tokens": 6}
    with overlap_engine(folder, page_size=page_size, chunked_prefill_size=16) as eng:
        sched, launch = eng.scheduler, eng.scheduler.launch_batch
        behind = []

        def spy(batch):
            behind.extend(r.kv_inflight > 0 for r in batch.reqs if batch.forward_mode.is_extend())
            return launch(batch)

        sched.launch_batch = spy
        check_against_hf(eng, hf, batch, params)
        assert sum(behind) >= 4, "next chunks waited for the chunk in flight"
        eng.scheduler.tree_cache.evict(10**9)
        assert sched.allocator.available_size() == sched.allocator.size


# -- mixed prefill + decode batches (--enable-mixed-chunk) -------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_chunk_decodes_inside_prefills_with_the_same_tokens(llama, overlap):
    """With few running slots and small chunks, prefills keep arriving while
    others decode; the running requests then decode inside those prefills.
    Greedy tokens equal HF's, seeded sampling with penalties equals the unmixed
    run, and the memory invariant holds after every step. With overlap, riders
    join while their last token is still being sampled (no drain)."""
    folder, hf = llama
    batch = prompts([40, 9, 70, 23, 5, 55, 31, 12], seed=7)
    params = [{**GREEDY, "max_new_tokens": n} for n in (9, 14, 6, 12, 10, 7, 13, 8)]
    mixed_steps, undrained = [], []
    with engine(folder, overlap=overlap, enable_mixed_chunk=True, max_running_requests=3,
                chunked_prefill_size=16) as eng:
        launch = eng.scheduler.launch_batch

        def spy(b):
            mixed_steps.append(len(b.decoding_reqs))
            undrained.append(any(r.kv_inflight for r in b.decoding_reqs))
            return launch(b)

        eng.scheduler.launch_batch = spy
        outs = eng.generate(input_ids=batch, sampling_params=params)
        for ids, p, out in zip(batch, params, outs):
            assert out["output_ids"] == hf_greedy(hf, ids, p["max_new_tokens"])
        assert sum(1 for n in mixed_steps if n) >= 5, "running requests decoded inside prefills"
        assert any(undrained) == overlap
        sampled = [{**p, "temperature": 0.8, "sampling_seed": i, "repetition_penalty": 1.3,
                    "frequency_penalty": 0.5} for i, p in enumerate(params)]
        mixed = [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=sampled)]
        eng.scheduler.tree_cache.evict(10**9)
        assert eng.scheduler.allocator.available_size() == eng.scheduler.allocator.size
    with engine(folder, overlap=overlap, max_running_requests=3, chunked_prefill_size=16) as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=sampled)]
    assert mixed == plain


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_sized_by_the_queue_take_no_more_prompt_than_their_budget(llama, overlap, monkeypatch):
    """--mixed-chunk-min-size: each mixed step's prompt tokens stay within the
    budget that follows the queue (riders included), well under the chunk when
    little waits, and greedy tokens still equal HF's."""
    folder, hf = llama
    batch = prompts([40, 9, 70, 23, 5, 55, 31, 12], seed=7)
    params = [{**GREEDY, "max_new_tokens": n} for n in (9, 14, 6, 12, 10, 7, 13, 8)]
    budgets, steps = [], []
    sized = scheduler_module.mixed_step_budget

    def spy_budget(*args):
        budgets.append(sized(*args))
        return budgets[-1]

    monkeypatch.setattr(scheduler_module, "mixed_step_budget", spy_budget)
    with engine(folder, overlap=overlap, enable_mixed_chunk=True, max_running_requests=3,
                chunked_prefill_size=64, mixed_chunk_min_size=16) as eng:
        prefill = eng.scheduler.get_new_batch_prefill

        def spy_prefill():
            budgets.append(None)
            b = prefill()
            if b is not None and b.decoding_reqs:
                riders = len(b.decoding_reqs)
                steps.append((budgets[-1], riders, sum(r.extend_input_len for r in b.reqs[:len(b.reqs) - riders])))
            return b

        eng.scheduler.get_new_batch_prefill = spy_prefill
        outs = eng.generate(input_ids=batch, sampling_params=params)
    for ids, p, out in zip(batch, params, outs):
        assert out["output_ids"] == hf_greedy(hf, ids, p["max_new_tokens"])
    assert all(budget is not None and 16 <= budget <= 64 for budget, _, _ in steps)
    assert all(0 < tokens <= max(budget - riders, 1) for budget, riders, tokens in steps)
    assert sum(1 for budget, riders, tokens in steps if budget - riders < 20) >= 3, "small steps when little waits"
