"""Tests for switch.py (pure, instant). To be merged into test_whale.py."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from switch import Fixed, Patience, epochs_to_steps, parse_schedule, smoothed  # noqa: E402


def first_done(policy, rewards, steps_per_epoch):
    """Length of the shortest prefix after which phase A ends (None: never)."""
    for n in range(1, len(rewards) + 1):
        if policy.weight_done(rewards[:n], steps_per_epoch):
            return n
    return None


def first_harness_done(policy, best_scores):
    for n in range(1, len(best_scores) + 1):
        if policy.harness_done(best_scores[:n]):
            return n
    return None


# ---- Fixed ------------------------------------------------------------------

def test_epochs_to_steps_rounds_half_up_and_at_least_one():
    assert epochs_to_steps(0.6, 70) == 42 and epochs_to_steps(0.2, 70) == 14
    assert epochs_to_steps(0.5, 5) == 3            # 2.5 -> 3 (not banker's 2)
    assert epochs_to_steps(0.35, 10) == 4          # 3.5 after float error
    assert epochs_to_steps(0.2, 12) == 2           # 2.4 -> 2
    assert epochs_to_steps(0.2, 13) == 3           # 2.6 -> 3
    assert epochs_to_steps(0.01, 3) == 1           # 0.03 -> at least 1
    with pytest.raises(ValueError):
        epochs_to_steps(0.2, 0)


def test_fixed_weight_boundary_epochs():
    p = Fixed(0.6, 6)
    assert not p.weight_done([0.1] * 41, 70)
    assert p.weight_done([0.1] * 42, 70)
    assert Fixed(0.01, 6).weight_done([0.0], 3)    # rounds to 0 steps -> 1


def test_fixed_weight_boundary_steps_ignores_epoch_size():
    p = Fixed(E_steps=3, I=4)
    assert not p.weight_done([0.5, 0.5], 1000)
    assert p.weight_done([0.5, 0.5, 0.5], 1000)
    assert p.weight_steps(1) == 3


def test_fixed_harness_boundary_counts_incoming_eval():
    p = Fixed(0.6, 6)
    assert not p.harness_done([0.3])               # only the incoming evaluation
    assert not p.harness_done([0.3] * 5)
    assert p.harness_done([0.3] * 6)
    assert Fixed(0.6, 1).harness_done([0.3])       # I=1: evaluate and move on


def test_fixed_rejects_bad_arguments():
    for kw in [dict(), dict(E=0.6, E_steps=3), dict(E=0.0), dict(E=-1.0), dict(E=float("nan")),
               dict(E=float("inf")), dict(E_steps=0), dict(E_steps=2.5), dict(E=0.6, I=0)]:
        with pytest.raises(ValueError):
            Fixed(**kw)


# ---- Patience, weight side -------------------------------------------------

def test_smoothed_uses_what_exists_before_window_fills():
    assert smoothed([1.0, 0.0, 0.5, 0.5], 2) == [1.0, 0.5, 0.25, 0.5]
    assert smoothed([0.25, 0.5, 0.75], 5) == [0.25, 0.375, 0.5]


def test_default_weight_params_are_a_fifth_of_an_epoch():
    # 10 steps/epoch -> W = P_w = M = 2. A flat curve: best at step 1 (the first
    # smoothed value), no new best at steps 2, 3 -> ends after step 3.
    assert first_done(Patience(), [0.5] * 10, 10) == 3
    # 70 steps/epoch -> 14: best at step 1, ends after 14 more flat steps.
    assert first_done(Patience(), [0.5] * 40, 70) == 15
    # Tiny pool: 0.2 epoch of 2 steps rounds to 0 -> 1.
    assert first_done(Patience(), [0.5] * 5, 2) == 2


def test_rising_sequence_never_stops():
    rising = [i / 100 for i in range(100)]
    assert first_done(Patience(), rising, 10) is None
    assert first_done(Patience(), rising, 70) is None
    assert first_done(Patience(w=7, pw=1, min_w=1), rising, 10) is None


def test_plateau_stops_exactly_after_pw_steps_without_new_best():
    r = [0.125, 0.25, 0.375] + [0.375] * 10        # best at step 3
    assert first_done(Patience(w=1, pw=3, min_w=1), r, 100) == 6
    assert first_done(Patience(w=1, pw=5, min_w=1), r, 100) == 8
    # With W=3 the smoothed curve reaches the plateau W-1 steps later (step 5).
    r = [0.25, 0.5] + [0.75] * 10                  # smoothed: .25 .375 .5 .667 .75 .75 ...
    assert first_done(Patience(w=3, pw=3, min_w=1), r, 100) == 8


def test_flat_curve_float_rounding_is_not_progress():
    # mean of three 0.1s is 0.10000000000000002 > 0.1; must not reset patience
    assert first_done(Patience(w=3, pw=2, min_w=1), [0.1] * 10, 100) == 3


def test_min_length_holds_a_stale_phase_open():
    p = Patience(w=1, pw=1, min_w=5)
    assert first_done(p, [0.5] * 10, 100) == 5     # stale since step 2, min 5


def test_noise_that_sets_new_smoothed_bests_keeps_going():
    # Alternating noise over a slow drift: raw values dip every other step, but
    # the 2-step mean sets a new strict best every 2 steps: .5 .5 .5625 .5625 .625 ...
    r = [0.5, 0.5, 0.625, 0.5, 0.75, 0.5, 0.875, 0.5]
    assert first_done(Patience(w=2, pw=2, min_w=2), r, 100) is None


def test_noise_that_does_not_set_a_new_smoothed_best_stops():
    # Noise around 0.5: smoothed .5 .5625 .5 .5 .5 .5 -> best at step 2, stale at 4.
    r = [0.5, 0.625, 0.375, 0.625, 0.375, 0.625]
    assert first_done(Patience(w=2, pw=2, min_w=2), r, 100) == 4


def test_smoothing_window_absorbs_a_single_lucky_step():
    # Rise to 0.6, fall back to 0.5, then one lucky 0.7 at step 8. The lucky raw
    # value beats the raw best (0.6) but its 3-step mean (.567) does not beat the
    # smoothed best (.6 at step 5), so patience keeps counting from step 5.
    lucky = [0.4, 0.5, 0.6, 0.6, 0.6, 0.5, 0.5, 0.7] + [0.5] * 6
    plain = lucky[:7] + [0.5] + [0.5] * 6
    assert lucky[7] > max(lucky[:7])
    assert max(smoothed(lucky, 3)[5:]) < smoothed(lucky, 3)[4]
    smooth = Patience(w=3, pw=4, min_w=1)
    assert first_done(smooth, lucky, 100) == first_done(smooth, plain, 100) == 9
    # Without smoothing the same lucky step resets patience and buys 5 more steps.
    raw = Patience(w=1, pw=5, min_w=1)
    assert first_done(raw, plain, 100) == 8
    assert first_done(raw, lucky, 100) == 13


def test_best_is_the_phases_own():
    # A phase that starts lower than anything before it is still judged on its
    # own curve: its first value is its best, and only staleness ends it.
    p = Patience(w=1, pw=2, min_w=1)
    assert not p.weight_done([0.1], 100)
    assert not p.weight_done([0.1, 0.05], 100)
    assert p.weight_done([0.1, 0.05, 0.1], 100)


# ---- Patience, harness side ------------------------------------------------

def test_harness_minimum_six_iterations():
    flat = [0.3] * 20                               # stale from iteration 3 on
    assert first_harness_done(Patience(), flat) == 6


def test_harness_patience_two_after_minimum():
    s = [0.3, 0.3, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6, 0.6]   # last new best at iteration 6
    assert first_harness_done(Patience(), s) == 8
    s = [0.3, 0.3, 0.3, 0.3, 0.4, 0.4, 0.4]             # best at 5 -> stale at 7
    assert first_harness_done(Patience(), s) == 7
    # an improvement at iteration 7 restarts the count
    s = [0.3, 0.3, 0.3, 0.3, 0.4, 0.4, 0.45, 0.45, 0.45]
    assert first_harness_done(Patience(), s) == 9


def test_harness_cap_fifteen():
    improving = [i / 100 for i in range(30)]       # a new best every iteration
    assert first_harness_done(Patience(), improving) == 15
    assert not Patience().harness_done(improving[:14])


def test_harness_custom_params():
    assert first_harness_done(Patience(ph=1, min_h=1, max_h=3), [0.5, 0.5, 0.5]) == 2
    assert first_harness_done(Patience(ph=5, min_h=2, max_h=4), [0.5] * 9) == 4


def test_patience_rejects_bad_arguments():
    for kw in [dict(w=0), dict(pw=-1), dict(min_w=1.5), dict(ph=0), dict(min_h=0),
               dict(max_h=None), dict(min_h=7, max_h=6), dict(ph=True)]:
        with pytest.raises(ValueError):
            Patience(**kw)


# ---- parse_schedule ---------------------------------------------------------

def test_parse_schedule_good():
    assert parse_schedule("fixed:0.6,6") == Fixed(0.6, 6)
    assert parse_schedule(" fixed : 0.2 , 6 ") == Fixed(0.2, 6)
    assert parse_schedule("fixed") == Fixed(0.6, 6)
    assert parse_schedule("fixed-steps:3,4") == Fixed(E_steps=3, I=4)
    assert parse_schedule("adaptive") == Patience()
    assert parse_schedule("ADAPTIVE:") == Patience()
    assert parse_schedule("adaptive:w=2,pw=2,ph=2,min_h=6,max_h=15") == Patience(w=2, pw=2)
    assert parse_schedule("adaptive:min_w=3, ph=3") == Patience(min_w=3, ph=3)


@pytest.mark.parametrize("bad", [
    "", "fixd:0.6,6", "fixed:0.6", "fixed:0.6,6,1", "fixed:abc,6", "fixed:0.6,6.5",
    "fixed:0,6", "fixed:-0.2,6", "fixed:nan,6", "fixed:0.6,0", "fixed-steps:2.5,4",
    "fixed-steps:0,4", "fixed-steps", "adaptive:w", "adaptive:w=0", "adaptive:x=2",
    "adaptive:w=2,w=3", "adaptive:ph=1.5", "adaptive:min_h=9,max_h=8", "adaptive:E=2",
])
def test_parse_schedule_bad(bad):
    with pytest.raises(ValueError, match="bad schedule"):
        parse_schedule(bad)


def test_parse_schedule_error_says_what_is_accepted():
    with pytest.raises(ValueError) as e:
        parse_schedule("adaptive:x=2")
    msg = str(e.value)
    assert "'x=2'" in msg and "fixed:E,I" in msg and "adaptive:w=" in msg
