"""Repeated log lines counted, not repeated. Pure: no clock, no I/O.

A job's log is stored line by line, so one event that repeats (a loop in the driver, a
user's print in a loop) would grow it without bound. Lines are appended only, never
rewritten, because the service copies a job's lines once each, by sequence number. A line
*repeats* when the same level and message came within the last ``window`` lines offered, so
an event that alternates with another (a failed evaluation and its retry) is counted too,
while a line that comes back once an epoch among others is shown every time.
"""

from __future__ import annotations

from dataclasses import dataclass

SHOWN = 3  # a repeating line's first occurrences, shown as they come
WINDOW = 20  # a line again within this many lines continues its run of repeats


@dataclass
class _Run:
    count: int  # occurrences in this run
    last: int  # index of the last occurrence


def _power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


class Repeats:
    """Decides, line by line, what of a stream of ``(level, message)`` lines to log.

    A run's first ``shown`` occurrences are logged as they come; the rest are counted: a
    line ``<message> [repeated k more times so far]`` when that count reaches 10, 100,
    ..., and one ``<message> [repeated k more times in all]`` when the run ends, so each
    occurrence is either logged or in exactly one final count."""

    def __init__(self, shown: int = SHOWN, window: int = WINDOW):
        self.shown = shown
        self.window = window
        self.runs: dict[tuple[str, str], _Run] = {}
        self.offered = 0

    def offer(self, level: str, message: str) -> list[tuple[str, str]]:
        """The lines to log for this one: the final counts of runs that ended with it,
        then itself, a count of its repeats, or nothing."""
        self.offered += 1
        out = self._ended(lambda run: self.offered - run.last > self.window)
        key = (level, message)
        run = self.runs.get(key)
        if run is None:
            run = self.runs[key] = _Run(count=0, last=self.offered)
        run.count += 1
        run.last = self.offered
        more = run.count - self.shown
        if more <= 0:
            out.append(key)
        elif more >= 10 and _power_of_ten(more):
            out.append((level, f"{message} [repeated {_more(more)} so far]"))
        return out

    def flush(self) -> list[tuple[str, str]]:
        """The final counts of every run with repeats not logged (the job ends)."""
        return self._ended(lambda run: True)

    def _ended(self, ended) -> list[tuple[str, str]]:
        out = []
        for key, run in list(self.runs.items()):
            if not ended(run):
                continue
            del self.runs[key]
            if (more := run.count - self.shown) > 0:
                out.append((key[0], f"{key[1]} [repeated {_more(more)} in all]"))
        return out


def _more(n: int) -> str:
    return "1 more time" if n == 1 else f"{n} more times"
