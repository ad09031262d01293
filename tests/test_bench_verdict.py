"""The verdict rule the benchmarks apply to every ratio (examples/bench/verdict.py):
met only when the median meets the goal and 4 in 5 rounds do, not met when
the median misses and 4 in 5 rounds do, split otherwise."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "bench"))
import verdict  # noqa: E402


def test_a_goal_is_met_only_when_four_in_five_rounds_meet_it():
    assert verdict.judge([1.2, 1.3, 1.16, 1.25, 1.3], "≥ 1.15×") == "met"
    # The tiny GPT's old 1.15× (range 1.00–1.79): its median meets 1.10,
    # two rounds of five do not.
    assert verdict.judge([1.00, 1.05, 1.15, 1.5, 1.79], "≥ 1.10×") == "split"
    assert verdict.judge([1.0, 1.01, 0.99, 1.02, 1.2], "≥ 1.15×") == "not met"


def test_an_upper_bound_reads_the_other_way():
    assert verdict.judge([0.07, 0.09, 0.08, 0.13, 0.09], "≤ 0.10×") == "met"
    # The plugin row's −0.2 % with rounds from −14 % to +10 %.
    assert verdict.judge([-14.3, 9.9, 3.0, -0.2, -5.0], "≤ 0.5 %") == "split"


def test_a_split_no_more_rounds_settle_is_undecided_and_no_goal_is_no_verdict():
    assert verdict.shown("split") == "undecided"
    assert verdict.shown(verdict.judge([1.0], "—")) == "—"
    assert verdict.parse("≥ 0.9× dd") == ("≥", 0.9)
    assert verdict.parse("≤ 1.2×; ≤ 0.4 s/GB") == ("≤", 1.2)
