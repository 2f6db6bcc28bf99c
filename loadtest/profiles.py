"""Load profiles (pure functions, no locust import): how many users at each moment of a run.

Each takes (seconds since start, -u users, -r spawn rate, -t run time or None) and
returns (users, spawn rate), or None to end the run.
"""

from __future__ import annotations


def steady(t: float, users: int, rate: float, run_time: float | None):
    return None if run_time and t >= run_time else (users, rate)


def ramp(t: float, users: int, rate: float, run_time: float | None):
    duration = run_time or 60.0
    if t >= duration:
        return None
    return max(1, min(users, 1 + int(users * t / duration))), max(rate, users)


BURST_PERIOD_S, BURST_LENGTH_S = 20.0, 5.0


def burst(t: float, users: int, rate: float, run_time: float | None):
    if run_time and t >= run_time:
        return None
    in_burst = t % BURST_PERIOD_S >= BURST_PERIOD_S - BURST_LENGTH_S
    return (users if in_burst else max(1, users // 4)), max(rate, users)


PROFILES = {"steady": steady, "ramp": ramp, "burst": burst}
