"""The sampler on CUDA against the same sampler on the CPU (GPU only).

Seeded noise is a counter-based hash of (seed, step, token), so the same
logits and settings must draw the same tokens on either device; penalties,
logit_bias, min_new_tokens, top-k / top-p / min-p and logprobs must agree to
float rounding. A mixed batch covers every path at once, over several steps
with ``cumulate_output_tokens`` and a ``filter`` in between.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.sampler import Sampler
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from test_sampling import req

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, STEPS = 1000, 6
SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.7, sampling_seed=1),
    dict(temperature=1.0, top_k=20, sampling_seed=2),
    dict(temperature=0.9, top_p=0.8, sampling_seed=3),
    dict(temperature=1.2, min_p=0.05, sampling_seed=4),
    dict(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.3, sampling_seed=5),
    dict(temperature=0.0, repetition_penalty=1.5, output_ids=[5, 6, 7]),
    dict(temperature=0.6, logit_bias={"17": 5.0}, sampling_seed=6),
    dict(temperature=1.0, min_new_tokens=4, stop_token_ids_all={3, 4}, sampling_seed=7),
    dict(temperature=0.5, top_k=50, top_p=0.9, min_p=0.01, sampling_seed=8, origin_input_ids=[1, 2, 3]),
]


def _run(device: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    reqs = [req(VOCAB, **dict(s)) for s in SETTINGS]
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, device)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs, rows = [[] for _ in reqs], [], list(range(len(reqs)))
    for step in range(STEPS):
        if step == STEPS // 2:  # two requests leave the batch
            keep = [i for i in range(len(rows)) if rows[i] not in (1, 6)]
            info.filter(keep)
            rows = [rows[i] for i in keep]
        logits = torch.randn(len(SETTINGS), VOCAB, generator=gen)[rows].to(device) * 3
        out = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[3] * len(rows))
        info.cumulate_output_tokens(out.next_token_ids)
        for row, tok in zip(rows, out.next_token_ids.tolist()):
            tokens[row].append(tok)
        logprobs.append(out.next_token_logprobs.cpu())
    return tokens, logprobs


def test_cuda_sampler_draws_what_the_cpu_sampler_draws():
    cpu_tokens, cpu_lp = _run("cpu")
    cuda_tokens, cuda_lp = _run("cuda")
    assert cuda_tokens == cpu_tokens
    for a, b in zip(cuda_lp, cpu_lp):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(set(map(tuple, cpu_tokens))) == len(SETTINGS)  # the rows did differ
