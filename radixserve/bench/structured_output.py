"""What constrained decoding costs: the same prompts generated twice in one
process, without a grammar and with a JSON schema, at the same batch size and
the same number of output tokens; prints one JSON line per run and a summary.

    python -m radixserve.bench.structured_output                       # SmolLM2 on this machine
    python -m radixserve.bench.structured_output --model-path qwen3-0.6b --load-format dummy \\
        --tokenizer-path TOKENIZER_FOLDER                              # a GPU, random weights

The schema (an object holding an array of at least ``--min-items`` strings)
cannot end before ``--output-len`` tokens, and ``ignore_eos`` holds the
unconstrained run to the same length, so both runs generate exactly
``batch x output-len`` tokens and their throughputs compare directly. The
summary compares each side's fastest of ``--repeats`` runs and gives the
grammar's host time in the last constrained run: compiling, filling the token
masks, applying them and advancing the matchers. Part of that time runs while
the device computes the batch's forward, so it need not add up to the
difference in wall time. ``--validate`` also samples outputs of a small schema
and counts those that parse.
"""

from __future__ import annotations

import argparse
import json
import time

LONG_ARRAY = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}},
    "required": ["items"],
}


PERSON = {  # bounded: every output ends well within 400 tokens, even from random weights
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "maximum": 150},
                   "color": {"type": "string", "enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "color", "tags"], "additionalProperties": False,
}


def validate(engine, prompts: list[str]) -> dict:
    """Sampled outputs under PERSON: how many finish, parse and hold its fields."""
    outs = engine.generate(prompts, {"json_schema": json.dumps(PERSON), "max_new_tokens": 400, "temperature": 1.0})
    ok = 0
    for out in outs:
        try:
            obj = json.loads(out["text"])
            ok += set(obj) == set(PERSON["required"]) and obj["color"] in ("red", "green", "blue")
        except ValueError:
            pass
    return {"run": "validate", "requests": len(outs), "valid_json_outputs": ok,
            "finished_by_grammar": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)}


def run(engine, prompts: list[str], params: dict, label: str) -> dict:
    sched = engine.scheduler
    engine.flush_cache()  # no run reuses the prompts' KV of the one before
    before = sched.stats.forward_ct
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"run": label, "requests": len(outs), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 1), "forward_steps": sched.stats.forward_ct - before,
            "finish": sorted({o["meta_info"]["finish_reason"]["type"] for o in outs})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--json-model-override-args", default="{}",
                        help="e.g. a dummy model's vocab_size set to its tokenizer's (as a real model has it)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-items", type=int, default=200)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs; the summary takes each side's fastest")
    parser.add_argument("--validate", action="store_true", help="also check that sampled outputs of a schema parse")
    args = parser.parse_args()

    import radixserve

    schema = json.dumps({**LONG_ARRAY, "properties": {"items": {**LONG_ARRAY["properties"]["items"],
                                                                "minItems": args.min_items}}})
    options = {"disable_tqdm": True, "load_format": args.load_format, "tokenizer_path": args.tokenizer_path,
               "max_running_requests": args.batch, "json_model_override_args": args.json_model_override_args}
    if args.max_total_tokens:
        options["max_total_tokens"] = args.max_total_tokens
    with radixserve.Engine(args.model_path, **options) as engine:
        prompts = [engine.apply_chat_template([{"role": "user", "content": f"List {i + 20} fruits as JSON."}])
                   for i in range(args.batch)]
        base = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0.6, "sampling_seed": 0}
        run(engine, prompts[:2], {**base, "max_new_tokens": 8}, "warm-up")
        run(engine, prompts[:2], {**base, "max_new_tokens": 8, "json_schema": schema}, "warm-up")
        grammar = engine.scheduler.grammar_queue.backend
        runs = {"unconstrained": [], "json_schema": []}
        for _ in range(args.repeats):  # alternated, so that drift hits both alike
            runs["unconstrained"].append(run(engine, prompts, base, "unconstrained"))
            grammar.timings = dict.fromkeys(grammar.timings, 0.0)
            runs["json_schema"].append(run(engine, prompts, {**base, "json_schema": schema}, "json_schema"))
            host = {k: round(v, 3) for k, v in grammar.timings.items()}  # of the last constrained run
        checked = [validate(engine, prompts)] if args.validate else []
        device = str(engine.scheduler.device)
    for line in runs["unconstrained"] + runs["json_schema"] + checked:
        print(json.dumps({**line, "device": device, "model": args.model_path or "SmolLM2-135M-Instruct"}))
    plain, constrained = (min(runs[k], key=lambda r: r["wall_s"]) for k in ("unconstrained", "json_schema"))
    extra = constrained["wall_s"] - plain["wall_s"]
    print(json.dumps({
        "summary": "structured output cost", "batch": args.batch, "output_len": args.output_len, "device": device,
        "throughput_ratio": round(constrained["output_tok_s"] / plain["output_tok_s"], 3),
        "extra_wall_s": round(extra, 3), "grammar_host_s_last_run": host,
    }))


if __name__ == "__main__":
    main()
