"""Decode timings from whole generations, for backends that are not stepped
one decode at a time: HF transformers ``generate`` (the baseline of
``bench.one_batch``) and radixserve's ``Engine`` (``bench.one_batch
--engine``: the scheduler with overlap scheduling, as a server decodes). A
1-token run times the prefill; an ``output_len`` run minus it, over
``output_len - 1``, is the mean decode step."""

from __future__ import annotations

import time

import numpy as np
import torch

from radixserve.bench import sync
from radixserve.bench.rooflines import Timing

WARMUP_MAX_OUTPUT_LEN = 4  # the untimed run of a case decodes at most this many tokens
PREFILL_RUNS = 3  # generate_timing: the prefill is the fastest of this many 1-token runs


def timed(fn, device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def load_hf_model(model_config, device: torch.device | str):
    """HF's model of the same config: the same weights for real models; for
    dummy ones a random init made on ``device`` (speed does not depend on
    weight values, and an 8B init on the host takes minutes)."""
    from transformers import AutoModelForCausalLM

    if model_config.load_format != "dummy":
        model = AutoModelForCausalLM.from_pretrained(model_config.weights_dir, dtype=model_config.dtype)
        return model.to(device).eval()
    hf_config = model_config.hf_config.__class__.from_dict(model_config.hf_config.to_dict())
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=model_config.dtype)
    return model.eval()


@torch.inference_mode()
def run_hf_case(model, prompts: torch.Tensor, output_len: int, device: torch.device, repeats: int = 1) -> Timing:
    """Prefill-only (``output_len`` 1): one forward over the batch, the median
    of ``repeats``. Otherwise ``generate``: a 1-token generate for the prefill,
    a full one for the steps. Untimed calls of the same shapes go first."""
    ids = prompts.to(device)
    mask = torch.ones_like(ids)
    if output_len == 1:
        def prefill():
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        prefill()
        return Timing(float(np.median([timed(prefill, device) for _ in range(repeats)])))

    def generate(new_tokens: int) -> None:
        # eos_token_id=None: no stopping (ignore_eos), greedy.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"HF generate stopped after {out.shape[1] - ids.shape[1]} of {new_tokens} tokens")

    return generate_timing(generate, output_len, device)


def generate_timing(generate, output_len: int, device: torch.device) -> Timing:
    """Decode timing from whole generations: ``generate(n)`` makes ``n``
    tokens a prompt. Untimed runs of 1 and a few tokens first; the prefill is
    the fastest of three 1-token runs (cheap beside the whole run; one run
    slowed by a busy machine would make the difference below negative), the
    mean step (an ``output_len`` run minus it) / (``output_len`` - 1)."""
    generate(1)
    generate(min(output_len, WARMUP_MAX_OUTPUT_LEN))
    prefill_s = min(timed(lambda: generate(1), device) for _ in range(PREFILL_RUNS))
    total_s = timed(lambda: generate(output_len), device)
    return Timing(prefill_s, decode_mean_s=(total_s - prefill_s) / (output_len - 1))


def run_engine_case(engine, prompts: torch.Tensor, output_len: int) -> tuple[Timing, torch.Tensor]:
    """One case through the ``Engine`` (greedy, no EOS; its radix cache must
    be off, or the timed runs would reuse the untimed ones' prefills): the
    timing and the ``[bs, output_len]`` ids of the ``output_len`` run.
    Prefill-only cases (``output_len`` 1) time one 1-token run."""
    ids, outputs = prompts.tolist(), []

    def generate(new_tokens: int) -> None:
        outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0.0,
                                                               "ignore_eos": True})
        if any(len(o["output_ids"]) != new_tokens for o in outs):
            raise RuntimeError(f"the Engine stopped a request before {new_tokens} tokens")
        outputs[:] = [o["output_ids"] for o in outs]

    device = engine.scheduler.device
    if output_len == 1:
        generate(1)
        timing = Timing(timed(lambda: generate(1), device))
    else:
        timing = generate_timing(generate, output_len, device)
    return timing, torch.tensor(outputs)
