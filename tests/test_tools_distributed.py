"""tools/distributed.py: the shards of a batch, and the statistics reduced over two gloo ranks (the
torchrun runs themselves, against one process, are in test_train.py)."""

import torch

from tools import distributed


def test_shards_cover_every_item_once_in_order():
    for n in (1, 5, 8, 13):
        for world in (1, 2, 3, 8):
            spans = [
                distributed.shard(n, distributed.Distributed(rank, world)) for rank in range(world)
            ]
            assert [i for start, stop in spans for i in range(start, stop)] == list(range(n))
            sizes = [stop - start for start, stop in spans]
            assert max(sizes) - min(sizes) <= 1


def test_one_process_is_the_identity():
    x = torch.arange(6.0).view(2, 3)
    assert distributed.gather_rows(x, distributed.SINGLE) is x
    assert distributed.all_sum([1.0, 2.0], distributed.SINGLE).tolist() == [1.0, 2.0]
    assert distributed.token_share(None, distributed.SINGLE) == 1.0


def _reduce_stats_on_rank(rank, init_file, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        stats = {
            "loss": torch.tensor(1.0 + rank),
            "ratio/min": torch.tensor(0.5 + rank),
            "ratio/max": torch.tensor(2.0 - rank),
            "grad_norm": torch.tensor(4.0 * rank),
        }
        ranks = distributed.Distributed(rank, 2, True)
        out = distributed.reduce_stats(stats, 0.25 if rank == 0 else 0.75, ranks)
        results[rank] = {key: value.item() for key, value in out.items()}
    finally:
        dist.destroy_process_group()


def test_reduce_stats_weights_the_means_and_keeps_each_extreme_over_ranks(tmp_path):
    # two gloo processes; by hand: loss 0.25 * 1 + 0.75 * 2, grad_norm 0.75 * 4, min(0.5, 1.5),
    # max(2, 1)
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_reduce_stats_on_rank, args=(str(tmp_path / "init"), results), nprocs=2)
    expected = {"loss": 1.75, "ratio/min": 0.5, "ratio/max": 2.0, "grad_norm": 3.0}
    assert results[0] == expected and results[1] == expected
