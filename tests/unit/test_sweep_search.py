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
    assert should_stop(trial(3, {20: 0.1}), [trial(0, {20: 0.9}, "succeeded")], minimize=False, min_steps=1)


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
     "spec.objective.metric accuracy is not reported by family sd15 (it reports loss, validation_loss); "
     "it is reported by classifier"),
    (lambda s: s.update(objective={"metric": "validation_loss"}),
     "spec.objective.metric validation_loss is measured at validation: set spec.template.spec.validation.everySteps"),
    (lambda s: s.update(algorithm="hyperband"), "spec.algorithm: Input should be 'grid', 'random', 'bayesian' or 'pbt'"),
    (lambda s: s.update(maxTrials=2, parallelTrials=3), "spec.maxTrials (2) is below spec.parallelTrials (3)"),
    (lambda s: s.update(algorithm="grid"), "spec.algorithm grid needs finite parameters; training.learningRate"),
    (lambda s: s["template"]["spec"]["training"].update(learningRate=-1), "spec.template.spec.training.learningRate"),
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
    assert result.exit_code == 1
    assert "spec.parameters[adapter.rank]: 0 refused: Input should be greater than or equal to 1" in result.output
