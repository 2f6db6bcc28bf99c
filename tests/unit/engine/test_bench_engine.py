"""`cosine bench engine` runs end to end (on a tiny model here; the real run uses the zoo's target)."""

from __future__ import annotations

import json

import pytest

from cosine.bench.engine import main

pytestmark = pytest.mark.unit


def test_bench_engine_smoke(tiny_models, capsys):
    assert main(["--model", str(tiny_models["llama"]), "--repeats", "1", "--context", "16", "--threads", "1",
                 "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    cases = {(r["backend"], r["case"], r["batch"]) for r in out["rows"]}
    for backend in ("native", "transformers", "hf_target"):
        for case in ("decode", "chain4", "tree16"):
            assert (backend, case, 1) in cases and (backend, case, 8) in cases
    assert out["bookkeeping_us"]["native"]["cut_back_us"] < 1000
