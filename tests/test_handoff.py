"""The one-use hand-off between two TRL hooks (PPO's rewards, its pending critic update): a value is taken once,
and a missing or doubled value stops the run naming the hand-off instead of training on the previous batch's."""

import pytest

from trl_scale.handoff import Handoff


def test_a_value_is_taken_once():
    handoff = Handoff("rewards")
    handoff.give([1.0])
    assert handoff.take() == [1.0]
    with pytest.raises(RuntimeError, match="rewards was not given before it was needed.*trl_scale/seams"):
        handoff.take()  # the previous batch's value is gone


def test_a_second_value_before_the_first_is_used_is_refused():
    handoff = Handoff("rewards")
    handoff.give(1)
    with pytest.raises(RuntimeError, match="rewards was given twice before it was used"):
        handoff.give(2)


def test_clear_and_take_if_given():
    handoff = Handoff("critic update")
    assert handoff.take_if_given() is None
    handoff.give("pending")
    handoff.clear()  # a failed step's leftover
    assert handoff.take_if_given() is None
    handoff.give(None)  # a value that is None still counts as given
    with pytest.raises(RuntimeError):
        handoff.give(0)


def test_take_if_given_empties_the_handoff():
    """PPO clears its critic hand-off at each step's start, which would hide a `take_if_given` that leaves the value
    in place: taken once, it is gone, and the next step can give again."""
    handoff = Handoff("critic update")
    handoff.give("step 1")
    assert handoff.take_if_given() == "step 1"
    assert handoff.take_if_given() is None  # not the previous step's value again
    handoff.give("step 2")  # not "given twice"
    assert handoff.take() == "step 2"
