"""A small mixed-domain prompt set, written for this project (no outside source)."""

from __future__ import annotations

from dataclasses import dataclass

from cosine.zoo.corpora import DomainPrompt


@dataclass(frozen=True)
class Prompt(DomainPrompt):
    """A benchmark prompt: domain (code | docs | literary | chat), text, and whether it goes
    through the chat template (`token_ids` as the router tokenizes it)."""

    def request_fields(self, max_new_tokens: int) -> dict:
        if self.chat:
            return {"messages": [{"role": "user", "content": self.text}], "max_new_tokens": max_new_tokens}
        return {"prompt": self.text.encode(), "max_new_tokens": max_new_tokens}


PROMPTS = [
    Prompt("code", "Write a Python function that checks whether a number is prime.", True),
    Prompt("docs", "Explain what a hash table is in two sentences.", True),
    Prompt("docs", "List three uses of the Linux command grep.", True),
    Prompt("literary", "Write a short poem about the sea.", True),
    Prompt("chat", "What is the difference between TCP and UDP?", True),
    Prompt("code", 'def merge_sort(items):\n    """Sort a list with merge sort."""\n', False),
    Prompt("docs", "The history of the Roman Empire", False),
    Prompt("literary", "To be, or not to be, that is the question:", False),
    Prompt("code", "import json\n\nwith open('config.json') as f:\n", False),
    Prompt("docs", "SQLite is a C library that provides", False),
]


# Prompts unlike anything the zoo trains on (nor its held-out split, which shares its generator): (domain, chat?,
# text), domains code, prose, technical, chat, math; pass1[i] and pass2[i] share a domain, never a topic. Written
# before any drafter was trained and never tuned on ("tune" is the set parameters were chosen on).
UNLIKE: dict[str, list[tuple[str, bool, str]]] = {
    "tune": [
        ("code", True, "Write a Python function that counts the vowels in a string."),
        ("code", False, "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"),
        ("prose", True, "Write a short story about a lighthouse keeper who finds a message in a bottle."),
        ("technical", True, "How do I create a virtual environment in Python and install packages into it?"),
        ("technical", True, "Explain what a hash table is and why lookups are fast."),
        ("chat", True, "What are some good ways to stay focused while working from home?"),
        ("math", True, "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step."),
        ("math", True, "If a train travels 180 km in 2 hours, what is its average speed? Show your work."),
    ],
    "pass1": [
        ("code", True, "Write a Python function that checks whether a number is prime."),
        ("code", False, "def flatten(nested):\n    \"\"\"Return a flat list of all items in a nested list.\"\"\"\n"),
        ("prose", True, "Continue this story: The old clockmaker opened his shop one rainy morning and"),
        ("technical", True, "How do I set up SSH keys to log in to a Linux server without a password?"),
        ("technical", True, "Explain how garbage collection works in Python."),
        ("chat", True, "I have trouble sleeping at night. Do you have any advice?"),
        ("math", True, "Tom has 24 apples and gives a third of them to his sister. How many apples does he have left? "
                       "Explain step by step."),
        ("math", True, "A rectangle is 8 cm long and 5 cm wide. What are its area and perimeter? Show your work."),
    ],
    "pass2": [
        ("code", True, "Write a Python function that returns the factorial of a number."),
        ("code", False, "def chunks(items, size):\n    \"\"\"Split a list into consecutive chunks of the given size.\"\"\"\n"),
        ("prose", True, "Continue this story: The young sailor woke up on an empty beach and"),
        ("technical", True, "How do I schedule a script to run every night with cron on Linux?"),
        ("technical", True, "Explain how a Python dictionary stores its keys and values."),
        ("chat", True, "I feel stressed before exams. Do you have any advice?"),
        ("math", True, "Anna has 30 stickers and gives a fifth of them to her friend. How many stickers does she have left? "
                       "Explain step by step."),
        ("math", True, "A square garden has sides of 7 m. What are its area and perimeter? Show your work."),
    ],
}
