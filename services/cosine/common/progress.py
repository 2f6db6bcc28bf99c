"""Progress of long command-line work (model preparation, the zoo build), on a terminal or in a log.

On a terminal it is a tqdm bar over the expected seconds, so tqdm shows the elapsed time and the ETA. When stderr is
not a terminal (CI, `| tee`, a container log) a bar prints nothing useful, so a heartbeat thread writes one plain
line every `interval` seconds instead (and one at each new phase). Either way the display moves while the main
thread sits inside one long call (a forward pass, `save_pretrained`), because the heartbeat, not the work, drives it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _quiet_transformers() -> bool:
    """Silence transformers' own bars (GGUF conversion, weight loading, "Writing model shards") while this display
    runs: without a terminal they print carriage-return soup, and with one they break this bar. True if they were on."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return False
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    return was_on


class Progress:
    """`with Progress("cosine zoo build", expected_s=1200) as p: p.phase("code: generating"); ...`

    `expected_s` is the whole work's planned duration (a time budget, or an estimate); the ETA is what is left of it,
    and after the plan runs out it says "finishing". `phase(text)` names what runs now; `set_postfix_str` is the
    same call under tqdm's name, so code written for a tqdm bar can take this instead.
    """

    def __init__(self, desc: str, expected_s: float, *, interval: float = 10.0, file: TextIO | None = None,
                 tty: bool | None = None, clock=time.monotonic):
        self.desc = desc
        self.expected_s = max(1.0, float(expected_s))
        self.interval = interval
        self.file = file if file is not None else sys.stderr
        self.tty = self.file.isatty() if tty is None else tty
        self._clock = clock
        self._t0 = clock()
        self._phase = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        self._hf_bars = _quiet_transformers()
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=round(self.expected_s), desc=desc, unit="s", file=self.file, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed}<{remaining} {postfix}")
        self._thread = threading.Thread(target=self._beat, name=f"progress:{desc}", daemon=True)
        self._thread.start()

    # --- what the work calls --------------------------------------------------------------------------------

    def phase(self, text: str, *, expected_s: float | None = None) -> None:
        """Name the step that runs now; `expected_s` re-plans the whole work's duration from here on."""
        with self._lock:
            self._phase = text
            if expected_s is not None:
                self.expected_s = max(1.0, self.elapsed() + float(expected_s))
        if self._bar is not None:
            self._refresh()
        else:
            self._line()

    def note(self, text: str) -> None:
        """Update what runs now without a line of its own (many small updates: tokens written, training steps)."""
        with self._lock:
            self._phase = text
        if self._bar is not None:
            self._refresh()

    set_postfix_str = note

    def update(self, n: int = 1) -> None:  # tqdm's name; time, not steps, drives this display
        return None

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def eta(self) -> float:
        return max(0.0, self.expected_s - self.elapsed())

    def status(self) -> str:
        """One line: what, how long so far, how long left, what runs now."""
        left = self.eta()
        eta = f"about {_duration(left)} left" if left > 0 else "finishing"
        with self._lock:
            phase = self._phase
        return f"[{self.desc}] {_duration(self.elapsed())} elapsed, {eta}" + (f" — {phase}" if phase else "")

    def close(self, final: str | None = None) -> None:
        if self._stop.is_set():
            return  # closed already (an explicit close, then the `with` block's)
        self._stop.set()
        self._thread.join(timeout=2)
        if self._bar is not None:
            self._bar.n = min(self._bar.total, round(self.elapsed()))
            if final:
                self._bar.set_postfix_str(final, refresh=False)
            self._bar.close()
            self._bar = None
        elif final:
            print(f"[{self.desc}] {final} ({_duration(self.elapsed())})", file=self.file, flush=True)
        if self._hf_bars:
            from transformers.utils import logging as hf_logging

            hf_logging.enable_progress_bar()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the heartbeat --------------------------------------------------------------------------------------

    def _line(self) -> None:
        print(self.status(), file=self.file, flush=True)

    def _refresh(self) -> None:
        bar = self._bar
        if bar is None:
            return
        with self._lock:
            bar.total = max(round(self.expected_s), round(self.elapsed()) + 1)
            phase = self._phase
        bar.n = round(self.elapsed())
        bar.set_postfix_str(phase, refresh=False)
        bar.refresh()

    def _beat(self) -> None:
        period = 0.5 if self._bar is not None else self.interval
        while not self._stop.wait(period):
            if self._bar is not None:
                self._refresh()
            else:
                self._line()
