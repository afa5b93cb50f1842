"""Left-padded [batch, width] forwards as packed kvpool steps (no torch: runs in CI)."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool.integrations.padded_batch import plan_padded_step, prompt_lens


def test_prompt_lens_from_generates_position_ids():
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    pos = np.where(mask == 1, mask.cumsum(1) - 1, 0)  # what generate passes
    np.testing.assert_array_equal(prompt_lens(pos), [2, 4, 1])


def test_right_padding_is_refused():
    mask = np.array([[1, 1, 0, 0]])
    pos = np.where(mask == 1, mask.cumsum(1) - 1, 0)
    with pytest.raises(ValueError, match="left padded"):
        prompt_lens(pos)


def test_first_forward_is_all_prefill_chunks_of_the_real_tokens():
    plan = plan_padded_step(np.zeros(3), np.array([2, 4, 1]), 4)
    assert plan.decode_rows.tolist() == [] and plan.prefill_rows.tolist() == [0, 1, 2]
    assert plan.gather.tolist() == [2, 3, 4, 5, 6, 7, 11]


def test_decode_rows_come_first_and_finished_rows_are_left_out():
    plan = plan_padded_step(np.array([5, 0, 3, 7]), np.array([1, 1, 0, 1]), 1)
    assert plan.decode_rows.tolist() == [0, 3]
    assert plan.prefill_rows.tolist() == [1]  # a first token is a prefill, not a decode
    assert plan.gather.tolist() == [0, 3, 1]
    assert plan.num_tokens == 3


def test_a_chunk_on_a_cached_prefix_is_a_prefill():
    plan = plan_padded_step(np.array([4, 4]), np.array([3, 3]), 3)
    assert plan.prefill_rows.tolist() == [0, 1] and plan.gather.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("cached", "new", "width"), [([0], [5], 4), ([-1], [1], 1), ([0, 0], [1], 1)]
)
def test_bad_plans_raise(cached, new, width):
    with pytest.raises(ValueError):
        plan_padded_step(np.array(cached), np.array(new), width)
