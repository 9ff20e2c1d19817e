"""The blocked Fisher-Yates permutation against the C++ swap loop run step by step."""

import numpy as np
import pytest

from megatron.core.datasets.fisher_yates import fisher_yates_order
from megatron.core.datasets.mersenne_twister import MT19937_64
from tests.unit_tests.datasets.cpp_mapping_reference import MersenneTwister


def swap_loop(num_items, seed):
    """`for (i = n - 1; i > 0; --i) { j = rand64() % (i + 1); swap(a[i], a[j]); }` on a = 0..n-1."""
    items, generator = list(range(num_items)), MersenneTwister(seed, 64)
    for i in range(num_items - 1, 0, -1):
        j = generator() % (i + 1)
        items[i], items[j] = items[j], items[i]
    return items


@pytest.mark.parametrize("num_items", [0, 1, 2, 3, 10, 257, 3000])
@pytest.mark.parametrize("block_steps", [1, 2, 5, 64, 1 << 20])
def test_blocked_order_equals_the_swap_loop(num_items, block_steps):
    seed = 1000 + num_items
    order = fisher_yates_order(num_items, MT19937_64(seed), block_steps)
    assert order.dtype == np.int64
    assert order.tolist() == swap_loop(num_items, seed)


def test_order_is_a_permutation_and_continues_the_generator():
    generator = MT19937_64(5)
    order = fisher_yates_order(500, generator, block_steps=37)
    assert sorted(order.tolist()) == list(range(500))
    expected = MT19937_64(5)
    expected.random_raw(499)  # one draw per step i = 499..1
    assert generator.random_raw(3).tolist() == expected.random_raw(3).tolist()
