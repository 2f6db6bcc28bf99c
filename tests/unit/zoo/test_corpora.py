"""Domain prompts from offline material: fixed by the seed, held-out prompts phrased unlike any training prompt, roff stripped."""

from __future__ import annotations

import random

import pytest

from cosine.zoo.corpora import (
    DOMAINS,
    HELD_OUT,
    HELD_OUT_TEMPLATES,
    _clause,
    _third_person,
    chat_prompts,
    code_prompts,
    domain_split,
    strip_roff,
)


def test_strip_roff_keeps_the_prose_and_drops_the_markup():
    page = '.TH GREP 1\n.SH NAME\ngrep \\- print lines that match patterns\n.SH DESCRIPTION\n.B grep\nsearches for \\fIPATTERNS\\fR in each\n.IR FILE .\n'
    sections = dict(strip_roff(page))
    assert sections["NAME"] == "grep - print lines that match patterns"
    assert sections["DESCRIPTION"] == "grep searches for PATTERNS in each FILE ."


@pytest.mark.parametrize("domain", ["chat", "literary"])  # code and docs read the whole stdlib / man pages: slow here
def test_split_is_fixed_by_the_seed_and_held_out_prompts_share_no_template_with_training(domain, tmp_path):
    train, held = domain_split(domain, 0, tmp_path)
    again_train, again_held = domain_split(domain, 0, tmp_path)
    assert [p.text for p in held] == [p.text for p in again_held]
    assert [p.text for p in train] == [p.text for p in again_train]
    assert len(held) == HELD_OUT and len(train) > 100
    assert not {p.text for p in held} & {p.text for p in train}
    assert {p.domain for p in train + held} == {domain}
    assert {p.template for p in held} <= HELD_OUT_TEMPLATES[domain]
    assert not {p.template for p in train} & HELD_OUT_TEMPLATES[domain]
    assert len({p.template for p in train}) >= 5  # many phrasings, not one
    assert all(p.source for p in train + held)
    other_held = domain_split(domain, 1, tmp_path)[1]
    assert [p.text for p in other_held] != [p.text for p in held]


def test_code_prompts_mix_raw_source_and_varied_instructions():
    prompts = code_prompts(40, random.Random(0))
    raw = [p for p in prompts if not p.chat]
    chat = [p for p in prompts if p.chat]
    assert raw and chat
    assert all(p.text.startswith("def ") and ('"' in p.text or "'" in p.text) for p in raw)  # a def and its docstring
    assert all(p.template.startswith("raw") for p in raw)
    assert len({p.template for p in chat}) >= 5
    assert any("Python" in p.text for p in chat) and any(p.text.startswith("Write") for p in chat)


def test_chat_prompts_are_distinct_mix_in_arithmetic_and_stop_when_the_templates_run_out():
    prompts = chat_prompts(10_000, random.Random(0))  # far more than the templates can make: must return
    assert len({p.text for p in prompts}) == len(prompts) > 100
    math = [p for p in prompts if p.template.startswith("math-")]
    assert 0.2 < len(math) / len(prompts) < 0.5
    assert all(any(ch.isdigit() for ch in p.text) for p in math)


def test_docstring_sentences_become_instructions():
    assert _clause("Return the sum of x.") == "return the sum of x"
    assert _third_person("return the sum of x") == "returns the sum of x"
    assert _third_person("match a pattern") == "matches a pattern"
    assert _third_person("copy files") == "copies files"
    assert _third_person("does nothing") == "does nothing"


def test_domains_are_the_four_of_the_issue():
    assert DOMAINS == ("code", "docs", "literary", "chat")
