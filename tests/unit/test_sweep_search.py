"""The search of a TrainingSweep (kubetune_api.search): grid, random, Bayesian (Optuna TPE) and
the median early-stopping rule, on synthetic objectives (no training)."""
from __future__ import annotations

import math
import statistics

import pytest

from kubetune_api.search import Trial, best_trial, grid_points, should_stop, suggest
from kubetune_api.sweep import TrainingSweep

TEMPLATE = {"model": {"family": "sd15", "pretrained": "org/model"}, "data": {"layout": "captions", "uri": "s3://data/set"},
            "training": {"maxSteps": 100}, "checkpoints": {"uri": "s3://out/runs"}}


def sweep(parameters: dict, algorithm: str = "random", max_trials: int = 12, seed: int = 0, **spec):
    return TrainingSweep.model_validate({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
        "spec": {"template": {"spec": TEMPLATE}, "parameters": parameters, "objective": {"metric": "loss"},
                 "algorithm": algorithm, "maxTrials": max_trials, "seed": seed, **spec}}).spec


def run_search(spec, objective) -> list[Trial]:
    trials: list[Trial] = []
    while (parameters := suggest(spec, trials)) is not None:
        trials.append(Trial(len(trials), parameters, "succeeded", objective(parameters)))
    return trials


def test_grid_walks_every_combination_once_then_stops():
    spec = sweep({"adapter.rank": {"choice": [4, 8]}, "training.maxSteps": {"intRange": [100, 300], "step": 100},
                  "training.noiseOffset": {"floatRange": [0.0, 0.1], "step": 0.05}}, "grid", max_trials=100)
    trials = run_search(spec, lambda p: 0.0)
    assert len(trials) == 2 * 3 * 3 == len(grid_points(spec))
    assert len({tuple(sorted(t.parameters.items())) for t in trials}) == 18
    assert {t.parameters["training.noiseOffset"] for t in trials} == {0.0, 0.05, 0.1}


def test_random_draws_stay_in_bounds_and_are_the_same_after_a_restart():
    spec = sweep({"training.learningRate": {"logUniform": [1e-5, 1e-3]}, "adapter.rank": {"choice": [4, 8, 16]},
                  "training.maxSteps": {"intRange": [100, 400], "step": 100}})
    first = run_search(spec, lambda p: 0.0)
    assert len(first) == 12
    for trial in first:
        assert 1e-5 <= trial.parameters["training.learningRate"] <= 1e-3
        assert trial.parameters["adapter.rank"] in (4, 8, 16)
        assert trial.parameters["training.maxSteps"] in (100, 200, 300, 400)
    # A restarted runner replays the records: trial 5 gets what it got before.
    assert suggest(spec, first[:5]) == first[5].parameters


def synthetic_loss(parameters: dict) -> float:
    """A smooth bowl with its minimum at learningRate 3e-4, rank 8, noiseOffset 0.03."""
    return ((math.log10(parameters["training.learningRate"]) - math.log10(3e-4)) ** 2
            + ((parameters["adapter.rank"] - 8) / 8) ** 2 + ((parameters["training.noiseOffset"] - 0.03) * 10) ** 2)


def test_tpe_beats_random_search_on_average_over_seeds():
    parameters = {"training.learningRate": {"logUniform": [1e-6, 1e-2]}, "adapter.rank": {"intRange": [1, 64]},
                  "training.noiseOffset": {"uniform": [0.0, 0.5]}}
    best = {}
    for algorithm in ("random", "bayesian"):
        best[algorithm] = [best_trial(run_search(sweep(parameters, algorithm, max_trials=30, seed=seed),
                                                 synthetic_loss), minimize=True).value for seed in range(8)]
    random_mean, tpe_mean = statistics.mean(best["random"]), statistics.mean(best["bayesian"])
    print(f"best loss after 30 trials, mean over 8 seeds: random {random_mean:.4f}, TPE {tpe_mean:.4f}")
    assert tpe_mean < random_mean, f"TPE {tpe_mean:.4f} vs random {random_mean:.4f}"


def test_tpe_suggests_the_same_from_the_same_records():
    """What a restarted runner relies on: the study rebuilt from the records asks the same."""
    lr = {"training.learningRate": {"logUniform": [1e-6, 1e-2]}}
    done = run_search(sweep(lr, "bayesian", max_trials=8), lambda p: abs(math.log10(p["training.learningRate"]) + 4))
    spec = sweep(lr, "bayesian", max_trials=20)
    assert suggest(spec, done) == suggest(spec, done)
    with_running = done + [Trial(8, suggest(spec, done))]
    assert suggest(spec, with_running) == suggest(spec, with_running)


def trial(number: int, values: dict[int, float], state="running") -> Trial:
    return Trial(number, {}, state, intermediate=values)


def test_the_median_rule_stops_a_clearly_worse_trial_only():
    others = [trial(0, {10: 1.0, 20: 0.8, 30: 0.6}, "succeeded"), trial(1, {10: 1.1, 20: 0.9}, "succeeded"),
              trial(2, {10: 0.9, 20: 0.7, 30: 0.5}, "succeeded")]
    assert should_stop(trial(3, {10: 1.5, 20: 1.4}), others, minimize=True, min_steps=10)
    assert not should_stop(trial(3, {10: 0.95, 20: 0.75}), others, minimize=True, min_steps=10)
    assert not should_stop(trial(3, {10: 1.5}), others, minimize=True, min_steps=15), "not before minSteps"
    assert not should_stop(trial(3, {10: 1.5}), [], minimize=True, min_steps=1), "nothing to compare with"
    assert should_stop(trial(3, {20: 0.1}), [trial(0, {20: 0.9}, "succeeded"), trial(1, {20: 0.8}, "succeeded")],
                       minimize=False, min_steps=1)


def test_the_median_rule_waits_for_two_other_trials_with_a_value_at_the_step():
    # Two equal trials and a clearly worse one that has not reported yet (or only later): the
    # second good trial is not judged against its twin alone, where a noisy reading loses it.
    twin, slightly_worse_twin = trial(0, {10: 0.50}), trial(1, {10: 0.51})
    assert not should_stop(slightly_worse_twin, [twin], minimize=True, min_steps=1)
    assert not should_stop(slightly_worse_twin, [twin, trial(2, {})], minimize=True, min_steps=1)
    assert not should_stop(slightly_worse_twin, [twin, trial(2, {12: 1.5})], minimize=True, min_steps=1), \
        "a value after the step does not count"
    assert not should_stop(slightly_worse_twin, [twin, trial(2, {8: 1.5})], minimize=True, min_steps=1), \
        "once the worse one reported, the median lies between the twin and it"
    assert should_stop(trial(2, {10: 1.5}), [twin, slightly_worse_twin], minimize=True, min_steps=1)


@pytest.mark.parametrize("change, expected", [
    (lambda s: s["parameters"].update({"training.learningRat": {"uniform": [0.1, 0.2]}}),
     "spec.parameters[training.learningRat]: training has no field 'learningRat'; did you mean 'learningRate'?"),
    (lambda s: s["parameters"].update({"adapter.rank": {"choice": [0, 8]}}),
     "spec.parameters[adapter.rank]: 0 refused: Input should be greater than or equal to 1"),
    (lambda s: s["parameters"].update({"training.learningRate": {"uniform": [-1e-4, 1e-3]}}),
     "spec.parameters[training.learningRate]: -0.0001 refused: Input should be greater than 0"),
    (lambda s: s["parameters"].update({"adapter.rank": {"logUniform": [4, 16]}}),
     "logUniform draws real numbers: use intRange or choice"),
    (lambda s: s["parameters"].update({"training": {"choice": [1]}}), "training is a section, not a value"),
    (lambda s: s["parameters"].update({"adapter.rank": {"choice": [4], "uniform": [1, 2]}}),
     "give exactly one of choice, uniform, logUniform, intRange or floatRange"),
    (lambda s: s.update(objective={"metric": "accuracy"}),
     "spec.objective.metric accuracy is not reported by family sd15 (it reports loss, validation_loss, clip_score); "
     "it is reported by classifier"),
    (lambda s: s.update(objective={"metric": "validation_loss"}),
     "spec.objective.metric validation_loss is measured at validation: set spec.template.spec.validation.everySteps"),
    (lambda s: s.update(objective={"metric": "clip_score"}),
     "spec.objective.metric clip_score is measured by a CLIP model: set spec.template.spec.validation.clipModel"),
    (lambda s: s.update(algorithm="hyperband"), "spec.algorithm: Input should be 'grid', 'random', 'bayesian' or 'pbt'"),
    (lambda s: s.update(maxTrials=2, parallelTrials=3), "spec.maxTrials (2) is below spec.parallelTrials (3)"),
    (lambda s: s.update(algorithm="grid"), "spec.algorithm grid needs finite parameters; training.learningRate"),
    (lambda s: s["template"]["spec"]["training"].update(learningRate=-1), "spec.template.spec.training.learningRate"),
    (lambda s: s.update(algorithm="pbt", parallelTrials=2), "spec.algorithm pbt needs spec.pbt: {stepsPerGeneration: N}"),
    (lambda s: s.update(algorithm="pbt", pbt={"stepsPerGeneration": 5}),
     "spec.parallelTrials is the population of algorithm pbt: at least 2"),
    (lambda s: s.update(algorithm="pbt", pbt={"stepsPerGeneration": 5}, parallelTrials=3),
     "spec.maxTrials (4) must be parallelTrials (3) x the number of generations (at least 2)"),
    (lambda s: s.update(algorithm="pbt", pbt={"stepsPerGeneration": 5}, parallelTrials=2,
                        parameters={"adapter.rank": {"choice": [4, 8]}}),
     "spec.parameters[adapter.rank]: algorithm pbt searches spec.training fields only"),
    (lambda s: s.update(algorithm="pbt", pbt={"stepsPerGeneration": 5}, parallelTrials=2,
                        parameters={"training.maxSteps": {"choice": [4, 8]}}),
     "spec.parameters[training.maxSteps]: algorithm pbt cannot search it"),
    (lambda s: s.update(algorithm="pbt", pbt={"stepsPerGeneration": 5}, parallelTrials=2,
                        earlyStopping={"rule": "median"}), "spec.earlyStopping does not apply to algorithm pbt"),
    (lambda s: s.update(pbt={"stepsPerGeneration": 5}), "spec.pbt applies to algorithm pbt only"),
])
def test_a_bad_sweep_is_refused_naming_the_field(change, expected):
    from kubetune_api.manifest import ManifestError, parse_manifest

    document = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
                "spec": {"template": {"spec": {**TEMPLATE, "training": {"maxSteps": 100}}},
                         "parameters": {"training.learningRate": {"logUniform": [1e-5, 1e-3]}},
                         "objective": {"metric": "loss"}, "maxTrials": 4}}
    change(document["spec"])
    with pytest.raises(ManifestError) as refused:
        parse_manifest(document, TrainingSweep)
    assert expected in str(refused.value), str(refused.value)


@pytest.mark.parametrize("metric", ["precision", "recall"])
def test_a_classifier_sweep_may_maximize_macro_precision_or_recall(metric):
    """The objectives follow spec.validation.monitor: what the classifier reports at validation."""
    from kubetune_api.manifest import ManifestError, parse_manifest

    template = {**TEMPLATE, "model": {"family": "classifier", "pretrained": "org/model"},
                "data": {"layout": "image-folder", "uri": "s3://data/set"},
                "validation": {"everySteps": 10, "heldOutFraction": 0.2}}
    document = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
                "spec": {"template": {"spec": template}, "objective": {"metric": metric}, "maxTrials": 4,
                         "parameters": {"training.learningRate": {"logUniform": [1e-5, 1e-3]}}}}
    objective = parse_manifest(document, TrainingSweep).spec.objective
    assert objective.metric == metric and not objective.minimize
    document["spec"]["template"]["spec"] = TEMPLATE  # sd15 reports neither
    with pytest.raises(ManifestError, match=f"spec.objective.metric {metric} is not reported by family sd15 .*"
                                            "it is reported by classifier"):
        parse_manifest(document, TrainingSweep)


def test_kubetune_validate_checks_the_example_sweep_and_names_a_bad_one(tmp_path):
    from click.testing import CliRunner

    from kubetune_cli.main import cli
    from tests.conftest import REPO

    example = REPO / "manifests" / "sweeps" / "sd15-lr-rank.yaml"
    result = CliRunner().invoke(cli, ["validate", "-f", str(example)])
    assert result.exit_code == 0 and "valid TrainingSweep 'lr-rank' (bayesian, 12 trials" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(example.read_text().replace("adapter.rank: {choice: [4, 8, 16]}", "adapter.rank: {choice: [0, 8]}"))
    result = CliRunner().invoke(cli, ["validate", "-f", str(bad)])
    assert result.exit_code == 2
    assert "spec.parameters[adapter.rank]: 0 refused: Input should be greater than or equal to 1" in result.output


def pbt_sweep(seed: int = 0, population: int = 4, generations: int = 3):
    return sweep({"training.learningRate": {"logUniform": [1e-6, 1e-2]}, "training.noiseOffset": {"uniform": [0.0, 0.2]}},
                 "pbt", max_trials=population * generations, seed=seed, parallelTrials=population,
                 pbt={"stepsPerGeneration": 10, "quantile": 0.25})


def run_pbt(spec, objective) -> list[Trial]:
    """Every trial of a PBT sweep, each finished with OBJECTIVE(its parameters) at once."""
    from kubetune_api.search import next_trial

    trials: list[Trial] = []
    while (trial := next_trial(spec, trials)) is not None:
        trial.state, trial.value = "succeeded", objective(trial.parameters)
        trial.output_uri = f"s3://out/runs/ns/s-{trial.number}/v0"
        trials.append(trial)
    return trials


def test_pbt_generations_wait_for_each_other_and_weak_members_copy_strong_checkpoints():
    from kubetune_api.search import next_trial, pbt_step

    spec = pbt_sweep()
    trials: list[Trial] = []
    for _ in range(4):
        trials.append(next_trial(spec, trials))
    assert [t.parameters["training.maxSteps"] for t in trials] == [10] * 4
    assert all("checkpoints.resumeFrom" not in t.parameters for t in trials)
    assert next_trial(spec, trials) is None, "generation 1 waits while generation 0 runs"
    for trial, value in zip(trials, (0.4, 0.1, 0.9, 0.3)):
        trial.state, trial.value, trial.output_uri = "succeeded", value, f"s3://out/runs/ns/s-{trial.number}/v0"
    second = []
    for _ in range(4):
        second.append(next_trial(spec, trials + second))
    assert [t.parameters["training.maxSteps"] for t in second] == [20] * 4
    weakest = second[2]  # member 2 had 0.9: the bottom quarter copies the top quarter (trial 1)
    assert weakest.exploited_from == 1 and pbt_step(spec, trials + second[:2]).source == 1
    assert weakest.parameters["checkpoints.resumeFrom"] == "s3://out/runs/ns/s-1/v0/checkpoint-10"
    assert weakest.parameters["training.learningRate"] != trials[1].parameters["training.learningRate"] or \
        weakest.parameters["training.noiseOffset"] != trials[1].parameters["training.noiseOffset"], "perturbed"
    assert 1e-6 <= weakest.parameters["training.learningRate"] <= 1e-2
    for member in (0, 1, 3):  # the others continue their own line with their own values
        assert second[member].exploited_from is None
        assert second[member].parameters["checkpoints.resumeFrom"] == f"s3://out/runs/ns/s-{member}/v0/checkpoint-10"
        assert second[member].parameters["training.learningRate"] == trials[member].parameters["training.learningRate"]


def test_pbt_moves_the_population_towards_better_values():
    def objective(parameters):
        return (math.log10(parameters["training.learningRate"]) - math.log10(3e-4)) ** 2

    first_generation, last_generation = [], []
    for seed in range(8):
        trials = run_pbt(pbt_sweep(seed, population=8, generations=6), objective)
        assert len(trials) == 48 and any(t.exploited_from is not None for t in trials)
        first_generation.append(statistics.mean(t.value for t in trials[:8]))
        last_generation.append(statistics.mean(t.value for t in trials[-8:]))
    # Measured: the population's mean objective falls from 1.35 in generation 0 to 0.07 in generation 5.
    assert statistics.mean(last_generation) < 0.5 * statistics.mean(first_generation), (first_generation, last_generation)


def test_the_same_seed_draws_the_same_trials_whatever_the_order_of_the_parameters():
    """The API server returns spec.parameters with sorted keys; a local sweep reads the manifest's order."""
    space = {"training.learningRate": {"logUniform": [1e-4, 1e-2]}, "adapter.rank": {"choice": [2, 4, 8]}}
    backwards = dict(reversed(list(space.items())))
    def objective(parameters):
        return parameters["training.learningRate"] * parameters["adapter.rank"]

    drawn = [run_search(sweep(order, "random", seed=1), objective) for order in (space, backwards)]
    assert [t.parameters for t in drawn[0]] == [t.parameters for t in drawn[1]]
