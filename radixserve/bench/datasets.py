"""Workloads of the serving benchmark, generated offline or read from a local file.

Every workload is a list of ``Conversation``s. A plain request is a
conversation of one turn; in a multi-turn conversation each turn resends the
whole history (earlier user turns and the replies the server gave) followed
by the new user message, so turn k can reuse the KV cache of turn k-1.

Prompts are token ids where the length must be exact (``random``,
``generated-shared-prefix``, ``multi-turn``) and text where the workload is
text (a JSONL file). The client turns ids into text only when the backend
needs text (the OpenAI routes).

Each dataset also states its *ideal* prefix-cache hit rate: the share of prompt
tokens an infinite cache could serve, with requests taken in sending order
(the first prompt of each shared-prefix group pays for its prefix; turn k reuses
all of turns < k, replies included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class Turn:
    """One user message and how many tokens to ask for in reply."""

    prompt: str | list[int]
    prompt_len: int  # tokens in ``prompt`` (an estimate for text without a tokenizer)
    output_len: int


@dataclass
class Conversation:
    """Turns sent one after another; ``prefix_len`` tokens at the start of the
    first turn are shared with every conversation of the same ``prefix_group``."""

    turns: list[Turn]
    prefix_group: int | None = None
    prefix_len: int = 0


@dataclass
class Dataset:
    name: str
    conversations: list[Conversation]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def prompt_lens(self) -> list[list[int]]:
        """Tokens sent by each turn of each conversation: the history plus the new message."""
        out = []
        for conv in self.conversations:
            history, lens = 0, []
            for turn in conv.turns:
                lens.append(history + turn.prompt_len)
                history += turn.prompt_len + turn.output_len
            out.append(lens)
        return out

    def ideal_cached_tokens(self) -> int:
        seen_groups: set[int] = set()
        cached = 0
        for conv, lens in zip(self.conversations, self.prompt_lens()):
            if conv.prefix_group is not None:
                if conv.prefix_group in seen_groups:
                    cached += conv.prefix_len
                seen_groups.add(conv.prefix_group)
            for prev_len, prev_turn in zip(lens[:-1], conv.turns[:-1]):
                cached += prev_len + prev_turn.output_len
        return cached

    def summary(self) -> dict:
        lens = [n for conv in self.prompt_lens() for n in conv]
        outs = [t.output_len for c in self.conversations for t in c.turns]
        total = sum(lens)
        ideal = self.ideal_cached_tokens()
        return {"name": self.name, **self.params, "conversations": len(self.conversations),
                "requests": self.num_requests, "prompt_tokens": total, "output_tokens": sum(outs),
                "mean_prompt_len": total / max(len(lens), 1), "mean_output_len": sum(outs) / max(len(outs), 1),
                "ideal_cached_tokens": ideal, "ideal_cache_hit_rate": ideal / max(total, 1)}


class TokenSampler:
    """Draws random prompt token ids from a vocabulary, never a special id
    (a stray BOS or EOS inside a prompt would make it a different workload)."""

    def __init__(self, vocab_size: int, special_ids: Sequence[int] = (), seed: int = 0):
        self.allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
        if len(self.allowed) == 0:
            raise ValueError("no token id left to sample from")
        self.rng = np.random.default_rng(seed)

    def ids(self, n: int) -> list[int]:
        return self.rng.choice(self.allowed, size=n).tolist()

    def length(self, full: int, range_ratio: float) -> int:
        """A length in [max(1, full * range_ratio), full], uniform (SGLang's --random-range-ratio)."""
        if not 0 <= range_ratio <= 1:
            raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
        low = max(1, int(full * range_ratio))
        return int(self.rng.integers(low, max(full, low) + 1))


def random_dataset(sampler: TokenSampler, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0) -> Dataset:
    """``num_prompts`` single requests of random ids, lengths U[len * ratio, len]."""
    convs = []
    for _ in range(num_prompts):
        n, m = sampler.length(input_len, range_ratio), sampler.length(output_len, range_ratio)
        convs.append(Conversation([Turn(sampler.ids(n), n, m)]))
    return Dataset("random", convs, {"input_len": input_len, "output_len": output_len, "range_ratio": range_ratio})


def generated_shared_prefix_dataset(sampler: TokenSampler, num_groups: int, prompts_per_group: int,
                                    system_prompt_len: int, question_len: int, output_len: int,
                                    ordered: bool = False) -> Dataset:
    """SGLang's generated-shared-prefix (W4): each group's prompts start with
    the same random system prompt and end with their own random question.
    Shuffled across groups unless ``ordered`` (as SGLang does)."""
    convs = []
    for g in range(num_groups):
        system = sampler.ids(system_prompt_len)
        for _ in range(prompts_per_group):
            ids = system + sampler.ids(question_len)
            convs.append(Conversation([Turn(ids, len(ids), output_len)], prefix_group=g, prefix_len=system_prompt_len))
    if not ordered:
        convs = [convs[i] for i in sampler.rng.permutation(len(convs))]
    return Dataset("generated-shared-prefix", convs, {
        "num_groups": num_groups, "prompts_per_group": prompts_per_group, "system_prompt_len": system_prompt_len,
        "question_len": question_len, "output_len": output_len, "ordered": ordered})


def multi_turn_dataset(sampler: TokenSampler, num_conversations: int, num_turns: int, first_input_len: int,
                       turn_input_len: int, output_len: int) -> Dataset:
    """Conversations of ``num_turns`` turns: a first message of ``first_input_len``
    random ids, later messages of ``turn_input_len``; each turn resends the history."""
    convs = []
    for _ in range(num_conversations):
        turns = [Turn(sampler.ids(first_input_len), first_input_len, output_len)]
        turns += [Turn(sampler.ids(turn_input_len), turn_input_len, output_len) for _ in range(num_turns - 1)]
        convs.append(Conversation(turns))
    return Dataset("multi-turn", convs, {"num_turns": num_turns, "first_input_len": first_input_len,
                                         "turn_input_len": turn_input_len, "output_len": output_len})


def jsonl_dataset(path: str, num_prompts: int | None, tokenizer=None, output_len: int | None = None,
                  multi_turn: bool = False) -> Dataset:
    """Prompts from a JSONL file, one object a line, either
    ``{"prompt": str, "output_len": int}`` or ShareGPT's
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``.

    A ShareGPT record gives its first exchange (``multi_turn``: every human turn,
    sent as one conversation); the reply's token count is the output length unless
    ``output_len`` overrides it. Token counts need ``tokenizer``; without one a
    prompt is counted as len(text) / 4 and a ShareGPT record needs ``output_len``.
    """
    convs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_prompts is not None and len(convs) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = _jsonl_turns(record, tokenizer, output_len, multi_turn)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            if turns:
                convs.append(Conversation(turns))
    if not convs:
        raise ValueError(f"{path}: no usable prompt")
    return Dataset("jsonl", convs, {"path": path, "multi_turn": multi_turn})


def _count(text: str, tokenizer) -> int:
    if tokenizer is None:
        return max(1, len(text) // 4)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _jsonl_turns(record: dict, tokenizer, output_len: int | None, multi_turn: bool) -> list[Turn]:
    if "prompt" in record:
        n = record.get("output_len", output_len)
        if n is None:
            raise ValueError("output_len: missing (or pass a fixed output length)")
        return [Turn(record["prompt"], _count(record["prompt"], tokenizer), int(n))]
    msgs = record["conversations"]
    turns = []
    for ask, reply in zip(msgs[::2], msgs[1::2]):
        if ask.get("from") != "human" or reply.get("from") != "gpt":
            break  # ShareGPT records with system turns or odd order: keep what precedes them
        if output_len is None and tokenizer is None:
            raise ValueError("a ShareGPT reply length needs a tokenizer or a fixed output length")
        n = output_len if output_len is not None else max(1, _count(reply["value"], tokenizer))
        turns.append(Turn(ask["value"], _count(ask["value"], tokenizer), n))
        if not multi_turn:
            break
    return turns
