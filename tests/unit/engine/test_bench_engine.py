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
            assert all((backend, case, b) in cases for b in (1, 4, 8))
    assert out["bookkeeping_us"]["native"]["cut_back_us"] < 1000


def test_bench_engine_cpu_clock_and_dtype_report(tiny_models, capsys):
    from cosine.engine.models import cpu_bf16_flags, resolve_dtype

    assert main(["--model", str(tiny_models["llama"]), "--repeats", "1", "--context", "16", "--threads", "1",
                 "--clock", "cpu", "--backends", "native,native-bf16", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clock"] == "cpu" and {r["backend"] for r in out["rows"]} == {"native", "native-bf16"}
    assert all(r["ms"] > 0 for r in out["rows"])
    assert out["auto_dtype"] == str(resolve_dtype("auto", "cpu")).replace("torch.", "") == "float32"
    assert out["cpu_bf16_flags"] == cpu_bf16_flags()
    with pytest.raises(SystemExit):
        main(["--clock", "cpu", "--threads", "2"])


def test_bench_engine_with_sampling(tiny_models, capsys):
    assert main(["--model", str(tiny_models["llama"]), "--repeats", "1", "--context", "16", "--threads", "1",
                 "--backends", "native,hf_target", "--temperature", "0.8", "--top-p", "0.9", "--seed", "4",
                 "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 4}
    assert {(r["backend"], r["case"]) for r in out["rows"]} >= {("native", "tree16"), ("hf_target", "tree16")}
    assert "native_tree16_b1_over_decode_b1" in out["summary"]
    with pytest.raises(SystemExit):  # the transformers backend is greedy only
        main(["--model", str(tiny_models["llama"]), "--temperature", "0.8"])
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_models["llama"]), "--backends", "native", "--top-p", "0"])
    assert main(["--model", str(tiny_models["llama"]), "--repeats", "1", "--context", "16", "--threads", "1",
                 "--backends", "native", "--no-progress"]) == 0
    assert "greedy" in capsys.readouterr().out.splitlines()[0]
