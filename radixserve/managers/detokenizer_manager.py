"""Incremental detokenization: token ids in, text deltas out.

``DecodeStatus`` turns a growing list of ids into appendable text: it never
emits half of a multi-byte UTF-8 character (the replacement char '\\ufffd'
marks an incomplete one) nor the last ``len(longest stop string) - 1``
characters while a stop string (or a ``stop_regex`` match, up to
``stop_regex.MAX_STREAM_HOLD`` characters) could still complete and be trimmed. The
``DetokenizerManager`` process runs one per request between the Scheduler and
the TokenizerManager; the offline Engine uses ``DecodeStatus`` directly.
"""

from __future__ import annotations

import logging

from radixserve.managers.child_process import ParentWatch, freeze_startup_objects, zmq_context
from radixserve.managers.io_struct import BatchStrOut, BatchTokenIDOut, decode, encode, pipeline_sockets
from radixserve.sampling import stop_regex as stop_regex_lib

logger = logging.getLogger(__name__)

# Context tokens re-decoded before the new ones, so that tokenizers whose
# decoding depends on the neighbour (leading spaces) produce the right text.
CONTEXT_TOKENS = 5


# A request's decode options (DecodeStatus's arguments): in the meta of its
# first output only (the scheduler's ``req_meta``).
DECODE_OPTIONS = ("skip_special_tokens", "spaces_between_special_tokens", "stop", "no_stop_trim", "stop_regex")


class DecodeStatus:
    """Decoding state of one request's output."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: list[str] | None = None, no_stop_trim: bool = False, stop_regex: list[str] | None = None):
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False
        self.ids: list[int] = []
        self.surr_offset = 0  # ids[surr_offset:read_offset] are context
        self.read_offset = 0  # ids before this are fully decoded into self.decoded
        self.decoded = ""  # text of ids[:read_offset]
        self.sent = 0  # characters of the final text already handed out
        self.stop, self.stop_regex = list(stop or []), list(stop_regex or [])
        hold = max(max((len(s) - 1 for s in self.stop), default=0), stop_regex_lib.stream_hold(self.stop_regex))
        self.no_stop_trim = no_stop_trim
        self.hold = 0 if no_stop_trim else hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)

    def _advance(self) -> None:
        context = self._decode(self.ids[self.surr_offset : self.read_offset])
        full = self._decode(self.ids[self.surr_offset :])
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self.decoded += full[len(context) :]
            self.surr_offset = max(len(self.ids) - CONTEXT_TOKENS, 0)
            self.read_offset = len(self.ids)

    def feed(self, new_ids: list[int], finish_reason: dict | None = None, no_stop_trim: bool = False) -> str:
        """Add ids; return the text that can be appended now (all of the rest,
        trimmed, when ``finish_reason`` says the request is done)."""
        self.ids.extend(new_ids)
        if finish_reason is not None:
            return self.finish(finish_reason, no_stop_trim)
        self._advance()
        ready = max(len(self.decoded) - self.hold, self.sent)
        delta, self.sent = self.decoded[self.sent : ready], ready
        return delta

    def finish(self, finish_reason: dict | None, no_stop_trim: bool = False) -> str:
        """The remaining text once the request finished, trimmed at a matched
        stop string (or without a matched stop token) unless ``no_stop_trim``."""
        matched = (finish_reason or {}).get("matched")
        ids = self.ids
        if (finish_reason or {}).get("type") == "stop" and isinstance(matched, int) and not no_stop_trim:
            ids = ids[:-1] if ids and ids[-1] == matched else ids
        text = self._decode(ids)
        if isinstance(matched, str) and not no_stop_trim:
            text = text[: self._stop_position(matched, text)]
        delta = text[self.sent :] if len(text) >= self.sent else ""
        self.sent = max(self.sent, len(text))
        return delta


    def _stop_position(self, matched: str, text: str) -> int:
        """Where the text ends: at the matched stop string, or at the first
        match of the matched stop regex."""
        if matched in text and (matched in self.stop or matched not in self.stop_regex):
            return text.find(matched)
        if matched not in self.stop_regex:
            return len(text)
        try:
            found = stop_regex_lib.first_match(stop_regex_lib.compile_all([matched]), text)
        except stop_regex_lib.StopRegexTimeout:
            found = None
        return len(text) if found is None else found[1]


class DetokenizerManager:
    """Process loop: BatchTokenIDOut from the scheduler -> BatchStrOut to the
    tokenizer manager; every other message is forwarded unchanged.

    A request whose tokens cannot be decoded ends there with an abort (and
    ``abort_upstream``, so that the tokenizer manager stops it in the
    scheduler too); the others in the batch go on. A message that cannot be
    decoded is dropped."""

    def __init__(self, tokenizer, recv_addr: str, send_addr: str, watch: ParentWatch | None = None):
        self.tokenizer = tokenizer
        self.watch = watch
        self.recv, self.send = pipeline_sockets(zmq_context(), recv_addr, send_addr)
        self.status: dict[str, DecodeStatus] = {}
        self.failed: set[str] = set()  # aborted here; the scheduler's last outputs for them are dropped

    def handle(self, out: BatchTokenIDOut) -> BatchStrOut:
        keep = []
        deltas = []
        for i, (rid, ids, meta) in enumerate(zip(out.rids, out.new_ids, out.meta)):
            finished = meta.get("finish_reason") is not None
            if rid in self.failed:
                if finished:
                    self.failed.discard(rid)
                continue
            try:
                deltas.append(self._feed(rid, ids, meta))
            except Exception as exc:  # this request's output cannot be decoded; the rest of the batch can
                logger.error("request %s: detokenization failed: %s: %s", rid, type(exc).__name__, exc)
                self.status.pop(rid, None)
                if not finished:
                    self.failed.add(rid)
                meta["finish_reason"] = {"type": "abort", "message": f"detokenization failed: {exc}", "status_code": 500}
                meta["abort_upstream"] = not finished
                deltas.append("")
            keep.append(i)
        return BatchStrOut([out.rids[i] for i in keep], deltas, [out.new_ids[i] for i in keep],
                           [out.meta[i] for i in keep])

    def _feed(self, rid: str, ids: list[int], meta: dict) -> str:
        options = {key: meta.pop(key) for key in DECODE_OPTIONS if key in meta}  # kept here, not passed on
        st = self.status.get(rid)
        if st is None:
            st = self.status[rid] = DecodeStatus(self.tokenizer, **options)
        delta = st.feed(ids, meta.get("finish_reason"), st.no_stop_trim)
        if meta.get("finish_reason") is not None:
            del self.status[rid]
        return delta

    def event_loop(self) -> None:
        while True:
            if not self.recv.poll(1000):
                if self.watch is not None and not self.watch.alive():
                    self.watch.exit_orphaned()
                continue
            try:
                msg = decode(self.recv.recv())
            except ValueError as exc:
                logger.error("dropped a malformed message: %s", str(exc).splitlines()[0])
                continue
            if isinstance(msg, BatchTokenIDOut):
                msg = self.handle(msg)
            self.send.send(encode(msg))


def run_detokenizer_process(tokenizer_dir: str | None, recv_addr: str, send_addr: str, ready,
                            ipc_dir: str | None = None) -> None:
    """Entry point of the detokenizer process."""
    logging.basicConfig(level=logging.INFO, format="[detokenizer] %(message)s")
    watch = ParentWatch(ipc_dir)
    try:
        tokenizer = None
        if tokenizer_dir:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        manager = DetokenizerManager(NullTokenizer() if tokenizer is None else tokenizer, recv_addr, send_addr, watch)
        freeze_startup_objects()
        ready.send({"status": "ready"})
    except Exception as exc:  # report start-up failures to the launcher
        ready.send({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        raise
    manager.event_loop()


class NullTokenizer:
    """For models without a tokenizer (dummy weights): no text, ids only."""

    def decode(self, ids, **kwargs) -> str:
        return ""
