"""Step order, batching and learning-rate schedules: deterministic, split over processes, independent of their count."""
import pytest
import torch

from kubetune_api.spec_training import TrainingSpec
from kubetune_trainer.data.sampler import Batching, check_enough_samples, epoch_steps, steps_per_epoch
from kubetune_trainer.loop import plan_steps
from kubetune_trainer.training.optim import build_lr_scheduler, lr_multiplier
from kubetune_trainer.checkpoint.training_state import Position, continue_position


def rank_keys(steps, batching, rank):
    return [key for step in steps for micro in range(batching.micro_batches)
            for key in batching.micro_batch(step, micro, rank)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_process_count_trains_each_step_on_the_same_samples_split_disjointly(world):
    steps = epoch_steps(24, 12, seed=1, epoch=0)
    batching = Batching.keeping(12, world, max_batch_size=2)
    for step in steps:
        shares = [[k for m in range(batching.micro_batches) for k in batching.micro_batch(step, m, r)]
                  for r in range(world)]
        assert sorted(k for share in shares for k in share) == sorted(step), "the step's samples, once each"
    assert sorted(i for r in range(world) for _, i in rank_keys(steps, batching, r)) == list(range(24))


@pytest.mark.parametrize("global_batch,world,max_batch,micro,largest", [
    (8, 2, 2, 2, 2),    # the spec's own split: 2 processes x 2 micro-batches of 2
    (8, 4, 2, 1, 2),    # more processes: fewer micro-batches
    (8, 1, 2, 4, 2),    # one process accumulates the whole step
    (6, 4, 2, 1, 2),    # uneven: 2, 2, 1, 1 samples
    (6, 2, 2, 2, 2),    # 3 per process, as micro-batches of 2 and 1
    (5, 4, 1, 1, 2),    # every process needs a sample in every micro-batch: one is larger than asked
])
def test_a_resumed_run_keeps_its_global_batch_and_adjusts_the_micro_batches(global_batch, world, max_batch,
                                                                           micro, largest):
    batching = Batching.keeping(global_batch, world, max_batch)
    assert (batching.micro_batches, batching.largest_micro_batch) == (micro, largest)
    step = list(range(global_batch))
    sizes = [len(batching.micro_batch(step, m, r)) for m in range(micro) for r in range(world)]
    assert sum(sizes) == global_batch and min(sizes) >= 1


def test_loss_weights_make_any_split_average_to_the_steps_mean():
    batching = Batching.keeping(6, 4, 2)  # shares of 2, 2, 1, 1 samples
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    step = list(range(6))
    shares = [batching.micro_batch(step, 0, r) for r in range(4)]
    # What DDP does: average over processes the weighted mean loss of each process's share.
    averaged = sum(batching.loss_weight(len(s)) * losses[s].mean() for s in shares) / 4
    assert averaged == pytest.approx(losses.mean().item())


def test_a_world_larger_than_the_global_batch_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="global batch is 4 samples per optimizer step, fewer than the 6 processes"):
        Batching.keeping(4, 6, 1)


def test_order_depends_only_on_seed_epoch_and_global_batch():
    assert epoch_steps(10, 2, seed=7, epoch=3) == epoch_steps(10, 2, seed=7, epoch=3)
    assert epoch_steps(10, 2, seed=7, epoch=3) != epoch_steps(10, 2, seed=7, epoch=4)
    assert all(key[0] == 3 for step in epoch_steps(10, 2, seed=7, epoch=3) for key in step)


def test_the_incomplete_last_step_is_dropped():
    assert steps_per_epoch(10, 3) == 3 == len(epoch_steps(10, 3, seed=0, epoch=0))
    assert steps_per_epoch(10, 6) == 1


def test_too_little_data_names_the_batch_size():
    with pytest.raises(ValueError, match="spec.training.batchSize: the data has 3 samples"):
        check_enough_samples(3, 4)


def test_a_changed_global_batch_continues_the_epoch_after_the_same_samples():
    saved = Position(step=7, epoch=2, steps_in_epoch=3)
    assert continue_position(saved, 8, 8) == saved
    assert continue_position(saved, 8, 4).steps_in_epoch == 6
    assert continue_position(saved, 8, 5).steps_in_epoch == 4, "24 samples: 4 whole steps of 5"
    assert continue_position(saved, 8, 4).step == 7, "steps done stay steps done"


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
        plan = plan_steps(training, steps_per_epoch(64, 2 * world))
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_lr_scheduler(optimizer, training, plan.total_steps)
        for _ in range(plan.total_steps - 1):
            optimizer.step()
            scheduler.step()
        assert plan.total_steps == 10
        assert scheduler.get_last_lr()[0] == pytest.approx(0.1)


def test_epochs_become_optimizer_steps():
    training = TrainingSpec(epochs=3, gradient_accumulation_steps=2)
    assert plan_steps(training, steps_per_epoch(20, 2 * 2)).total_steps == 15  # 5 steps of 4 samples, 3 times


def test_epochs_too_short_for_one_step_are_refused():
    with pytest.raises(ValueError, match="spec.training.epochs"):
        plan_steps(TrainingSpec(epochs=1, gradient_accumulation_steps=8), steps_per_epoch=0)
