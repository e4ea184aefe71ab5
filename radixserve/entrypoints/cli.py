"""``radixserve`` command line: ``radixserve serve ...`` (HTTP server),
``radixserve generate ...`` (offline) and ``radixserve kvctl ...`` (a
running server's elastic KV limit)."""

from __future__ import annotations

import argparse
import json
import sys

from radixserve.server_args import ServerArgs


def _generate(args: argparse.Namespace) -> int:
    from radixserve.entrypoints.engine import Engine

    server_args = ServerArgs.from_cli_args(args)
    with Engine(**vars(server_args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        if args.stream:
            printed = ""
            for chunk in engine.generate(prompt, params, stream=True):
                sys.stdout.write(chunk["text"][len(printed) :])
                sys.stdout.flush()
                printed = chunk["text"]
            print()
            out = chunk
        else:
            out = engine.generate(prompt, params)
            print(out["text"])
        if args.json:
            print(json.dumps(out["meta_info"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve: LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for one prompt")
    ServerArgs.add_cli_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--json", action="store_true", help="also print meta_info as JSON")
    serve = sub.add_parser("serve", help="start the HTTP server (SGLang native API + OpenAI API)", add_help=False)
    serve.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("kvctl", help="read and set a running server's elastic KV limit", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["kvctl"]:
        from radixserve.entrypoints.kvctl import main as kvctl_main

        return kvctl_main(argv[1:])
    if argv[:1] == ["serve"]:
        from radixserve.entrypoints.serve import serve

        return serve(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
