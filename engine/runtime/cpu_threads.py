"""Fewer CPU threads while other programs hold the cores, as many again once they let go.

The CPU kernels run each product as parallel loops that end when their slowest thread does.
When another program keeps a core busy, one of our threads waits for that core's time slice at
every loop, and a decoded token takes several times longer. On the 2-core development box, with
one core held by a busy loop, Qwen3-30B-A3B's first 8 layers decoded 2.9-3.4 tok/s on 2 threads
and 15.2 on 1 (24.6 and 14.9 with nothing else running; llama.cpp 12.8 and 18.6 with the busy
loop, 33.6 and 19.9 without). Spinning less at the loops' ends (GOMP_SPINCOUNT=3000) gave 12.7
busy but cost 14 % when idle.

ThreadGovernor instead compares decoded tokens' times at neighbouring thread counts: every so
often it runs a few tokens at one thread fewer (or, below the most, one more) and keeps that
count when its tokens were clearly faster; a try ends at its first token that is clearly slower.
A token far slower than the count's recent ones (a program just started) makes it try one fewer
at once. Tries that lose come less often, so a machine left alone pays about one slower token in
a few hundred.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TRY_TOKENS = 4  # tokens a tried count runs, and the recent tokens it is compared with
GAIN = 1.15  # a tried count is kept when its tokens are this much faster
GIVE_UP = 1.5  # a tried count's token this much slower than the one it has to beat ends the try
SLOW = 2.5  # a token this many times the recent median starts a try of one thread fewer
SLOW_TOKENS = 2  # such tokens in a row before that try
FIRST_TRY = 8  # tokens before the first try; doubled after each try that loses
LAST_TRY = 1024  # the longest wait between tries


@dataclass
class ThreadGovernor:
    """The thread count for the next decoded token, from the time of each (observe)."""
    most: int  # the count when nothing else runs: every core
    threads: int = 0  # the count now (0: most)
    wait: int = FIRST_TRY  # tokens between tries
    tokens: int = 0  # tokens at this count since it was set or last tried
    times: list[float] = field(default_factory=list)  # the last 2 * TRY_TOKENS token times at this count
    trying: int = 0  # the count on trial (0: none)
    tried: list[float] = field(default_factory=list)  # its token times
    baseline: float = 0.0  # the median token time it has to beat
    up_next: bool = False  # the next try is of one thread more (where both directions exist)

    def __post_init__(self):
        self.threads = self.threads or self.most

    def observe(self, seconds: float) -> int:
        """One decoded token's seconds at the count last returned; the count for the next."""
        if self.trying:
            self.tried.append(seconds)
            lost = seconds > GIVE_UP * self.baseline  # one such token ends the try
            if len(self.tried) < TRY_TOKENS and not lost:
                return self.trying
            if not lost and statistics.median(self.tried) * GAIN < self.baseline:  # kept
                self.threads, self.times, self.wait = self.trying, self.tried, FIRST_TRY
            else:
                self.wait = min(2 * self.wait, LAST_TRY)
            self.trying, self.tried, self.tokens = 0, [], 0
            return self.threads
        self.times = (self.times + [seconds])[-2 * TRY_TOKENS:]
        self.tokens += 1
        if len(self.times) < TRY_TOKENS:
            return self.threads
        earlier, last = self.times[:-SLOW_TOKENS], self.times[-SLOW_TOKENS:]
        if self.threads > 1 and min(last) > SLOW * statistics.median(earlier):  # something else started
            return self._try(self.threads - 1, statistics.median(last))
        if self.tokens >= self.wait:  # fewer and more in turn, where both exist
            fewer, more = self.threads > 1, self.threads < self.most
            up = more and (not fewer or self.up_next)
            self.up_next = not up
            return self._try(self.threads + 1 if up else self.threads - 1, statistics.median(self.times[-TRY_TOKENS:]))
        return self.threads

    def _try(self, n: int, baseline: float) -> int:
        self.trying, self.tried, self.baseline = n, [], baseline
        return n
