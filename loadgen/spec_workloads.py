"""The prompts of ``kvmesh bench spec --workload``: what speculative decoding is measured on.

- ``quote``: a passage of random words and "Repeat the passage", as plain text (no chat
  template): the seeded figures' workload. Random-weight models copy only when their greedy
  output loops, so on them acceptance is about what loops, not what a user gets.
- ``chat``: short questions a user asks an assistant, in the model's chat template; the answers
  are new text, and prompt lookup (n-gram) finds little to propose. The honest case.
- ``copy``: requests whose answers copy from the prompt, in the chat template: repeat a text,
  fix one word in a code snippet and give the whole snippet back. What n-gram drafting is for.

Token ids come from the model's own tokenizer, so the same workload runs on any model.
"""

from __future__ import annotations

import random
from typing import Any

WORKLOADS = ("quote", "chat", "copy")

_WORDS = ["the", "mesh", "decode", "prefill", "block", "cache", "token", "draft", "verify"]
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What is the difference between a list and a tuple in Python?",
    "How do vaccines work?",
    "Suggest a name for a bakery.",
    "What are the main causes of inflation?",
    "Describe a cat to someone who has never seen one.",
    "How many legs does a spider have, and why?",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet.",
    "What is machine learning?",
    "How do I make a cup of tea?",
    "Why do leaves change color in the fall?",
]
_PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time, for three weeks each. Late returns cost ten cents a day. "
    "The reading room on the second floor is quiet, and phones must be silent there.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. "
    "The lights will blink for about a minute. When the green light stays on, the network is "
    "ready. If it does not come back, hold the reset button for ten seconds.",
    "Our team meets every Monday at ten to plan the week. On Wednesdays we review open issues, "
    "and on Fridays each person shows what they finished. Notes from every meeting go into the "
    "shared folder, under the date of the meeting.",
    "Preheat the oven to two hundred degrees. Mix the flour, the sugar and a pinch of salt, then "
    "add the butter and rub it in until the mixture looks like breadcrumbs. Stir in the milk, "
    "shape the dough into a round, and bake it for twenty minutes.",
]
_CODE = [
    (
        "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n",
        "Rename the function average to mean",
    ),
    (
        "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n"
        "    return message\n",
        "Change 'Hello' to 'Welcome'",
    ),
    (
        "class Counter:\n    def __init__(self):\n        self.count = 0\n\n"
        "    def increment(self):\n        self.count += 1\n        return self.count\n",
        "Rename the method increment to step",
    ),
    (
        "def is_even(number):\n    if number % 2 == 0:\n        return True\n    return False\n",
        "Rename the argument number to n",
    ),
]


def workload_prompts(
    workload: str, tokenizer: Any, num: int, passage_len: int, seed: int = 0
) -> list[list[int]]:
    """``num`` prompts of ``workload`` as token ids of ``tokenizer`` (shared/text/tokenizer.py)."""
    rng = random.Random(seed)
    if workload == "quote":
        prompts = []
        for _ in range(num):
            text = " ".join(rng.choice(_WORDS) for _ in range(passage_len // 5))
            full = f"Passage: {text}\nRepeat the passage.\nPassage: {text[: len(text) // 4]}"
            prompts.append(tokenizer.encode(full, add_special_tokens=False))
        return prompts
    if workload == "chat":
        first = rng.randrange(len(QUESTIONS))
        asks = [QUESTIONS[(first + i) % len(QUESTIONS)] for i in range(num)]
    elif workload == "copy":
        asks = []
        for i in range(num):
            if (seed + i) % 2:
                code, change = _CODE[(seed + i) // 2 % len(_CODE)]
                asks.append(f"{change} and give back the whole code:\n\n```python\n{code}```")
            else:
                passage = _PASSAGES[(seed + i) // 2 % len(_PASSAGES)]
                asks.append(f"Repeat this text exactly, word for word:\n\n{passage}")
    else:
        raise ValueError(f"workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    return [tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]
