"""Batch order and learning-rate schedules: deterministic, sharded, independent of process count."""
import pytest
import torch

from kubetune_api.spec import TrainingSpec
from kubetune_trainer.data.sampler import batches_per_epoch, check_enough_samples, epoch_batches
from kubetune_trainer.loop import plan_steps
from kubetune_trainer.optim import build_lr_scheduler, lr_multiplier


def test_ranks_get_disjoint_samples_that_cover_the_epoch():
    world = 3
    shards = [epoch_batches(24, 2, world, rank, seed=1, epoch=0) for rank in range(world)]
    seen = [i for shard in shards for batch in shard for _, i in batch]
    assert sorted(seen) == list(range(24))
    assert all(len(shard) == 4 for shard in shards)


def test_order_depends_only_on_seed_and_epoch():
    assert epoch_batches(10, 2, 1, 0, seed=7, epoch=3) == epoch_batches(10, 2, 1, 0, seed=7, epoch=3)
    assert epoch_batches(10, 2, 1, 0, seed=7, epoch=3) != epoch_batches(10, 2, 1, 0, seed=7, epoch=4)
    assert all(key[0] == 3 for batch in epoch_batches(10, 2, 1, 0, seed=7, epoch=3) for key in batch)


def test_incomplete_last_batch_is_dropped():
    assert batches_per_epoch(10, 3, 1) == 3
    assert batches_per_epoch(10, 3, 2) == 1


def test_too_little_data_names_the_batch_size():
    with pytest.raises(ValueError, match="spec.training.batchSize: the data has 3 samples"):
        check_enough_samples(3, 2, 2)


@pytest.mark.parametrize("kind,expected_end", [("constant", 1.0), ("linear", 0.0), ("cosine", 0.0)])
def test_schedules_warm_up_then_reach_their_end_value(kind, expected_end):
    values = [lr_multiplier(s, kind, warmup_steps=4, total_steps=20) for s in range(21)]
    assert values[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert values[4] == pytest.approx(1.0)
    assert values[20] == pytest.approx(expected_end, abs=1e-9)
    assert all(a >= b - 1e-12 for a, b in zip(values[4:], values[5:])), "no increase after warmup"


def test_schedule_length_does_not_depend_on_process_count():
    """The scheduler is stepped once per optimizer step on every rank, never per process."""
    training = TrainingSpec(max_steps=10, lr_scheduler="linear", learning_rate=1.0)
    for world in (1, 4):
        plan = plan_steps(training, batches_per_epoch(64, 2, world))
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_lr_scheduler(optimizer, training, plan.total_steps)
        for _ in range(plan.total_steps - 1):
            optimizer.step()
            scheduler.step()
        assert plan.total_steps == 10
        assert scheduler.get_last_lr()[0] == pytest.approx(0.1)


def test_epochs_become_steps_after_accumulation():
    training = TrainingSpec(epochs=3, gradient_accumulation_steps=2)
    assert plan_steps(training, batches_per_epoch=5).total_steps == 7  # 15 micro-batches // 2


def test_epochs_too_short_for_one_step_are_refused():
    with pytest.raises(ValueError, match="spec.training.epochs"):
        plan_steps(TrainingSpec(epochs=1, gradient_accumulation_steps=8), batches_per_epoch=3)
