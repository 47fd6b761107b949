"""Chat prompts: messages through the target's chat template, with the template's own options.

Options such as `{"enable_thinking": false}` change what the template renders, and a draft accepts most
when it serves in the mode its training data was made in: the most common cause of low acceptance in
the field. So every place that renders a chat prompt (generate, datagen, bench, train's corpora and
evaluation, serve) goes through `chat_ids` with the same options, and `parse_kwargs` checks them the
same way everywhere.
"""

from __future__ import annotations

import argparse
import json

# apply_chat_template arguments that the callers set themselves
RESERVED = frozenset({"conversation", "messages", "tokenize", "return_dict", "add_generation_prompt"})


def check_kwargs(kwargs) -> dict:
    """The options as a dict, or ValueError naming the problem and the fix."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError('chat template options must be a JSON object, e.g. {"enable_thinking": false}')
    reserved = sorted(set(kwargs) & RESERVED)
    if reserved:
        raise ValueError(f"chat template options may not set {reserved}: flashdraft sets those itself")
    return dict(kwargs)


def parse_kwargs(text: str) -> dict:
    """`--chat-template-kwargs` text: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): pass an object such as '{{\"enable_thinking\": false}}'") from None
    return check_kwargs(value)


def add_argument(parser: argparse.ArgumentParser, applies_to: str) -> None:
    """`--chat-template-kwargs JSON`, the same on every verb that renders chat prompts."""
    parser.add_argument(
        "--chat-template-kwargs",
        type=_argparse_kwargs,
        default=None,
        metavar="JSON",
        help=f"chat template options for {applies_to}, e.g. '{{\"enable_thinking\": false}}': use the "
        "mode the draft's training data was made in (default: the template's own defaults)",
    )


def _argparse_kwargs(text: str) -> dict:
    try:
        return parse_kwargs(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


def chat_ids(
    tokenizer, messages: list[dict], kwargs: dict | None = None, generation_prompt: bool = True
) -> list[int]:
    """Token ids of the messages in the tokenizer's chat template (whatever type the tokenizer returns)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False, **(kwargs or {})
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
