"""Progress of long work: plain lines with an ETA when not on a terminal, a tqdm bar on one; the closing line of
`cosine generate`."""

import io
import time

import pytest

from cosine.cli import summary_line
from cosine.client import target_passes
from cosine.common.progress import Progress

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_without_a_terminal_say_elapsed_eta_and_phase():
    out, clock = io.StringIO(), Clock()
    p = Progress("cosine zoo build", expected_s=600, file=out, tty=False, interval=3600, clock=clock)
    p.phase("code: the target writes training data")
    clock.t += 125
    p.note("code: the target wrote 4096 tokens")  # a note alone prints nothing: the heartbeat does
    assert out.getvalue().count("\n") == 1
    assert p.status() == "[cosine zoo build] 2m05s elapsed, about 7m55s left — code: the target wrote 4096 tokens"
    clock.t += 600
    assert "finishing" in p.status()  # past the plan, no negative ETA
    p.close("built 1 of 1 drafter(s)")
    p.close("twice")  # idempotent
    lines = out.getvalue().splitlines()
    assert lines[0] == "[cosine zoo build] 0s elapsed, about 10m00s left — code: the target writes training data"
    assert lines[-1] == "[cosine zoo build] built 1 of 1 drafter(s) (12m05s)"


def test_phase_replans_the_eta():
    clock = Clock()
    p = Progress("x", expected_s=60, file=io.StringIO(), tty=False, interval=3600, clock=clock)
    clock.t += 50
    p.phase("evaluating", expected_s=120)  # the rest takes 120 s from now
    assert p.eta() == pytest.approx(120)
    p.close()


def test_the_heartbeat_prints_while_the_work_blocks():
    out = io.StringIO()
    with Progress("cosine zoo prepare", expected_s=60, file=out, tty=False, interval=0.05) as p:
        p.phase("target: saving safetensors")
        time.sleep(0.4)  # the main thread inside one long call: lines must still come
    lines = [l for l in out.getvalue().splitlines() if "saving safetensors" in l]
    assert len(lines) >= 4, out.getvalue()


def test_on_a_terminal_it_is_a_bar_with_the_remaining_time():
    out = io.StringIO()
    p = Progress("cosine zoo build", expected_s=1200, file=out, tty=True)
    p.phase("code (1/1): training the drafter")
    p.close("built 1 of 1 drafter(s)")
    text = out.getvalue()
    assert "cosine zoo build:" in text and "<" in text and "training the drafter" in text
    assert "built 1 of 1" in text


def _result(rounds, drafted, accepted, n):
    return {"finish_reason": "length", "token_ids": [0] * n, "tokens_per_s": 10.0,
            "stats": {"rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
                      "target_passes": target_passes(n, accepted), "tokens_per_target_pass": n / target_passes(n, accepted)}}


def test_generate_closing_line_reports_tokens_per_target_pass():
    line = summary_line(_result(rounds=80, drafted=90, accepted=48, n=128))  # 80 passes: 48 accepted + 80 own
    assert "128 tokens in 80 target passes (1.60 tokens per pass; plain decoding makes 1.00)" in line
    assert "48/90 drafted tokens accepted" in line
    plain = summary_line(_result(rounds=9, drafted=0, accepted=0, n=32))  # decode runs: 32 passes in 9 rounds
    assert "32 tokens in 32 target passes (nothing drafted: plain decoding)" in plain
