"""The rules every ledger enforces on round commits and job states, in one place.

The SQL store and the simulation's in-memory ledger both call these, so a commit the server
refuses is refused in simulation too (tests/test_ledger_contract.py runs both).
"""

from __future__ import annotations

from flotilla.core.errors import JobStateError, RoundConflict
from flotilla.core.records import JOB_STATES, TERMINAL_STATES, RoundCommit


def check_job_state(state: str) -> None:
    """ValueError unless ``state`` is one of :data:`JOB_STATES`."""
    if state not in JOB_STATES:
        raise ValueError(f"unknown job state {state!r}; expected one of {', '.join(JOB_STATES)}")


def check_commit(c: RoundCommit) -> None:
    """ValueError for a malformed commit: rounds start at 1, participants are its own."""
    if c.round < 1:
        raise ValueError(f"round numbers start at 1, got {c.round}")
    for p in c.participants:
        if p.job_id != c.job_id or p.round != c.round:
            raise ValueError(
                f"participant {p.device_id!r} is for job {p.job_id!r} round {p.round}, "
                f"not job {c.job_id!r} round {c.round}"
            )


def check_next_round(c: RoundCommit, state: str, committed: int, total: int) -> None:
    """RoundConflict unless ``c`` is the next round of a job that is not finished."""
    where = f"round {c.round} of job {c.job_id!r}"
    if state in TERMINAL_STATES:
        raise RoundConflict(f"{where} refused: the job is {state}")
    if c.round != committed + 1:
        raise RoundConflict(
            f"{where} refused: {committed} rounds are committed, so the next is {committed + 1}"
        )
    if c.round > total:
        raise RoundConflict(f"{where} refused: the job has {total} rounds")


def state_after(c: RoundCommit, total: int) -> str:
    """A job's state once ``c`` is committed: completed after its last round."""
    return "completed" if c.round == total else "running"


def check_transition(job_id: str, current: str, new: str) -> None:
    """JobStateError when a finished job would change state (staying put is fine)."""
    if current != new and current in TERMINAL_STATES:
        raise JobStateError(f"job {job_id!r} is {current} and cannot become {new}")
