"""From protocol input items to the text the model reads.

The web process renders the prompt (it needs the token count to refuse a
request that does not fit), stores it on the response, and the worker
tokenizes exactly that text.
"""

from __future__ import annotations

import json

from .registry import ModelSpec


def _text(parts: list[dict]) -> str:
    return "".join(part["text"] for part in parts)


def chat_messages(items: list[dict]) -> list[dict]:
    """Chat-template messages for input items, in order.

    A ``function_call`` is what the assistant said (in the model's tool-call
    format), a ``function_call_output`` comes back as a ``tool`` message, and
    reasoning items are not shown to the model again.
    """
    messages: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            try:
                arguments = json.loads(item["arguments"])
            except ValueError:
                arguments = item["arguments"]
            call = json.dumps({"name": item["name"], "arguments": arguments}, ensure_ascii=False)
            messages.append({"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "content": f"<tool_response>\n{item['output']}\n</tool_response>"}
            )
    return messages


def render_prompt(spec: ModelSpec, tokenizer: object, items: list[dict], params: dict) -> str:
    messages = chat_messages(items)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def count_tokens(tokenizer: object, prompt: str) -> int:
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
