"""Incremental detokenization: streamed deltas concatenate to the whole text,
multi-byte UTF-8 is never split, stop strings are trimmed and never leak."""

from __future__ import annotations

import pytest

from radixserve.sampling.stop_regex import UNBOUNDED, StopRegexTimeout, compile_all, first_match, max_match_chars
from radixserve.managers.detokenizer_manager import DecodeStatus, DetokenizerManager
from radixserve.managers.io_struct import BatchStrOut, BatchTokenIDOut, decode, encode

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "北京是中国的首都。上海是一个大城市。",
    "Emoji: 🚀🔥 and 👩‍👩‍👧 family, café naïve",
    "  leading spaces\n\nand newlines\t tabs",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from radixserve.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_concatenates_to_the_whole_text(tokenizer, text):
    ids = tokenizer.encode(text)
    st = DecodeStatus(tokenizer)
    pieces = [st.feed([t]) for t in ids[:-1]]
    pieces.append(st.feed(ids[-1:], {"type": "length", "length": len(ids)}))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces), "a multi-byte character was split"


def test_stop_string_is_trimmed_and_never_streamed(tokenizer):
    text = "The answer is 42. STOP here and more"
    ids = tokenizer.encode(text)
    st = DecodeStatus(tokenizer, stop=["STOP"])
    streamed = ""
    for i, t in enumerate(ids):
        so_far = tokenizer.decode(ids[: i + 1])
        if "STOP" in so_far:
            streamed += st.feed([t], {"type": "stop", "matched": "STOP"})
            break
        streamed += st.feed([t])
        assert "STO" not in streamed
    assert streamed == "The answer is 42. "


def test_stop_token_is_trimmed_unless_no_stop_trim(tokenizer):
    ids = tokenizer.encode("one two three")
    st = DecodeStatus(tokenizer)
    text = st.feed(ids[:-1]) + st.feed(ids[-1:], {"type": "stop", "matched": ids[-1]})
    assert text == tokenizer.decode(ids[:-1])
    st = DecodeStatus(tokenizer, no_stop_trim=True)
    text = st.feed(ids, {"type": "stop", "matched": ids[-1]}, no_stop_trim=True)
    assert text == tokenizer.decode(ids)


def test_messages_round_trip_through_msgpack():
    out = BatchTokenIDOut(["a", "b"], [[1, 2], []], [{"finish_reason": None}, {"finish_reason": {"type": "length"}}])
    assert decode(encode(out)) == out
    s = BatchStrOut(["a"], ["héllo 🚀"], [[1]], [{"x": [[0.5, 3]]}])
    assert decode(encode(s)) == s
    with pytest.raises(TypeError):
        encode(object())


class _Undecodable:
    """The real tokenizer, except that token 10**9 has no text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, **kwargs):
        if 10 ** 9 in ids:
            raise IndexError("token id 1000000000 is out of range")
        return self.tokenizer.decode(ids, **kwargs)


def test_a_request_that_cannot_be_decoded_ends_alone(tokenizer, tmp_path):
    manager = DetokenizerManager(_Undecodable(tokenizer), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    good = tokenizer.encode("Hello")
    running = {"finish_reason": None}
    out = manager.handle(BatchTokenIDOut(["bad", "good"], [[10 ** 9], good], [dict(running), dict(running)]))
    assert out.rids == ["bad", "good"] and out.deltas[1] == "Hello"
    reason = out.meta[0]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and out.meta[0]["abort_upstream"]
    # the scheduler's later outputs for it are dropped until its own finish arrives
    out = manager.handle(BatchTokenIDOut(["bad", "good"], [[1], []], [dict(running), {"finish_reason": {"type": "length"}}]))
    assert out.rids == ["good"]
    out = manager.handle(BatchTokenIDOut(["bad"], [[]], [{"finish_reason": {"type": "abort"}}]))
    assert out.rids == [] and not manager.failed and not manager.status


def test_stop_regex_match_is_trimmed_and_never_streamed(tokenizer):
    ids = tokenizer.encode("Call 555-1234 now, or later")
    st = DecodeStatus(tokenizer, stop_regex=[r"\d{3}-\d{4}"])
    assert st.hold == 7, "a match is at most 8 characters"
    streamed, reason = "", {"type": "stop", "matched": r"\d{3}-\d{4}"}
    for i, t in enumerate(ids):
        done = "555-1234" in tokenizer.decode(ids[: i + 1])
        streamed += st.feed([t], reason if done else None)
        assert "5" not in streamed
        if done:
            break
    assert streamed == "Call "
    kept = DecodeStatus(tokenizer, stop_regex=[r"\d{3}-\d{4}"], no_stop_trim=True)
    assert kept.feed(ids[:4], reason, no_stop_trim=True) == tokenizer.decode(ids[:4])


@pytest.mark.parametrize("pattern,bound", [("abc", 3), ("a|bcd", 3), ("(ab){2,3}", 6), (r"\d{3}-\d{4}", 8),
                                           ("(?<=ab)c", 3), (r"\bfoo\b", 3), ("x+", UNBOUNDED), (r"(a)\1", UNBOUNDED)])
def test_stop_regex_match_bound(pattern, bound):
    assert max_match_chars(pattern) == bound


def test_a_catastrophic_stop_regex_ends_its_request_not_the_loop():
    patterns = compile_all([r"(a|aa)+$"])
    with pytest.raises(StopRegexTimeout, match="stop_regex"):
        first_match(patterns, "a" * 40 + "b")


def test_decode_options_travel_once_and_stay_in_the_detokenizer(tokenizer, tmp_path):
    """The scheduler sends a request's decode options with its first output
    only; the detokenizer keeps them for the later ones (here a stop string
    and no_stop_trim) and passes none of them on to the tokenizer manager."""
    from radixserve.managers.schedule_batch import FinishReason, Req
    from radixserve.managers.scheduler_process import SchedulerProcess
    from radixserve.sampling.sampling_params import SamplingParams

    sent = []
    proc = SchedulerProcess.__new__(SchedulerProcess)  # only the output bookkeeping
    proc.sent, proc.send = {}, type("Sink", (), {"send": staticmethod(lambda data: sent.append(decode(data)))})()
    manager = DetokenizerManager(tokenizer, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    ids = tokenizer.encode("The answer is 42. STOP")
    trimmed, kept = Req("trimmed", [1], SamplingParams(stop=["STOP"])), Req("kept", [1], SamplingParams(
        stop=["STOP"], no_stop_trim=True))
    text, keys = {"trimmed": "", "kept": ""}, []
    for i, t in enumerate(ids):
        for req in (trimmed, kept):
            req.output_interval = 1
            req.output_ids.append(t)
            if i + 1 == len(ids):
                req.finished_reason = FinishReason.stopped("STOP")
        proc.send_outputs([trimmed, kept])
        keys.append([set(m) for m in sent[-1].meta])  # the detokenizer takes the options out of them
        out = manager.handle(sent[-1])
        for rid, delta, meta in zip(out.rids, out.deltas, out.meta):
            text[rid] += delta
            assert set(meta) == {"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    assert all("stop" in k and "no_stop_trim" in k for k in keys[0])
    assert all("stop" not in k and "no_stop_trim" not in k for step in keys[1:] for k in step)
    assert text == {"trimmed": "The answer is 42. ", "kept": tokenizer.decode(ids)}
    assert not manager.status
