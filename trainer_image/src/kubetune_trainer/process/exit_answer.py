"""How a process of the trainer image ends on an exception: one exit code and one line for the user.

The trainer (`python -m kubetune_trainer`) and the models stage (`python -m kubetune_trainer.models.hub_stage`)
both ask `exit_answer`, so an error means the same to a restart policy wherever it happens:
2 the job itself is wrong (retrying cannot help); 3 training diverged (a retry would diverge again at
the same step); 143 stopped or an input in flux (retry: the run resumes from its checkpoint);
otherwise the answer of kubetune_api.failures, the table the CLI answers from too (S3, files, memory).
"""
from __future__ import annotations

from kubetune_api.failures import Answer, answer, disk_full
from kubetune_trainer.errors import ConfigError, InputsInFlux, TrainingDiverged
from kubetune_trainer.process.preemption import (CONFIG_ERROR_EXIT_CODE, DIVERGED_EXIT_CODE, RETRYABLE_EXIT_CODE, Preempted,
                                         StopRequest, is_lost_peer)


def exit_answer(error: BaseException, stop: StopRequest | None = None) -> Answer | None:
    """The exit code and message for error; None when nothing knows it (a bug: the caller re-raises it so
    that its traceback reaches the report). stop: the process's stop request, where it has one."""
    if isinstance(error, (ConfigError, FileNotFoundError)):
        return Answer(CONFIG_ERROR_EXIT_CODE, str(error))
    if isinstance(error, TrainingDiverged):
        return Answer(DIVERGED_EXIT_CODE, str(error))
    if isinstance(error, (InputsInFlux, Preempted)):
        return Answer(RETRYABLE_EXIT_CODE, str(error))
    if stop is not None and stop.requested():
        # The handler's Preempted came back wrapped: a library that catches everything while it
        # imports or loads (diffusers' lazy modules re-raise it as RuntimeError) still stopped for it.
        wrapped = _preempted_within(error)
        return Answer(RETRYABLE_EXIT_CODE, str(wrapped) if wrapped else
                      f"stopped by {stop.signal_name} ({type(error).__name__} on the way out)")
    if is_lost_peer(error) and not disk_full(error):
        return Answer(RETRYABLE_EXIT_CODE, f"another process of the job is gone ({error}); stopping so that the job "
                                           "can restart from its last checkpoint")
    return answer(error)


def _preempted_within(error: BaseException) -> Preempted | None:
    """The Preempted an exception was raised from or while handling, if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Preempted):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
