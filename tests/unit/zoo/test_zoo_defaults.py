"""What the local cluster drafts with by default: suffix decoding plus the domain drafters the zoo has built
(prompt lookup runs too, by name only)."""

from __future__ import annotations

import json

from cosine.cluster import ClusterSpec, zoo_drafters


def _card(root, name, kind, domain):
    d = root / "models" / name
    d.mkdir(parents=True)
    (d / "cosine.json").write_text(json.dumps({"name": name, "kind": kind, "domain": domain}))


def test_before_a_build_the_untrained_drafter_stands_in(tmp_path, monkeypatch):
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path))
    _card(tmp_path, "smollm2-2layer", "lm", "general")
    assert [(d.name, d.kind) for d in zoo_drafters()] == [("suffix", "suffix"), ("lm-2layer", "lm"), ("ngram", "ngram")]


def test_built_domain_drafters_are_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path))
    _card(tmp_path, "smollm2-2layer", "lm", "general")
    _card(tmp_path, "lm-code", "lm", "code")
    _card(tmp_path, "lm-chat", "lm", "chat")
    drafters = zoo_drafters()
    assert [(d.name, d.domain) for d in drafters] == [("suffix", "general"), ("lm-chat", "chat"), ("lm-code", "code"),
                                                      ("ngram", "general")]
    assert all(d.model == d.name for d in drafters if d.kind == "lm")
    assert ClusterSpec().default_drafters is None  # the router's candidates: the drafters marked default
    assert [d.name for d in drafters if d.default] == ["suffix", "lm-chat", "lm-code"]  # not prompt lookup
