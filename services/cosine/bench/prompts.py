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
