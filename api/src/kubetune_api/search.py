"""The search of a TrainingSweep: which parameters the next trial gets, and whether a running
trial is clearly worse than the others (pure functions of the sweep and its trials so far).

Everything is derived from the trial records alone, so whoever runs the sweep (the local runner
today, the operator from the sweep's status) rebuilds the search after a restart by replaying
them: grid and random trials are a function of the trial number, and the Bayesian (Optuna TPE)
study is rebuilt from the finished and running trials before each suggestion. Population-based
training (pbt_step) is a function of the records too: each generation waits for the one before it,
then every member continues its own line or, when weak, copies a strong trial's checkpoint and
perturbs its hyperparameters.
"""
from __future__ import annotations

import itertools
import math
import random
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from kubetune_api import layout
from kubetune_api.sweep import Distribution, TrainingSweepSpec

# What PBT sets in each trial's spec besides the searched parameters.
PBT_STEPS = "training.maxSteps"
PBT_RESUME = "checkpoints.resumeFrom"

TrialState = Literal["running", "succeeded", "failed", "stopped"]


@dataclass
class Trial:
    number: int
    parameters: dict[str, Any]
    state: TrialState = "running"
    value: float | None = None                                 # the objective, once finished
    intermediate: dict[int, float] = field(default_factory=dict)  # step -> objective so far
    reason: str = ""                                           # why it failed or was stopped
    output_uri: str | None = None                              # its run directory (PBT resumes from it)
    exploited_from: int | None = None                          # PBT: the stronger trial it copied


def next_trial(sweep: TrainingSweepSpec, trials: list[Trial]) -> Trial | None:
    """The trial to start next, numbered len(TRIALS); None when there is none to start now (the
    search is done, or PBT's next generation waits for the running one)."""
    number = len(trials)
    if sweep.algorithm == "pbt" and number < sweep.max_trials:
        step = pbt_step(sweep, trials)
        return None if step is None else Trial(number, step.parameters,
                                                exploited_from=step.source if step.exploited else None)
    parameters = suggest(sweep, trials)
    return None if parameters is None else Trial(number, parameters)


def suggest(sweep: TrainingSweepSpec, trials: list[Trial]) -> dict[str, Any] | None:
    """The next trial's parameters; None when the search has nothing left (a grid walked through)."""
    number = len(trials)
    if number >= sweep.max_trials:
        return None
    if sweep.algorithm == "grid":
        points = grid_points(sweep)
        return points[number] if number < len(points) else None
    if sweep.algorithm == "bayesian":
        return _tpe(sweep, trials)
    if sweep.algorithm == "pbt":
        step = pbt_step(sweep, trials)
        return None if step is None else step.parameters
    rng = random.Random(f"{sweep.seed}:{number}")
    return {path: draw(distribution, rng) for path, distribution in sweep.parameters.items()}


def grid_points(sweep: TrainingSweepSpec) -> list[dict[str, Any]]:
    """Every combination, the last parameter varying fastest (as the manifest lists them)."""
    paths = list(sweep.parameters)
    return [dict(zip(paths, values)) for values in itertools.product(*(sweep.parameters[p].grid() for p in paths))]


def draw(distribution: Distribution, rng: random.Random) -> Any:
    kind = distribution.kind
    if kind == "choice":
        return rng.choice(distribution.choice)
    if kind == "uniform":
        return rng.uniform(*distribution.uniform)
    if kind == "log_uniform":
        low, high = distribution.log_uniform
        return math.exp(rng.uniform(math.log(low), math.log(high)))
    # int and float ranges: one of their steps, picked by index (the grid may be 10^9 values long;
    # randrange draws as rng.choice over the built list would)
    return distribution.value_at(rng.randrange(distribution.count()))


def _tpe(sweep: TrainingSweepSpec, trials: list[Trial]) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # constant_liar
    spaces = {path: optuna_distribution(d) for path, d in sweep.parameters.items()}
    # Seeded by the trial number too: the study is rebuilt for every suggestion, and one seed would
    # give every start-up trial the same draw. constant_liar: a running trial counts as a poor one,
    # so parallel trials spread out.
    seed = (sweep.seed * 1_000_003 + len(trials)) % 2**32
    sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True,
                                         n_startup_trials=min(10, max(2, sweep.max_trials // 4)))
    study = optuna.create_study(direction="minimize" if sweep.objective.minimize else "maximize", sampler=sampler)
    for trial in trials:
        parameters = {path: _as_optuna(spaces[path], value) for path, value in trial.parameters.items()}
        if trial.state == "succeeded" and trial.value is not None and math.isfinite(trial.value):
            study.add_trial(optuna.trial.create_trial(params=parameters, distributions=spaces, value=trial.value))
        elif trial.state == "running":
            study.add_trial(optuna.trial.create_trial(params=parameters, distributions=spaces,
                                                      state=optuna.trial.TrialState.RUNNING))
        else:  # failed or stopped early: a region TPE should not favour
            study.add_trial(optuna.trial.create_trial(params=parameters, distributions=spaces,
                                                      state=optuna.trial.TrialState.FAIL))
    return dict(study.ask(spaces).params)


def optuna_distribution(distribution: Distribution):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    kind = distribution.kind
    if kind == "choice":
        return CategoricalDistribution(distribution.choice)
    if kind == "int_range":
        low, high = distribution.int_range
        return IntDistribution(low, high, step=int(distribution.step or 1))
    if kind == "float_range":
        low, high = distribution.float_range
        return FloatDistribution(low, high, step=distribution.step)
    low, high = getattr(distribution, kind)
    return FloatDistribution(low, high, log=kind == "log_uniform")


def _as_optuna(space, value):
    """A recorded value as the distribution holds it (JSON turns 4.0 into 4 and back)."""
    from optuna.distributions import FloatDistribution

    return float(value) if isinstance(space, FloatDistribution) else value


@dataclass(frozen=True)
class PbtStep:
    parameters: dict[str, Any]   # the searched ones, plus training.maxSteps and checkpoints.resumeFrom
    source: int | None           # the trial whose checkpoint it continues (None in generation 0)
    exploited: bool              # copied from a stronger trial rather than continuing its own line


def pbt_step(sweep: TrainingSweepSpec, trials: list[Trial]) -> PbtStep | None:
    """The next PBT trial, numbered len(TRIALS): member n % population of generation n // population.
    None while the previous generation still runs (or when it left nothing to continue)."""
    population, steps = sweep.parallel_trials, sweep.pbt.steps_per_generation
    generation, member = divmod(len(trials), population)
    rng = random.Random(f"{sweep.seed}:{len(trials)}")
    if generation == 0:
        drawn = {path: draw(distribution, rng) for path, distribution in sweep.parameters.items()}
        return PbtStep({**drawn, PBT_STEPS: steps}, None, False)
    previous = trials[(generation - 1) * population:generation * population]
    if any(t.state == "running" for t in previous):
        return None
    ranked = sorted((t for t in previous if t.state == "succeeded" and _finite(t.value)),
                    key=lambda t: t.value, reverse=not sweep.objective.minimize)
    if not ranked:
        return None
    cut = max(1, int(population * sweep.pbt.quantile))
    own = previous[member]
    donors = [t for t in ranked[:cut] if t is not own]
    weak = own not in ranked or own in ranked[len(ranked) - cut:]
    if weak and donors:
        source = rng.choice(donors)
        parameters = perturb(sweep, {path: source.parameters[path] for path in sweep.parameters}, rng)
    else:
        source = own if own in ranked else ranked[0]
        parameters = {path: source.parameters[path] for path in sweep.parameters}
    resume = layout.join(source.output_uri, layout.checkpoint_name(generation * steps))
    return PbtStep({**parameters, PBT_STEPS: (generation + 1) * steps, PBT_RESUME: resume}, source.number,
                   source is not own)


def perturb(sweep: TrainingSweepSpec, parameters: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """PBT's explore: each value drawn anew (sweep.pbt.resampleProbability) or moved to a neighbour:
    x0.8 or x1.25 within a continuous range, one step of a range, the next choice."""
    moved = {}
    for path, value in parameters.items():
        distribution = sweep.parameters[path]
        if rng.random() < sweep.pbt.resample_probability:
            moved[path] = draw(distribution, rng)
            continue
        count = distribution.count()
        if count is None:
            low, high = getattr(distribution, distribution.kind)
            moved[path] = min(high, max(low, value * rng.choice((0.8, 1.25))))
        else:
            index = distribution.index_of(value) + rng.choice((-1, 1))
            moved[path] = distribution.value_at(min(count - 1, max(0, index)))
    return moved


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


# The fewest other trials with a value at a trial's step before the median rule may stop it. The
# median of one value is that one trial: a trial as good as it would lose the comparison about half
# the time, by the noise of a single reading. With two or more the median lies between them, so a
# trial as good as the best of them is stopped only when it is worse than the middle of a group.
MEDIAN_RULE_MIN_OTHERS = 2
# A trial's reason once the median rule stopped it (the local sweep's and the operator's).
MEDIAN_RULE_STOPPED = "stopped by the median rule"


def should_stop(trial: Trial, others: list[Trial], minimize: bool, min_steps: int) -> bool:
    """The median rule: stop TRIAL when its best value so far is worse than the median of the
    other trials' values at its latest step (their last value at or before it). Needs values from
    at least MEDIAN_RULE_MIN_OTHERS (2) other trials at that point, so a trial is never judged
    against one twin alone (e.g. while the third trial of a sweep has not reported yet); never
    before min_steps."""
    if not trial.intermediate:
        return False
    step = max(trial.intermediate)
    if step < min_steps:
        return False
    values = list(trial.intermediate.values())
    best = min(values) if minimize else max(values)
    theirs = [value for value in (_value_at(other, step) for other in others) if value is not None]
    if len(theirs) < MEDIAN_RULE_MIN_OTHERS:
        return False
    median = statistics.median(theirs)
    return best > median if minimize else best < median


def _value_at(trial: Trial, step: int) -> float | None:
    earlier = [s for s in trial.intermediate if s <= step]
    return trial.intermediate[max(earlier)] if earlier else None


def best_trial(trials: list[Trial], minimize: bool) -> Trial | None:
    finished = [t for t in trials if t.state == "succeeded" and t.value is not None and math.isfinite(t.value)]
    if not finished:
        return None
    return (min if minimize else max)(finished, key=lambda t: t.value)


def format_parameters(parameters: dict[str, Any]) -> str:
    """A trial's parameters on one line: training.learningRate=0.0003, adapter.rank=8."""
    return ", ".join(f"{path}={value:.4g}" if isinstance(value, float) else f"{path}={value}"
                     for path, value in parameters.items())
