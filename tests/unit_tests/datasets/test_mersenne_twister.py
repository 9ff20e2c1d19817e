"""The numpy `std::mt19937` / `std::mt19937_64` streams against the C++ standard's fixed values and a
scalar pure-Python twister."""

import numpy as np
import pytest

from megatron.core.datasets.mersenne_twister import MT19937_64, mt19937_stream
from tests.unit_tests.datasets.cpp_mapping_reference import MersenneTwister


def test_the_10000th_outputs_required_by_the_cpp_standard():
    # [rand.predef]: a default-constructed (seed 5489) mt19937 / mt19937_64 has these 10000th outputs.
    assert int(mt19937_stream(5489).random_raw(10000)[-1]) == 4123659995
    assert int(MT19937_64(5489).random_raw(10000)[-1]) == 9981545732273789042


def test_the_first_mt19937_outputs():
    # The well-known start of the default-seeded stream (the hand-worked mapping example uses them).
    assert mt19937_stream(5489).random_raw(5).tolist() == [3499211612, 581869302, 3890346734, 3586334585, 545404204]


@pytest.mark.parametrize("seed", [1, 2, 1235, 2**31 - 2])
def test_streams_equal_a_scalar_twister(seed):
    reference32, reference64 = MersenneTwister(seed, 32), MersenneTwister(seed, 64)
    assert mt19937_stream(seed).random_raw(1500).tolist() == [reference32() for _ in range(1500)]
    assert MT19937_64(seed).random_raw(1000).tolist() == [reference64() for _ in range(1000)]


def test_mt19937_64_reads_the_same_stream_in_any_pieces():
    whole = MT19937_64(77).random_raw(2000)
    generator = MT19937_64(77)
    pieces = [generator.random_raw(count) for count in (0, 1, 311, 1, 312, 700, 675)]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert all(piece.dtype == np.uint64 for piece in pieces)


def test_seeds_out_of_range_are_refused():
    with pytest.raises(ValueError, match="32-bit"):
        mt19937_stream(2**32)
    with pytest.raises(ValueError, match="64-bit"):
        MT19937_64(-1)
