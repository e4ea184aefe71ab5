"""bench.serving's backends: how each API is asked for a streamed reply and
how each of its events is read (``Chunk``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Chunk:
    """One parsed server-sent event."""

    tokens: int | None = None  # completion tokens so far (native); None if the event does not say
    text: str = ""  # new text (OpenAI) or the cumulative text (native)
    output_ids: list[int] | None = None
    arrived: bool = False  # this event brought output
    finished: bool = False
    prompt_len: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str = ""


class NativeBackend:
    """SGLang's ``POST /generate``; replies carry cumulative ``output_ids`` (new ones only from a server
    with ``--incremental-streaming-output``: ``make_backend``)."""

    path = "/generate"
    chat = False  # the prompt is a list of messages
    cumulative = True  # each event repeats the whole reply so far (text and output_ids)

    def payload(self, prompt, max_tokens: int, sampling: dict, model: str, lora: str | None = None) -> dict:
        key = "text" if isinstance(prompt, str) else "input_ids"
        body = {key: prompt, "sampling_params": {"max_new_tokens": max_tokens, **sampling}, "stream": True}
        return body if lora is None else {**body, "lora_path": lora}

    def parse(self, data: dict, prev_tokens: int) -> Chunk:
        if "error" in data:
            return Chunk(error=str(data["error"]))
        meta = data.get("meta_info", {})
        n = meta.get("completion_tokens", len(data.get("output_ids") or []))
        return Chunk(tokens=n, text=data.get("text", ""), output_ids=data.get("output_ids"), arrived=n > prev_tokens,
                     finished=meta.get("finish_reason") is not None, prompt_len=meta.get("prompt_tokens"),
                     cached_tokens=meta.get("cached_tokens"), completion_tokens=n)


class OpenAICompletionsBackend:
    """``POST /v1/completions``; a prompt of token ids is sent as ids."""

    path = "/v1/completions"
    chat = False  # the prompt is a list of messages
    cumulative = False  # each event brings a text delta
    prompt_field = "prompt"

    def payload(self, prompt, max_tokens: int, sampling: dict, model: str, lora: str | None = None) -> dict:
        if lora is not None:  # SGLang's "BASE:ADAPTER" (the adapter's name alone without a base name)
            model = f"{model}:{lora}" if model else lora
        return {"model": model, self.prompt_field: prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, **_openai_sampling(sampling)}

    @staticmethod
    def choice_text(choice: dict) -> str:
        return choice.get("text") or ""

    def parse(self, data: dict, prev_tokens: int) -> Chunk:
        if "error" in data:
            return Chunk(error=str(data["error"]))
        chunk = _usage_chunk(data)
        for choice in data.get("choices") or []:
            chunk.text += self.choice_text(choice)
            chunk.finished |= choice.get("finish_reason") is not None
        chunk.arrived = bool(chunk.text) or chunk.finished
        return chunk


class OpenAIChatBackend(OpenAICompletionsBackend):
    """``POST /v1/chat/completions``; the prompt is a list of messages."""

    path = "/v1/chat/completions"
    chat = True
    prompt_field = "messages"

    @staticmethod
    def choice_text(choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""


def _openai_sampling(sampling: dict) -> dict:
    out = dict(sampling)
    if "min_new_tokens" in out:
        out["min_tokens"] = out.pop("min_new_tokens")
    return out


def _usage_chunk(data: dict) -> Chunk:
    usage = data.get("usage") or {}
    return Chunk(prompt_len=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                 cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"))


BACKENDS = {"radixserve": NativeBackend, "openai": OpenAICompletionsBackend, "openai-chat": OpenAIChatBackend}


def make_backend(name: str, incremental: bool = False):
    """The client of backend ``name``; ``incremental``: the server streams
    what is new (``--incremental-streaming-output``)."""
    backend = BACKENDS[name]()
    if incremental and isinstance(backend, NativeBackend):
        backend.cumulative = False  # each event brings its new text and output_ids
    return backend
