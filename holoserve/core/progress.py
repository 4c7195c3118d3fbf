"""Progress of a long command on stderr: one overall bar with an ETA across the command's phases, and a bar
per phase that stays in the scrollback when it ends.

When stderr is not a terminal (CI, `docker logs`, a file), no bar is drawn (a redrawn bar is a stream of
carriage returns there); each phase instead logs one plain line at most every `interval` seconds, with
its count, the overall share and the ETA. The command opens a `Progress` with the work it plans (in units
of roughly equal cost, e.g. training steps) and makes it current (`with progress:`); the code doing the
work asks `current()` for a phase and ticks it, so it needs no progress argument of its own.

tqdm (the compress and export extras) is imported only when a bar is drawn.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Iterator, Sequence, TextIO, TypeVar

T = TypeVar("T")
PLAIN_INTERVAL = 30.0  # seconds between a phase's plain log lines when stderr is not a terminal


def _clock(seconds: float) -> str:
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """A command's progress: `planned` units of work in all, advanced by the phases it opens."""

    def __init__(self, planned: float = 0.0, *, enabled: bool = True, desc: str = "overall",
                 stream: TextIO | None = None, tty: bool | None = None, interval: float = PLAIN_INTERVAL):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.desc = desc
        self.planned, self.done = float(planned), 0.0
        self.t0 = time.monotonic()
        self._bar = None
        self._redirect = None
        self._previous: Progress | None = None
        self._entered = False
        self.open_phases = 0  # phases drawn now (a phase inside a phase draws below it)

    # -- the overall share
    @property
    def bars(self) -> bool:
        return self.enabled and self.tty

    def add(self, units: float) -> None:
        """Plan more work: the command's phases once it knows them, or a phase longer than planned."""
        self.planned += units
        if self._bar is not None:
            self._bar.total = self._scaled(self.planned)
            self._bar.refresh()
        elif self._entered:
            self._open_bar()

    def _open_bar(self) -> None:
        if not (self.bars and self.planned > 0 and self._bar is None):
            return
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._redirect = logging_redirect_tqdm()  # log lines print above the bars, not through them
        self._redirect.__enter__()
        self._bar = tqdm(total=self._scaled(self.planned), initial=self._scaled(self.done), desc=self.desc,
                         position=0, leave=True, file=self.stream, dynamic_ncols=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

    def advance(self, units: float) -> None:
        if units <= 0:
            return
        if self.done + units > self.planned:
            self.add(self.done + units - self.planned)
        before = self._scaled(self.done)
        self.done += units
        if self._bar is not None:
            self._bar.update(self._scaled(self.done) - before)

    def share(self) -> float:
        return self.done / self.planned if self.planned > 0 else 0.0

    def eta(self) -> float | None:
        """Seconds left at the rate so far, or None before any work is done."""
        if self.done <= 0 or self.planned <= 0:
            return None
        return (time.monotonic() - self.t0) * (self.planned - self.done) / self.done

    def summary(self) -> str:
        if self.planned <= 0:
            return ""
        eta = self.eta()
        return f"overall {100 * self.share():.0f} %" + (f", ETA {_clock(eta)}" if eta is not None else "")

    @staticmethod
    def _scaled(units: float) -> int:
        return int(round(units * 100))

    def say(self, line: str) -> None:
        """One plain progress line on the stream, time-stamped like the commands' log lines."""
        self.stream.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        self.stream.flush()

    # -- phases
    def phase(self, name: str, total: int | None, *, unit: str = "step", weight: float = 1.0, initial: int = 0,
              enabled: bool = True) -> "Phase":
        """A phase of `total` ticks (None: one indeterminate step), each worth `weight` planned units."""
        return Phase(self, name, total, unit, weight, initial, enabled and self.enabled)

    # -- lifetime
    def __enter__(self) -> "Progress":
        global _CURRENT
        self._previous, _CURRENT = _CURRENT, self
        self.t0 = time.monotonic()
        self._entered = True
        self._open_bar()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _CURRENT
        if self._bar is not None:
            if exc[0] is None:
                self._bar.update(self._bar.total - self._bar.n)
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.__exit__(*exc)
            self._redirect = None
        self._entered = False
        if _CURRENT is self:
            _CURRENT = self._previous


class Phase:
    """One phase's bar (terminal) or plain log lines (otherwise); also advances the overall progress."""

    def __init__(self, owner: Progress, name: str, total: int | None, unit: str, weight: float, initial: int,
                 enabled: bool):
        self.owner, self.name, self.unit, self.weight = owner, name, unit, weight
        self.total, self.n = total, initial
        self.enabled = enabled
        if initial:  # resumed: what was done before is no longer ahead
            owner.planned = max(owner.done, owner.planned - initial * weight)
        self.t0 = self.last_line = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self._bar = None
        if enabled and owner.tty:
            from tqdm.auto import tqdm

            position = owner.open_phases + (1 if owner._bar is not None else 0)
            owner.open_phases += 1
            # an indeterminate phase: a full-width bar of one step, so that its last line covers what it replaces
            fmt = {} if total is not None else {"bar_format": "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]"}
            self._bar = tqdm(total=total if total is not None else 1, initial=initial, desc=name, unit=unit,
                             position=position, leave=True, file=owner.stream, dynamic_ncols=True, **fmt)
        elif enabled and total is None:  # nothing to count: say that it runs
            self.owner.say(self.line())

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        self.owner.advance(n * self.weight)
        if postfix:
            self.postfix = postfix
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)
            if self.owner._bar is not None:
                self.owner._bar.refresh()
        elif self.enabled and time.monotonic() - self.last_line >= self.owner.interval:
            self.last_line = time.monotonic()
            self.owner.say(self.line())

    def line(self) -> str:
        """The plain progress line: `[name] n/total unit (share), elapsed, ETA | overall share, ETA`."""
        elapsed = time.monotonic() - self.t0
        if self.total:
            plural = self.unit + ("es" if self.unit.endswith(("s", "ch", "sh", "x")) else "s")
            done = f"{self.n}/{self.total} {plural} ({100 * self.n / self.total:.0f} %)"
            eta = f", ETA {_clock(elapsed * (self.total - self.n) / self.n)}" if self.n else ""
        else:
            done, eta = "running", ""
        extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
        overall = self.owner.summary()
        return f"[{self.name}] {done}, {_clock(elapsed)} elapsed{eta}{extra}" + (f" | {overall}" if overall else "")

    def close(self) -> None:
        if self.total is None and self.n == 0:  # an indeterminate phase counts once, when it ends
            self.n = 1
            self.owner.advance(self.weight)
            if self._bar is not None:
                self._bar.update(1)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self.owner.open_phases -= 1

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_CURRENT: Progress | None = None


def current() -> Progress:
    """The progress the running command opened, or a stand-alone one (phase bars or lines, no overall bar)."""
    return _CURRENT if _CURRENT is not None else Progress()


def counted(items: Sequence[T], name: str, unit: str = "batch") -> Iterator[T]:
    """`items`, each one ticking a progress phase called `name` (its work is planned by the caller's step)."""
    with current().phase(name, len(items), unit=unit, weight=0.0) as bar:
        for item in items:
            yield item
            bar.update(1)


class StepBar:
    """A command made of named steps, shown like a tqdm bar on `progress`: `set_postfix_str(name)` starts the
    step called `name` (a phase bar, or a plain line when stderr is not a terminal), `update(n)` finishes n
    planned steps, `close()` ends the last step."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self._phase: Phase | None = None

    def set_postfix_str(self, name: str) -> None:
        self._end()
        self._phase = self.progress.phase(name, None, weight=0.0)

    def update(self, n: int = 1) -> None:
        self._end()
        self.progress.advance(n)

    def _end(self) -> None:
        if self._phase is not None:
            self._phase.close()
            self._phase = None

    def close(self) -> None:
        self._end()
