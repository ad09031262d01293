"""The rule every bench applies to every ratio with a goal (issue 61): a
goal is met when the median of the per-round ratios meets it and at least
4 in 5 of the rounds do; it is not met when the median misses it and 4 in 5
of the rounds do. Anything between is split: the benches that can run
more rounds do (up to MAX_ROUNDS), and a ratio still split there is
"undecided". A ratio inside its own noise is never called met.
"""
import math
import re
import statistics

MIN_ROUNDS, MAX_ROUNDS = 5, 15
SHARE = 0.8


def parse(goal: str):
    """("≥" or "≤", the number) of a goal's first clause ("≥ 1.15×",
    "≤ 0.5 %", "≥ 0.9× dd"); None for "—" or none at all."""
    found = re.match(r"\s*([≥≤])\s*([0-9.]+)", goal or "")
    return (found.group(1), float(found.group(2))) if found else None


def judge(values: list[float], goal: str) -> str:
    """"met", "not met", "split", or "—" where there is no goal. `values`
    are per-round ratios in the goal's own unit (a per cent goal takes per
    cents)."""
    parsed = parse(goal)
    if parsed is None or not values:
        return "—"
    sign, target = parsed
    meets = [(v >= target) if sign == "≥" else (v <= target) for v in values]
    median = statistics.median(values)
    median_meets = median >= target if sign == "≥" else median <= target
    enough = math.ceil(SHARE * len(values))
    if median_meets and sum(meets) >= enough:
        return "met"
    if not median_meets and meets.count(False) >= enough:
        return "not met"
    return "split"


def shown(verdict: str) -> str:
    """What a table prints: a split that no more rounds can settle is undecided."""
    return "undecided" if verdict == "split" else verdict
