"""What the scheduler process sends on to the detokenizer (model-free): a
streamed request's first token at once, then one batch every
``stream_interval`` tokens and its end; a request not streamed, batches of
``UNSTREAMED_OUTPUT_INTERVAL``."""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import decode
from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.managers.scheduler_process import UNSTREAMED_OUTPUT_INTERVAL, SchedulerProcess
from radixserve.managers.tokenizer_manager import RequestFailedError, raise_for_abort
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


class _Sink:
    def __init__(self):
        self.messages = []

    def send(self, data: bytes) -> None:
        self.messages.append(decode(data))


def _process() -> SchedulerProcess:
    proc = SchedulerProcess.__new__(SchedulerProcess)  # only the output bookkeeping: no scheduler, no sockets
    proc.sent, proc.send = {}, _Sink()
    return proc


def _run(interval: int, n_tokens: int, finish_at: int | None = None) -> list[list[int]]:
    """Steps of one token each; the new ids of every message sent for the request."""
    proc = _process()
    req = Req("r", [1, 2, 3], SamplingParams())
    req.output_interval = interval
    for i in range(n_tokens):
        req.output_ids.append(100 + i)
        if i + 1 == (finish_at or n_tokens):
            req.finished_reason = FinishReason.at_length(i + 1)
        proc.send_outputs([req])
        if req.finished():
            break
    sent = [ids for msg in proc.send.messages for rid, ids in zip(msg.rids, msg.new_ids) if rid == "r"]
    assert [t for ids in sent for t in ids] == req.output_ids  # every token, once, in order
    assert "r" not in proc.sent  # nothing kept for a finished request
    return sent


def test_streamed_tokens_go_at_once_then_every_interval_and_at_the_end():
    assert [len(ids) for ids in _run(1, 5)] == [1, 1, 1, 1, 1]
    assert [len(ids) for ids in _run(4, 11)] == [1, 4, 4, 2]  # the first at once (TTFT), the end flushes
    assert [len(ids) for ids in _run(4, 9, finish_at=3)] == [1, 2]  # an early stop flushes what is pending


def test_unstreamed_tokens_go_in_batches():
    n = 2 * UNSTREAMED_OUTPUT_INTERVAL + 7
    assert [len(ids) for ids in _run(UNSTREAMED_OUTPUT_INTERVAL, n)] == [1, UNSTREAMED_OUTPUT_INTERVAL,
                                                                         UNSTREAMED_OUTPUT_INTERVAL, 6]


def test_a_step_with_nothing_due_sends_no_message():
    proc = _process()
    reqs = [Req(f"r{i}", [1], SamplingParams()) for i in range(3)]
    for req in reqs:
        req.output_interval = 8
        req.output_ids.append(7)
    proc.send_outputs(reqs)
    for req in reqs:
        req.output_ids.append(8)
    proc.send_outputs(reqs)
    assert len(proc.send.messages) == 1 and proc.send.messages[0].rids == ["r0", "r1", "r2"]
    reqs[1].finished_reason = FinishReason.aborted("stop")
    proc.send_outputs(reqs)
    assert proc.send.messages[-1].rids == ["r1"] and proc.send.messages[-1].new_ids == [[8]]


def test_stream_interval_flag_is_checked():
    assert ServerArgs.from_kwargs(model_path="tiny-llama", stream_interval=4).stream_interval == 4
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        ServerArgs.from_kwargs(model_path="tiny-llama", stream_interval=0)


def test_an_abort_carries_the_status_a_server_answers_it_with():
    """SGLang's FINISH_ABORT status_code: 400 for a request at fault (a
    ValueError naming the field), 5xx for a server's failure; none for an
    abort asked for, which is a finished request."""
    refused, failed = FinishReason.refused("sampling_params.stop_regex: slow"), FinishReason.failed("KV lost")
    assert refused.to_json() == {"type": "abort", "message": "sampling_params.stop_regex: slow", "status_code": 400}
    assert failed.to_json()["status_code"] == 500
    assert "status_code" not in FinishReason.aborted("aborted by request").to_json()
    with pytest.raises(ValueError, match=r"^sampling_params\.stop_regex: slow$"):
        raise_for_abort(refused.to_json())
    with pytest.raises(RequestFailedError, match="KV lost") as err:
        raise_for_abort(failed.to_json())
    assert err.value.status_code == 500
    for reason in (FinishReason.aborted("aborted by request"), FinishReason.at_length(3), None):
        raise_for_abort(reason.to_json() if reason else None)
