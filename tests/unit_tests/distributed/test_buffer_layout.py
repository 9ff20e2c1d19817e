"""Buffer layouts and distributed-optimizer shards against layouts worked out by hand from Megatron's rules
(reverse order; with the distributed optimizer params start at multiples of 64, buckets end at multiples of
lcm(dp, 128), a shared embedding gets its own bucket; layer-aligned buckets hold whole layers)."""

from types import SimpleNamespace

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.buffer_layout import compute_buffer_layout, owned_ranges


def _buckets(layout):
    return [(bucket.start, bucket.end, bucket.numel_unpadded, bucket.param_indices) for bucket in layout.buckets]


def test_plain_ddp_is_unpadded_reverse_order_cut_at_bucket_size():
    layout = compute_buffer_layout([10, 20, 30], bucket_size=25, data_parallel_size=4, use_distributed_optimizer=False)
    # p2 [0, 30) reaches 25 -> bucket 0; p1 [30, 50), p0 [50, 60) -> bucket 1 (30 >= 25).
    assert layout.param_ranges == [(50, 60, 1), (30, 50, 1), (0, 30, 0)]
    assert _buckets(layout) == [(0, 30, 30, (2,)), (30, 60, 30, (1, 0))]
    assert (layout.numel, layout.numel_unpadded) == (60, 60)


def test_distributed_optimizer_pads_param_starts_and_bucket_ends():
    # dp 2: p2 [0, 200); p1 at pad64(200) = 256, [256, 259); p0 at pad64(259) = 320, [320, 420);
    # the bucket ends at pad(420, lcm(2, 128) = 128) = 512; its unpadded stretch is [0, 420).
    layout = compute_buffer_layout([100, 3, 200], None, 2, use_distributed_optimizer=True)
    assert layout.param_ranges == [(320, 420, 0), (256, 259, 0), (0, 200, 0)]
    assert _buckets(layout) == [(0, 512, 420, (2, 1, 0))]
    assert (layout.numel, layout.numel_unpadded) == (512, 420)


def test_distributed_optimizer_buckets_at_dp_3():
    # lcm(3, 128) = 384. p2 [0, 700) >= 600 closes bucket 0 at pad(700) = 768. p1 [768, 868); p0 at
    # pad64(868) = 896, [896, 1396): 1396 - 768 = 628 >= 600 closes bucket 1 at pad(1396) = 1536.
    layout = compute_buffer_layout([500, 100, 700], 600, 3, use_distributed_optimizer=True)
    assert layout.param_ranges == [(896, 1396, 1), (768, 868, 1), (0, 700, 0)]
    assert _buckets(layout) == [(0, 768, 700, (2,)), (768, 1536, 628, (1, 0))]
    # Bucket 1 cuts into 3 shards of 256: [768, 1024) [1024, 1280) [1280, 1536).
    in_bucket = {"p0": (896, 1396), "p1": (768, 868)}
    pieces = [owned_ranges(in_bucket, 768, 1536, rank, 3) for rank in range(3)]
    assert pieces[0] == {"p1": ((768, 868), (0, 100), (0, 100)), "p0": ((896, 1024), (128, 256), (0, 128))}
    assert pieces[1] == {"p0": ((1024, 1280), (0, 256), (128, 384))}
    assert pieces[2] == {"p0": ((1280, 1396), (0, 116), (384, 500))}


def test_shared_embedding_gets_its_own_bucket_only_with_the_distributed_optimizer():
    numels, shared = [300, 10, 20], [True, False, False]
    # b [0, 20), a [64, 74); the embedding closes the open bucket at its 64-aligned start 128 (counted as
    # unpadded, as Megatron does), then fills [128, 428) alone, padded to 512.
    layout = compute_buffer_layout(numels, None, 2, True, shared)
    assert _buckets(layout) == [(0, 128, 128, (2, 1)), (128, 512, 300, (0,))]
    assert layout.param_ranges[0] == (128, 428, 1)
    assert _buckets(compute_buffer_layout(numels, None, 2, False, shared)) == [(0, 330, 330, (2, 1, 0))]


def test_layer_aligned_buckets_close_only_between_layers():
    # Module order: embedding, layer 0 (a, b), layer 1 (a, b), final norm. Laid out back to front with
    # bucket_size 25: p5 [0, 5); p4 [5, 55) reaches 25 inside layer 1, so the bucket runs on through p3
    # [55, 95) and closes before layer 0; p2 [95, 125) reaches 25 inside layer 0: on through p1 [125, 145);
    # the embedding p0 [145, 155) is the rest. By size alone the cuts would fall after p4, p3, p2 and p0.
    numels, layers = [10, 20, 30, 40, 50, 5], [None, 0, 0, 1, 1, None]
    layout = compute_buffer_layout(numels, 25, 2, False, param_layers=layers)
    assert _buckets(layout) == [(0, 95, 95, (5, 4, 3)), (95, 145, 50, (2, 1)), (145, 155, 10, (0,))]
    by_size = compute_buffer_layout(numels, 25, 2, False)
    assert [bucket.param_indices for bucket in by_size.buckets] == [(5, 4), (3,), (2,), (1, 0)]


def test_params_and_grads_are_views_into_the_padded_buffers(single_rank_groups):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3, bias=False))  # 100, 10, 30
    initial = [param.detach().clone() for param in model.parameters()]
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp = DistributedDataParallel(SimpleNamespace(calculate_per_token_loss=False), ddp_config, model)
    [buffer] = ddp.buffers
    # Reverse order: 1.weight [0, 30), 0.bias [64, 74), 0.weight [128, 228); one bucket padded to 256.
    starts = {name: buffer.param_index_map[param][0] for name, param in model.named_parameters()}
    assert starts == {"1.weight": 0, "0.bias": 64, "0.weight": 128}
    assert buffer.param_data.numel() == buffer.grad_data.numel() == 256 and buffer.numel_unpadded == 228
    for param, value in zip(model.parameters(), initial):
        start = buffer.param_index_map[param][0]
        assert param.data_ptr() == buffer.param_data[start:].data_ptr() and torch.equal(param, value)
        assert param.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
