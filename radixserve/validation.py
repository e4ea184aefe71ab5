"""Turning pydantic's validation errors into the engine's one error style:
``ValueError("<field path>: <message>")``, which the HTTP layer answers with
a 400 whose ``param`` is the field path."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationError, ValidationInfo

# Tags pydantic puts in an error's location for union members.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "tuple", "set", "none", "None", "bytes"}
_MAX_SHOWN = 80  # characters of the offending value quoted in a message
# "<field path>: " at the start of a message
FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")

# The request fields of SGLang (GenerateReqInput and SamplingParams, v0.5, and
# its OpenAI routes) and of OpenAI's API that this engine does not implement,
# with the values that ask for nothing: those are accepted and ignored, any
# other value is refused by name. A list of such values counts as one (a
# batch's per-prompt `lora_id: [null, null]`). Each model declares the ones
# it takes as ``NoOpOnly`` fields. (docs/api.md)
NO_OP_VALUES: dict[str, tuple] = {
    # multimodal inputs
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []),
    "mm_hashes": (None,), "mm_content_hashes": (None,), "use_audio_in_video": (False,), "video_config": (None,),
    "modalities": (None, [], ["text"]), "images_config": (None,), "mm_processor_kwargs": (None,),
    "need_wait_for_mm_inputs": (None, False), "num_items_assigned": (None,), "encoder_urls": (None, []),
    "max_dynamic_patch": (None,), "min_dynamic_patch": (None,), "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,),
    # LoRA, sessions, custom processors and sampling
    "lora_id": (None,), "session_params": (None,), "custom_logit_processor": (None,),
    "custom_params": (None,), "watermark": (None,), "positional_embed_overrides": (None,),
    "beam_width": (None, 1), "ebnf_full_assistant": (False,),
    # outputs
    "return_hidden_states": (False,), "return_routed_experts": (False,), "routed_experts_start_len": (0,),
    "return_indexer_topk": (False,), "return_sampling_mask": (None, False), "sampling_logprobs_mode": (None,),
    "return_flat_raw_top_logprobs": (False,), "return_flat_raw_output_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": (False,), "return_bytes": (False,), "return_entropy": (False,),
    "return_prompt_token_ids": (False,), "return_cached_tokens_details": (False,),
    "return_spec_tokens_details": (False,), "return_token_ids": (False,), "return_meta_info": (False,),
    "return_input_ids_in_sglext": (False,), "return_output_ids_in_sglext": (False,),
    "multi_item_delimiter_indices": (None,), "token_indices_to_pool": (None,),
    # routing, and disaggregation beyond bootstrap_host / port / room (docs/disaggregation.md)
    "bootstrap_pair_key": (None,), "decode_tp_size": (None,), "routed_dp_rank": (None, 0),
    "data_parallel_rank": (None, 0), "disagg_prefill_dp_rank": (None,), "http_worker_ipc": (None,),
    "background": (False,), "require_reasoning": (False,), "max_thinking_tokens": (None,),
    "extra_key": (None, ""), "cache_salt": (None, ""),
    # OpenAI's completions and chat (a chat request's input_ids too)
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none", "auto"), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "verbosity": (None,), "thinking": (None,),
    "task": (None,), "input_ids": (None,),
}


def error_path(loc: tuple | list, prefix: str = "") -> str:
    """A pydantic error location as a field path (``messages[0].content``),
    without the tags pydantic adds for union members (``str``, ``list[int]``,
    ``function-after[...]``, a model's class name) or dict keys."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            path += f".{part}" if path else part
    return path


def describe_error(err: dict, what: str = "invalid value", prefix: str = "") -> str:
    """``"<field>: <what> <field>=<value>: <reason>"`` for one item of
    ``ValidationError.errors()``."""
    path = error_path(err.get("loc", ()), prefix)
    reason = err.get("msg", "invalid").removeprefix("Value error, ")
    if not err.get("loc"):  # a check across fields names its field itself
        return reason if FIELD_PREFIX.match(reason) else f"{path or 'body'}: {reason}"
    path = path or "body"
    if err.get("type") in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"{path}: unknown field"
    if err.get("type") == "missing_argument" or err.get("type") == "missing":
        return f"{path}: required"
    return f"{path}: {what} {path}={shown(err.get('input'))}: {reason}"


def shown(value: Any) -> str:
    """``repr(value)``, cut short: messages quote what the client sent, never all of it."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def first_error(exc: ValidationError, what: str = "invalid value", prefix: str = "") -> ValueError:
    """The first error of ``exc`` as a ``ValueError`` naming its field. Of a
    union's errors for one field, the one that reached deepest into the value
    says most (``top_logprobs_num[0]`` is over 20, not "not an integer")."""
    errors = exc.errors(include_url=False)
    if not errors:
        return ValueError(f"{prefix or 'body'}: invalid")
    field = errors[0]["loc"][:1]
    same_field = [e for e in errors if e["loc"][:1] == field]
    return ValueError(describe_error(max(same_field, key=lambda e: len(e["loc"])), what, prefix))


def require_no_op(field: str, value: Any, no_ops: tuple) -> Any:
    """``value`` if it asks for nothing (one of ``no_ops``, or a list of such
    values); else ``ValueError`` saying the field is not supported."""
    if _is_no_op(value, no_ops):
        return value
    accepted = " or ".join(json.dumps(v) for v in no_ops)
    raise ValueError(f"'{field}' is not supported by this server (only {accepted} is accepted)")


def _is_no_op(value: Any, no_ops: tuple) -> bool:
    if any(value == ok and type(value) is type(ok) for ok in no_ops):
        return True
    return isinstance(value, list) and bool(value) and all(_is_no_op(v, no_ops) for v in value)


def _only_no_op(value: Any, info: ValidationInfo) -> Any:
    return require_no_op(info.field_name, value, NO_OP_VALUES[info.field_name])


# A request field this engine does not implement: accepted at its values of NO_OP_VALUES only.
NoOpOnly = Annotated[Any, AfterValidator(_only_no_op)]
