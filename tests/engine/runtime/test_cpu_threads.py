"""engine/runtime/cpu_threads.py: the governor's thread counts on stated token times."""

from moeferry.engine.runtime import cpu_threads as ct
from moeferry.engine.runtime.cpu_threads import ThreadGovernor


def decode(gov: ThreadGovernor, tokens: int, seconds) -> list[int]:
    """The count each token ran at; seconds(count, token index) is its time."""
    counts, n = [], gov.threads
    for i in range(tokens):
        counts.append(n)
        n = gov.observe(seconds(n, i))
    return counts


def test_a_machine_left_alone_keeps_every_thread_and_tries_fewer_ever_less_often():
    gov = ThreadGovernor(most=4)
    counts = decode(gov, 600, lambda n, i: 0.04 * 4 / n)  # fewer threads, slower tokens
    assert set(counts) == {3, 4}, "tries of one fewer, never more than the most"
    tries = [i for i in range(1, 600) if counts[i] == 3 and counts[i - 1] == 4]
    assert len(tries) <= 7 and counts.count(3) <= ct.TRY_TOKENS * len(tries)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0], "tries that lose come less often"
    assert gov.threads == 4


def test_a_core_held_from_the_start_takes_one_thread_and_keeps_it():
    # the 2-core box with a busy loop: 2 threads 0.35 s a token, 1 thread 0.07 s
    gov = ThreadGovernor(most=2)
    counts = decode(gov, 400, lambda n, i: 0.35 if n == 2 else 0.07)
    assert counts.index(1) <= ct.FIRST_TRY + ct.TRY_TOKENS
    later = counts[counts.index(1):]
    assert later.count(2) <= 6, "the tries of 2 threads end at their first token"
    assert gov.threads == 1


def test_a_program_that_starts_and_stops_moves_the_count_down_and_up_again():
    busy = range(100, 300)
    gov = ThreadGovernor(most=2)
    counts = decode(gov, 1200, lambda n, i: (0.35 if n == 2 else 0.07) if i in busy else (0.04 if n == 2 else 0.066))
    assert counts[99] == 2
    assert counts[100 + ct.SLOW_TOKENS + 1] == 1, "two slow tokens start a try of one fewer at once, and it is kept"
    assert all(n == 1 for n in counts[110:300] if n != 2) and counts[110:300].count(2) <= 4
    back = next(i for i in range(300, 1200) if counts[i] == 2 and counts[i + 10] == 2)
    assert back < 300 + 2 * ct.LAST_TRY
    assert gov.threads == 2


def test_a_try_ends_at_its_first_much_slower_token():
    gov = ThreadGovernor(most=2)
    counts = decode(gov, 300, lambda n, i: 0.04 if n == 2 else 0.066)
    assert counts.count(1) == len([i for i in range(1, 300) if counts[i] == 1 and counts[i - 1] == 2])


def test_a_count_between_one_and_the_most_tries_both_ways():
    gov = ThreadGovernor(most=4, threads=2)
    counts = decode(gov, 200, lambda n, i: 0.05)  # every count equal: no try wins
    assert {1, 3} <= set(counts) and gov.threads == 2
