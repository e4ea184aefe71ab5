"""Tests of SamplingParams, SamplingBatchInfo (penalties, filter/merge) and the Sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.layers.sampler import Sampler, mix64, seeded_uniform
from radixserve.sampling.penalties import RepetitionPenalizer
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling.sampling_params import SamplingParams

SAMPLER = Sampler()


@dataclass
class Req:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_token_ids_all: set[int] = field(default_factory=set)


def req(vocab: int, **kwargs) -> Req:
    extra = {k: kwargs.pop(k) for k in ("origin_input_ids", "output_ids", "stop_token_ids_all") if k in kwargs}
    params = SamplingParams(**kwargs)
    params.verify(vocab)
    return Req(params.normalize(vocab), **extra)


def info_for(reqs: list[Req], vocab: int) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")


def sample(logits: torch.Tensor, reqs: list[Req], **kwargs):
    """One sampler call on a copy of ``logits`` for ``reqs``."""
    vocab = logits.shape[-1]
    return SAMPLER(logits.clone(), info_for(reqs, vocab), **kwargs)


def reference_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, slack=0.0):
    """float64 reference of temperature, top-k, top-p, min-p applied in turn,
    each on the renormalized result of the previous. ``slack`` widens the
    top-p and min-p boundaries (for "never outside" checks)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = p.argsort(descending=True)
    ranked = p[order]
    if top_k > 0:
        ranked[top_k:] = 0
    ranked /= ranked.sum()
    mass_before = ranked.cumsum(0) - ranked
    ranked[mass_before >= top_p + slack] = 0
    ranked[ranked < min_p * ranked.max() - slack] = 0
    out = torch.zeros_like(p)
    out[order] = ranked / ranked.sum()
    return out


def chi2_limit(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.72: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_frequencies_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    n = tokens.numel()
    observed = torch.bincount(tokens, minlength=expected.numel()).double()
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was drawn"
    exp = expected * n
    cells = exp >= 5
    stat = float(((observed[cells] - exp[cells]) ** 2 / exp[cells]).sum())
    df = int(cells.sum()) - 1
    assert stat < chi2_limit(df), f"chi-square {stat:.1f} over {df} dof: {observed.tolist()} vs {exp.tolist()}"


# --- SamplingParams ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"n": 0}, "n"),
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": float("inf")}}, "logit_bias"),
        ({"stop_token_ids": [5, 100]}, "stop_token_ids"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"sampling_seed": 1.5}, "sampling_seed"),
        # strict types and bounds: what once crashed a server process
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"skip_special_tokens": [True]}, "skip_special_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"max_new_tokens": 1 << 64}, "max_new_tokens"),
        ({"max_new_tokens": 8.0}, "max_new_tokens"),
        ({"sampling_seed": 1 << 64}, "sampling_seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"3": 1e308}}, "logit_bias"),
        ({"n": 100000}, "n"),
        ({"stop": ["x"] * 1000}, "stop"),
        ({"stop": "y" * 5000}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ],
)
def test_verify_names_the_bad_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}(\[\d+\])?: .*\b{name}"):
        SamplingParams.from_dict(kwargs).verify(vocab_size=50)


def test_verify_accepts_defaults_and_edges():
    SamplingParams().verify(50)
    SamplingParams(temperature=0, top_p=1.0, top_k=50, min_p=1.0, frequency_penalty=-2,
                   presence_penalty=2, min_new_tokens=128, logit_bias={"49": -100.0},
                   stop="x", stop_token_ids=[0, 49], sampling_seed=-(1 << 63)).verify(50)
    assert SamplingParams.from_dict({"temperature": 1, "sampling_seed": (1 << 64) - 1}).temperature == 1.0


def test_from_dict_rejects_unknown_keys_by_name():
    assert SamplingParams.from_dict({"temperature": 0.5, "top_k": 3}).top_k == 3
    with pytest.raises(ValueError, match="^(max_tokens|topk): unknown field"):
        SamplingParams.from_dict({"temperature": 0.5, "topk": 3, "max_tokens": 9})
    with pytest.raises(ValueError, match="^sampling_params: must be an object"):
        SamplingParams.from_dict([1, 2])


def test_normalize():
    p = SamplingParams(temperature=0.0, stop="END", stop_token_ids=[3, 3, 1], logit_bias={"7": 1})
    p.normalize(vocab_size=10)
    assert (p.temperature, p.top_k) == (1.0, 1), "temperature 0 is greedy: top_k 1, temperature 1"
    assert p.stop == ["END"] and p.stop_token_ids == [3, 1] and p.logit_bias == {7: 1.0}
    assert SamplingParams(top_k=-1).normalize(10).top_k == 10
    assert SamplingParams(top_k=99).normalize(10).top_k == 10
    assert SamplingParams(stop=["a", "abcd"]).stop_str_max_len() == 4
    before = SamplingParams(temperature=0.7, stop=["a"]).normalize(10)
    assert SamplingParams(**vars(before)).normalize(10) == before, "normalize is idempotent"


# --- greedy and filters -------------------------------------------------------


def test_greedy_is_argmax_also_mixed_with_sampled_rows():
    torch.manual_seed(0)
    vocab, n = 40, 64
    logits = torch.randn(n, vocab) * 0.1  # nearly flat: sampled rows spread out
    kinds = [{"temperature": 0.0}, {"temperature": 1.0}, {"top_k": 1}, {"temperature": 1.0, "top_p": 0.9}]
    reqs = [req(vocab, **kinds[i % 4]) for i in range(n)]
    all_greedy = sample(logits[0::4], reqs[0::4])
    assert torch.equal(all_greedy.next_token_ids, logits[0::4].argmax(-1))
    ids = sample(logits, reqs).next_token_ids
    greedy = torch.tensor([i % 4 in (0, 2) for i in range(n)])
    assert torch.equal(ids[greedy], logits[greedy].argmax(-1))
    assert (ids[~greedy] != logits[~greedy].argmax(-1)).sum() > n // 4, "sampled rows must not be argmax"


@settings(max_examples=25, deadline=None)
@given(
    vocab=st.integers(2, 40),
    logits_seed=st.integers(0, 2**31),
    top_k=st.integers(1, 45),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.3, 2.0),
    seeded=st.booleans(),
)
def test_filters_never_emit_excluded_tokens(vocab, logits_seed, top_k, top_p, min_p, temperature, seeded):
    g = torch.Generator().manual_seed(logits_seed)
    logits = torch.randn(vocab, generator=g) * 3
    n = 300
    torch.manual_seed(logits_seed)
    reqs = [req(vocab, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                sampling_seed=i if seeded else None) for i in range(n)]
    ids = sample(logits.expand(n, vocab), reqs).next_token_ids
    allowed = reference_probs(logits, temperature, top_k, top_p, min_p, slack=1e-5) > 0
    assert bool(allowed[ids].all()), f"drew {sorted(set(ids.tolist()))}, allowed {allowed.nonzero().view(-1).tolist()}"


@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_match_filtered_distribution_in_a_mixed_batch(seeded):
    """Rows of four settings share one batch; each row's draws follow its own
    reference distribution (temperature, then each filter renormalized)."""
    torch.manual_seed(1)
    vocab, per_kind = 12, 6000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.6
    kinds = [dict(temperature=0.7), dict(temperature=1.3, top_k=6), dict(top_k=8, top_p=0.8),
             dict(temperature=0.9, top_p=0.9, min_p=0.3)]
    reqs = [req(vocab, sampling_seed=i if seeded else None, **kinds[i % 4]) for i in range(4 * per_kind)]
    ids = sample(logits.expand(len(reqs), vocab), reqs).next_token_ids
    for k, kind in enumerate(kinds):
        assert_frequencies_match(ids[k::4], reference_probs(logits, **kind))


# --- seeds -------------------------------------------------------------------


def test_mix64_matches_splitmix64_definition():
    """int64 torch arithmetic must wrap exactly like 64-bit unsigned math."""
    mask = (1 << 64) - 1

    def ref(z):
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    xs = [0, 1, 42, -1, -(1 << 63), (1 << 63) - 1, 0x123456789ABCDEF]
    got = mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & mask for g in got] == [ref(x) for x in xs]


def test_seeded_uniform_is_uniform_and_keyed_by_seed_and_step():
    u = seeded_uniform(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]), 20000)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = seeded_uniform(torch.tensor([8]), torch.tensor([0]), 20000)
    assert torch.equal(again[0], u[2])


def step_logits(vocab: int, salt: int, step: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * salt + step))


def run_steps(reqs: list[Req], salts: list[int], steps: int, vocab: int, incremental: bool) -> None:
    """Decode ``steps`` tokens into each req's output_ids. ``incremental``
    keeps one SamplingBatchInfo and cumulates; otherwise it is rebuilt each
    step and step positions are passed explicitly."""
    info = info_for(reqs, vocab)
    for _ in range(steps):
        logits = torch.stack([step_logits(vocab, s, len(r.output_ids)) for r, s in zip(reqs, salts)])
        if not incremental:
            info = info_for(reqs, vocab)
            positions = torch.tensor([len(r.output_ids) for r in reqs])
            ids = SAMPLER(logits, info, step_positions=positions).next_token_ids
        else:
            ids = SAMPLER(logits, info).next_token_ids
            info.cumulate_output_tokens(ids)
        for r, t in zip(reqs, ids.tolist()):
            r.output_ids.append(t)


@pytest.mark.parametrize("target", [dict(temperature=0.9), dict(top_p=0.95, repetition_penalty=1.2)])
def test_same_seed_same_tokens_alone_and_in_a_batch(target):
    vocab, steps = 300, 8
    alone = req(vocab, sampling_seed=42, **target)
    run_steps([alone], [0], steps, vocab, incremental=False)
    others = [req(vocab, top_k=5, output_ids=[1, 2, 3]), req(vocab, sampling_seed=42, output_ids=[9]),
              req(vocab, temperature=0.0), req(vocab, sampling_seed=7, min_p=0.1)]
    batched = req(vocab, sampling_seed=42, **target)
    batch = others[:2] + [batched] + others[2:]
    run_steps(batch, [1, 2, 0, 3, 4], steps, vocab, incremental=True)
    assert batched.output_ids == alone.output_ids
    other_seed = req(vocab, sampling_seed=43, **target)
    run_steps([other_seed], [0], steps, vocab, incremental=True)
    assert other_seed.output_ids != alone.output_ids


def test_seeded_stream_over_steps_follows_softmax():
    """One seed over many steps draws like softmax(logits / T)."""
    vocab, n, temp = 8, 12000, 0.7
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    info = info_for([req(vocab, sampling_seed=123, temperature=temp) for _ in range(n)], vocab)
    ids = SAMPLER(logits.expand(n, vocab).clone(), info, step_positions=torch.arange(n)).next_token_ids
    assert_frequencies_match(ids, torch.softmax(logits.double() / temp, -1))


# --- penalties ---------------------------------------------------------------


def test_penalties_match_hand_computed_logits():
    vocab = 6
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 1.0]] * 3)
    r0 = req(vocab, origin_input_ids=[1, 2], output_ids=[2, 3, 3], repetition_penalty=1.5,
             frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 2.0, "5": -1.0})
    r1 = req(vocab, origin_input_ids=[0, 1], output_ids=[0])  # no penalties
    r2 = req(vocab, origin_input_ids=[3], output_ids=[0, 0], frequency_penalty=-1.0)
    info = info_for([r0, r1, r2], vocab)
    info.apply_penalties(logits)
    expected = torch.tensor([
        # token 0 unseen; 1 prompt (<0: *1.5); 2 prompt+output once (>0: /1.5, -0.5, -0.25);
        # 3 output twice (/1.5, -2*0.5, -0.25); 4, 5 biased; output counts ignore the prompt.
        [2.0, -1.5, 0.5 / 1.5 - 0.75, 3.0 / 1.5 - 1.25, 1.5, 0.0],
        [2.0, -1.0, 0.5, 3.0, -0.5, 1.0],
        [2.0 + 2.0, -1.0, 0.5, 3.0, -0.5, 1.0],  # frequency -1 over two generated 0s
    ])
    torch.testing.assert_close(logits, expected)


def test_min_new_tokens_bans_stop_tokens_until_reached():
    vocab, eos = 6, 5
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, 0.0, 9.0]).expand(2, vocab)
    short = req(vocab, min_new_tokens=3, temperature=0.0, stop_token_ids=[2])
    short.stop_token_ids_all = {eos, 2, 77}  # an id beyond the vocab is ignored
    free = req(vocab, temperature=0.0, stop_token_ids_all={eos})
    info = info_for([short, free], vocab)
    emitted = []
    for _ in range(4):
        penalized = logits.clone()
        info.apply_penalties(penalized)
        ids = SAMPLER(logits.clone(), info).next_token_ids
        emitted.append(ids.tolist())
        info.cumulate_output_tokens(ids)
        if len(emitted) <= 3:
            assert penalized[0, eos] == -math.inf and penalized[0, 2] == -math.inf
    assert emitted == [[1, eos], [1, eos], [1, eos], [eos, eos]]


def test_logit_bias_steers_greedy_and_sampling():
    vocab = 10
    logits = torch.zeros(200, vocab)
    reqs = [req(vocab, temperature=0.0, logit_bias={"3": 5.0})] + [req(vocab, logit_bias={7: 50.0})] * 199
    ids = sample(logits, reqs).next_token_ids
    assert ids[0] == 3 and bool((ids[1:] == 7).all())


def penalty_reqs(vocab: int) -> list[Req]:
    return [
        req(vocab, origin_input_ids=[1, 2, 3], repetition_penalty=1.3, sampling_seed=1),
        req(vocab, origin_input_ids=[4], frequency_penalty=0.7, presence_penalty=-0.4, top_k=5),
        req(vocab, origin_input_ids=[5, 5], min_new_tokens=3, temperature=0.5),
        req(vocab, origin_input_ids=[6], logit_bias={2: 1.5}, top_p=0.7, sampling_seed=2),
        req(vocab, origin_input_ids=[7]),
    ]


def penalized(info: SamplingBatchInfo, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    info.apply_penalties(out)
    return out


def test_incremental_cumulate_equals_rebuild_from_lists():
    vocab = 12
    reqs = penalty_reqs(vocab)
    for r in reqs:
        r.stop_token_ids_all = {0, 1}
    run_steps(reqs, [0, 1, 2, 3, 4], 6, vocab, incremental=True)
    live = info_for([Req(r.sampling_params, r.origin_input_ids, [], r.stop_token_ids_all) for r in reqs], vocab)
    for step in range(6):  # replay the same tokens through cumulate
        live.cumulate_output_tokens(torch.tensor([r.output_ids[step] for r in reqs]))
    rebuilt = info_for(reqs, vocab)
    logits = torch.randn(len(reqs), vocab, generator=torch.Generator().manual_seed(9))
    assert torch.equal(live.output_lens, rebuilt.output_lens)
    torch.testing.assert_close(penalized(live, logits), penalized(rebuilt, logits))


def test_filter_and_merge_keep_per_request_state():
    vocab = 12
    reqs = penalty_reqs(vocab)
    for i, r in enumerate(reqs):
        r.output_ids = [(3 * i + j) % vocab for j in range(i + 1)]
        r.stop_token_ids_all = {0}
    a, b = info_for(reqs[:2], vocab), info_for(reqs[2:], vocab)
    a.merge(b)
    keep = [4, 0, 2, 3]
    a.filter(keep)
    expected = info_for([reqs[i] for i in keep], vocab)
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "output_lens", "sampling_seeds", "has_seed"):
        assert torch.equal(getattr(a, name), getattr(expected, name)), name
    flags = ("is_all_greedy", "need_top_k_sampling", "need_top_p_sampling", "need_min_p_sampling")
    assert [getattr(a, f) for f in flags] == [getattr(expected, f) for f in flags]
    logits = torch.randn(len(keep), vocab, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(penalized(a, logits), penalized(expected, logits))
    torch.manual_seed(0)
    got = SAMPLER(logits.clone(), a).next_token_ids
    torch.manual_seed(0)
    assert torch.equal(got, SAMPLER(logits.clone(), expected).next_token_ids)
    a.filter([0, 3])  # only requests without repetition penalty remain
    assert RepetitionPenalizer not in a.penalizers.penalizers and a.batch_size == 2


def test_penalty_tensors_are_allocated_only_when_used():
    vocab = 10
    info = info_for([req(vocab, temperature=0.5), req(vocab, top_k=3)], vocab)
    assert not info.penalizers.is_active and info.sampling_seeds is None


# --- logprobs ----------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_logprobs_its_topk():
    vocab = 20
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 2
    reqs = [req(vocab, temperature=0.5, repetition_penalty=2.0, origin_input_ids=[1, 2]),
            req(vocab, temperature=0.0, logit_bias={0: 10.0}),
            req(vocab, top_k=4, frequency_penalty=1.0, output_ids=[3, 3])]
    out = sample(logits, reqs, return_logprob=True, top_logprobs_nums=[0, 3, 5])
    raw = torch.log_softmax(logits, -1)
    assert out.next_token_ids[1] == 0, "penalties still steer the draw"
    torch.testing.assert_close(out.next_token_logprobs, raw.gather(1, out.next_token_ids.view(-1, 1)).view(-1))
    assert out.top_logprobs_val[0] == [] and out.top_logprobs_idx[0] == []
    for row, n in ((1, 3), (2, 5)):
        vals, idx = raw[row].topk(n)
        assert out.top_logprobs_idx[row] == idx.tolist()
        torch.testing.assert_close(torch.tensor(out.top_logprobs_val[row]), vals)
    assert sample(logits, reqs).next_token_logprobs is None
