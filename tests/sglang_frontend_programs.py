"""SGLang frontend-language programs, run against a server by
tests/test_sglang_clients.py in a subprocess (importing sglang patches
transformers and sets cache variables: that must not leak into pytest).

    python tests/sglang_frontend_programs.py URL

prints one JSON object: what each program produced. SmolLM2 speaks ChatML;
SGLang's frontend picks a chat template by the model path's name, which does
not say so, hence ``chat_template_name``, as a user of SGLang itself would pass.
"""

from __future__ import annotations

import json
import sys

import sglang as sgl

CAPITAL_PROMPT = "The capital of {} is"
COUNT_PROMPT = "One, two, three,"
FORK_PROMPT = "Two animals: cats and dogs.\n"
FORK_BRANCH = "One fact about {}:"
PHONE_REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CITIES = ["Paris", "London", "Tokyo"]


@sgl.function
def capital(s, country):
    s += CAPITAL_PROMPT.format(country) + sgl.gen("city", max_tokens=8, temperature=0, stop=".")


@sgl.function
def phone(s):
    s += "Call us at " + sgl.gen("number", max_tokens=16, temperature=0, regex=PHONE_REGEX)


@sgl.function
def ask_select(s, question, choices):
    s += sgl.user(question)
    s += sgl.assistant(sgl.select("answer", choices=choices))


@sgl.function
def ask_gen_choices(s, question, choices):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", choices=choices))


@sgl.function
def count(s):
    s += COUNT_PROMPT + sgl.select("next", choices=[" four", " seven"])


@sgl.function
def two_turns(s):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("first", max_tokens=24, temperature=0))
    s += sgl.user("And what is the capital of Japan?")
    s += sgl.assistant(sgl.gen("second", max_tokens=24, temperature=0))


@sgl.function
def two_facts(s):
    s += FORK_PROMPT
    branches = s.fork(2)
    for branch, animal in zip(branches, ["cats", "dogs"]):
        branch += FORK_BRANCH.format(animal) + sgl.gen("fact", max_tokens=16, temperature=0, stop="\n")
    branches.join()  # gathers each branch's "fact" into the parent, in order
    s += "Facts:" + branches[0]["fact"] + " /" + branches[1]["fact"]


def run_all() -> dict:
    """Each program's output, with the prompts the test needs to check it."""
    question = "What is the capital of France?"
    chat = two_turns.run()
    facts = two_facts.run()
    return {
        "gen": capital.run(country="France")["city"],
        "run_batch": [st["city"] for st in capital.run_batch(
            [{"country": c} for c in ["France", "Japan", "Italy", "Germany"]], progress_bar=False)],
        "regex": {"pattern": PHONE_REGEX, "output": phone.run()["number"]},
        "select": ask_select.run(question=question, choices=CITIES)["answer"],
        "gen_choices": ask_gen_choices.run(question=question, choices=CITIES)["answer"],
        "count": {"prompt": COUNT_PROMPT, "answer": count.run()["next"]},
        "two_turns": {"first": chat["first"], "second": chat["second"],
                      "roles": [m["role"] for m in chat.messages()]},
        "fork": {"prompts": [FORK_PROMPT + FORK_BRANCH.format(a) for a in ("cats", "dogs")],
                 "facts": facts["fact"], "text": facts.text()},
    }


if __name__ == "__main__":
    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1], chat_template_name="chatml"))
    print(json.dumps(run_all()))
