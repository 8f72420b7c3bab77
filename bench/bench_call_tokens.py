"""Output tokens of a forced one-argument tool call, greedy, on the worker's path.

    .venv/bin/python bench/bench_call_tokens.py [--model smollm2:135m]

The prompt is rendered as the web renders it (``generation.prompts``), the
grammar compiled as the worker compiles it (``workers.constraints``), and the
call generated greedily in the model's batching engine (``engine.client``).
The count is what ``usage.output_tokens`` reports: the generated tokens, the
end token included. Each token is shown, so that non-canonical splits (the
model choosing several small tokens where the tokenizer would use one) show.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

import django  # noqa: E402

django.setup()

from engine.client import engine_for  # noqa: E402
from engine.interface import SamplingParams  # noqa: E402
from generation import prompts  # noqa: E402
from generation.params import GenerationParams  # noqa: E402
from generation.registry import get_model  # noqa: E402
from generation.tokens import prompt_tokenizer  # noqa: E402
from workers import constraints  # noqa: E402
from workers.loading import load_model  # noqa: E402

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
QUESTIONS = ["What is the weather in Paris?", "What is the weather in Hangzhou?"]
CHOICES = {
    "required": ([WEATHER], "required"),
    "named": ([WEATHER, TIME], {"type": "function", "name": "get_weather"}),
    "required, two tools": ([WEATHER, TIME], "required"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    args = parser.parse_args()
    lm = load_model(get_model(args.model))
    batching = engine_for(lm, lm.spec.max_batch)
    tokenizer = prompt_tokenizer(lm.spec)
    for label, (tools, choice) in CHOICES.items():
        params = GenerationParams(temperature=0, tools=tools, tool_choice=choice)
        for question in QUESTIONS:
            user = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": question}],
            }
            prompt = prompts.render_prompt(lm.spec, tokenizer, [user], params)
            prompt_ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            generation = batching.add_request(
                prompt_ids,
                SamplingParams(max_tokens=100, temperature=0),
                grammar=constraints.compiled_grammar(lm, params),
            )
            generation.wait(300)
            ids = generation.token_ids
            pieces = [lm.tokenizer.decode([token_id]) for token_id in ids]
            print(f"{label} / {question!r}: {len(ids)} output tokens ({generation.finish_reason})")
            print(f"  prompt ends {prompt[-40:]!r}, {len(prompt_ids)} input tokens")
            print(f"  {json.dumps(pieces, ensure_ascii=False)}")
    batching.close()


if __name__ == "__main__":
    main()
