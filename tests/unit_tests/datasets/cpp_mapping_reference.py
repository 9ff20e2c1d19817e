"""Line-by-line Python transcription of `build_mapping` in Megatron-LM's `megatron/core/datasets/helpers.cpp`,
with scalar pure-Python Mersenne Twisters (the C++ `std::mt19937` and `std::mt19937_64` algorithms of
[rand.eng.mers]), as the independent reference the numpy port must match exactly. Slow: one Python
step per sentence and per swap. The first (counting) pass of the C++ is folded into the second.
"""

import math

import numpy as np

LONG_SENTENCE_LEN = 512


class MersenneTwister:
    """`std::mersenne_twister_engine` with the parameters of mt19937 (32-bit) or mt19937_64."""

    def __init__(self, seed, bits):
        if bits == 32:
            (self.w, self.n, self.m, self.r, self.a, self.u, self.d, self.s, self.b, self.t, self.c, self.l, self.f) = (
                32, 624, 397, 31, 0x9908B0DF, 11, 0xFFFFFFFF, 7, 0x9D2C5680, 15, 0xEFC60000, 18, 1812433253
            )
        else:
            (self.w, self.n, self.m, self.r, self.a, self.u, self.d, self.s, self.b, self.t, self.c, self.l, self.f) = (
                64, 312, 156, 31, 0xB5026F5AA96619E9, 29, 0x5555555555555555, 17, 0x71D67FFFEDA60000, 37,
                0xFFF7EEE000000000, 43, 6364136223846793005,
            )
        self.mask = (1 << self.w) - 1
        self.state = [seed & self.mask]
        for i in range(1, self.n):
            previous = self.state[-1]
            self.state.append((self.f * (previous ^ (previous >> (self.w - 2))) + i) & self.mask)
        self.index = self.n

    def __call__(self):
        if self.index >= self.n:
            upper = (self.mask << self.r) & self.mask
            lower = (1 << self.r) - 1
            for i in range(self.n):
                x = (self.state[i] & upper) | (self.state[(i + 1) % self.n] & lower)
                x_a = x >> 1
                if x & 1:
                    x_a ^= self.a
                self.state[i] = self.state[(i + self.m) % self.n] ^ x_a
            self.index = 0
        y = self.state[self.index]
        self.index += 1
        y ^= (y >> self.u) & self.d
        y ^= (y << self.s) & self.b
        y ^= (y << self.t) & self.c
        y ^= y >> self.l
        return y & self.mask


def get_target_sample_len(short_seq_ratio, max_length, rand32_gen):
    if short_seq_ratio == 0:
        return max_length
    random_number = rand32_gen()
    if random_number % short_seq_ratio == 0:
        return 2 + random_number % (max_length - 1)
    return max_length


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, min_num_sent):
    short_seq_ratio = 0
    if short_seq_prob > 0:
        short_seq_ratio = int(math.floor(1.0 / short_seq_prob + 0.5))  # C round()
    rand32_gen = MersenneTwister(seed, 32)
    maps = []
    for epoch in range(num_epochs):
        if len(maps) >= max_num_samples:
            break
        for doc in range(len(docs) - 1):
            sent_index_first = int(docs[doc])
            sent_index_last = int(docs[doc + 1])
            prev_start_index = sent_index_first
            num_remain_sent = sent_index_last - sent_index_first
            contains_long_sentence = False
            if num_remain_sent > 1:
                for sent_index in range(sent_index_first, sent_index_last):
                    if sizes[sent_index] > LONG_SENTENCE_LEN:
                        contains_long_sentence = True
                        break
            if num_remain_sent >= min_num_sent and not contains_long_sentence:
                seq_len = 0
                num_sent = 0
                target_seq_len = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen)
                for sent_index in range(sent_index_first, sent_index_last):
                    seq_len += int(sizes[sent_index])
                    num_sent += 1
                    num_remain_sent -= 1
                    if (seq_len >= target_seq_len and num_remain_sent > 1 and num_sent >= min_num_sent) or (
                        num_remain_sent == 0
                    ):
                        maps.append([prev_start_index, sent_index + 1, target_seq_len])
                        prev_start_index = sent_index + 1
                        target_seq_len = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen)
                        seq_len = 0
                        num_sent = 0
    num_samples = len(maps)
    rand64_gen = MersenneTwister(seed + 1, 64)
    for i in range(num_samples - 1, 0, -1):
        j = rand64_gen() % (i + 1)
        maps[i], maps[j] = maps[j], maps[i]
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    return np.array(maps, dtype=dtype).reshape(-1, 3)
