"""Incremental detokenization: streamed deltas concatenate to the whole text,
multi-byte UTF-8 is never split, stop strings are trimmed and never leak."""

from __future__ import annotations

import pytest

from radixserve.managers.detokenizer_manager import DecodeStatus
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
