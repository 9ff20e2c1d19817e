"""The raw outputs of C++'s `std::mt19937` and `std::mt19937_64`, in numpy.

Megatron's `helpers.cpp` draws the BERT/T5 target sample lengths from `std::mt19937(seed)` and shuffles
the sample mapping with `std::mt19937_64(seed + 1)`, using the generators' raw outputs. Reproducing its
mapping bit for bit needs the same streams:

* 32-bit: numpy's `MT19937` bit generator is the same generator, but `np.random.MT19937(seed)` seeds it
  through a `SeedSequence`. `RandomState(seed)` seeds it as C++ does (`init_genrand`: Knuth's
  multiplier 1812433253), so we take that state and read `random_raw()`, which returns the engine's
  32-bit outputs as they are (no conversion to floats or bounded integers).
* 64-bit: numpy has no `mt19937_64`; `MT19937_64` below implements it (Matsumoto & Nishimura's 64-bit
  variant, the parameters of C++ [rand.predef]) with the state twist vectorised.

The C++ standard fixes the 10000th output of each default-seeded (5489) engine, 4123659995 and
9981545732273789042; the tests check both.
"""

import numpy as np


def mt19937_stream(seed: int) -> np.random.MT19937:
    """A numpy `MT19937` in the state of C++ `std::mt19937(seed)`; `.random_raw(n)` gives its next n
    outputs (uint64 arrays holding 32-bit values)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"std::mt19937 seeds are 32-bit unsigned integers, got {seed}")
    _, key, position, _, _ = np.random.RandomState(seed).get_state(legacy=True)
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": position}}
    return generator


_N = 312  # state words
_M = 156  # middle word offset
_MATRIX_A = np.uint64(0xB5026F5AA96619E9)
_UPPER_MASK = np.uint64(0xFFFFFFFF80000000)  # the top 33 bits
_LOWER_MASK = np.uint64(0x000000007FFFFFFF)  # the low 31 bits
_ONE = np.uint64(1)


class MT19937_64:
    """C++ `std::mt19937_64(seed)`: `random_raw(n)` returns its next n outputs as a uint64 array."""

    def __init__(self, seed: int):
        if not 0 <= seed < 2**64:
            raise ValueError(f"std::mt19937_64 seeds are 64-bit unsigned integers, got {seed}")
        state = [seed]
        for index in range(1, _N):
            previous = state[-1]
            state.append((6364136223846793005 * (previous ^ (previous >> 62)) + index) & 0xFFFFFFFFFFFFFFFF)
        self._state = np.array(state, dtype=np.uint64)
        self._buffer = np.empty(0, dtype=np.uint64)  # tempered outputs of the last twist not yet returned

    @staticmethod
    def _mix(current: np.ndarray, following: np.ndarray, middle: np.ndarray) -> np.ndarray:
        """`middle ^ A(upper(current) | lower(following))`, A = shift right by one, xor MATRIX_A if odd."""
        mixed = (current & _UPPER_MASK) | (following & _LOWER_MASK)
        return middle ^ (mixed >> _ONE) ^ ((mixed & _ONE) * _MATRIX_A)

    def _twist(self) -> None:
        """Regenerates all 312 words. Word i reads words i, i+1 (both still old) and i+156 mod 312,
        which is old for i < 156 and already regenerated for i >= 156, hence three vector steps."""
        state = self._state
        state[: _N - _M] = self._mix(state[: _N - _M], state[1 : _N - _M + 1], state[_M:])
        state[_N - _M : _N - 1] = self._mix(state[_N - _M : _N - 1], state[_N - _M + 1 :], state[: _M - 1])
        state[_N - 1 :] = self._mix(state[_N - 1 :], state[:1], state[_M - 1 : _M])

    @staticmethod
    def _temper(words: np.ndarray) -> np.ndarray:
        words = words ^ ((words >> np.uint64(29)) & np.uint64(0x5555555555555555))
        words = words ^ ((words << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000))
        words = words ^ ((words << np.uint64(37)) & np.uint64(0xFFF7EEE000000000))
        return words ^ (words >> np.uint64(43))

    def random_raw(self, count: int) -> np.ndarray:
        """The next `count` outputs."""
        pieces, have = [self._buffer[:count]], min(count, len(self._buffer))
        self._buffer = self._buffer[have:]
        if have < count:
            blocks = -(-(count - have) // _N)
            words = np.empty((blocks, _N), dtype=np.uint64)
            for block in range(blocks):
                self._twist()
                words[block] = self._state
            words = self._temper(words.reshape(-1))
            pieces.append(words[: count - have])
            self._buffer = words[count - have :]
        return np.concatenate(pieces)
