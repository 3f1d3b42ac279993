"""Agreement between the processes of a job: each process votes a few whole numbers and every
process reads back their maximum, through jax.distributed's key-value store.

Host-only: a vote never enters the devices' queue, so it cannot stall or reorder the dispatched
steps and their collectives (a device all-reduce of the same vote cost about 7 ms a step on one
machine, and several in flight without a data dependency on the step deadlocked gloo). The
per-step vote is read one round behind (`agree_behind`), so it does not wait for the slowest
process's current step either (benchmarks/agreement_overhead.py). Every wait has a deadline,
past which `VoteTimeout` names the ranks that did not vote.

The key-value store is open to anyone who can reach its port (on one node: every local user),
so a vote is read only from the keys of the job's own ranks, and with the job's secret
(MSJAX_JOB_SECRET, which msjax.launch gives its workers) every value is sealed with an HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from collections.abc import Sequence

VOTE_TIMEOUT_S = 30 * 60.0  # a peer that never votes is a hang: the supervisor's to judge first
JOB_SECRET = "MSJAX_JOB_SECRET"  # the job's key for sealing what it writes to the store
_SEAL_SEPARATOR = ";"
_votes_made: dict[str, int] = {}  # ProcessVotes made by this process, per name
# At least this much stepping between two rounds of a per-step vote: a round (a write, a read and
# half a delete) cost about 0.6 ms beside a 19 ms step of two processes on 2 CPU cores
# (benchmarks/agreement_overhead.py), 0.6% of 100 ms. Steps longer than this vote every step.
VOTE_SPACING_S = 0.1
MAX_STEPS_BETWEEN_ROUNDS = 16  # what a vote decides waits at most twice this many steps


class VoteTimeout(Exception):
    """Some processes did not vote within the vote's deadline; the message names them."""

    def __init__(self, name: str, round_number: int, missing: list[int], waited_s: float):
        ranks = ", ".join(str(rank) for rank in missing) or "none (they voted as it ended)"
        super().__init__(
            f"vote {name} round {round_number}: no vote from rank(s) {ranks} within {waited_s:g} s"
        )
        self.missing = missing


class ForgedValue(Exception):
    """A value in the job's key-value store that this job did not write (no valid seal)."""


def job_secret() -> bytes | None:
    """This job's secret from the environment, or None (values are then not sealed)."""
    secret = os.environ.get(JOB_SECRET, "")
    return secret.encode() if secret else None


def seal(key: str, text: str, secret: bytes | None) -> str:
    """text with an HMAC-SHA256 of (key, text) appended; text itself when there is no secret.
    The key is part of what is signed, so a sealed value cannot be replayed under another key."""
    if secret is None:
        return text
    mac = hmac.new(secret, f"{key}\n{text}".encode(), hashlib.sha256).hexdigest()
    return f"{text}{_SEAL_SEPARATOR}{mac}"


def unseal(key: str, sealed: str, secret: bytes | None) -> str:
    """The text of a value `seal` wrote under key; ForgedValue if its seal does not match."""
    if secret is None:
        return sealed
    text, _, mac = sealed.rpartition(_SEAL_SEPARATOR)
    expected = hmac.new(secret, f"{key}\n{text}".encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, expected):
        raise ForgedValue(f"{key} holds a value this job did not write")
    return text


class ProcessVote:
    """Rounds of votes named `name`; every process must cast the same rounds in the same order
    (and make its votes of one name in the same order: the n-th of a name has keys of its own)."""

    def __init__(self, name: str, timeout_s: float = VOTE_TIMEOUT_S):
        import jax
        from jax._src.distributed import global_state

        self.client = global_state.client
        instance = _votes_made.get(name, 0)
        _votes_made[name] = instance + 1
        self.prefix = f"msjax/vote/{name}" + (f".{instance}" if instance else "")
        self.rank = jax.process_index()
        self.processes = jax.process_count()
        self.secret = job_secret()
        self.rounds = 0  # rounds collected
        self.cast_rounds = 0  # rounds this process has voted in
        self.timeout_s = timeout_s

    def agree(self, values: Sequence[int]) -> tuple[int, ...]:
        """The maximum over every process of each value, once every process has voted."""
        return tuple(max(column) for column in zip(*self.gather(values), strict=True))

    def agree_behind(self, values: Sequence[int]) -> tuple[int, ...] | None:
        """Cast values for this round and return the previous round's maximum over every
        process (None in the first round): a vote one round behind. Every process cast that
        round a step ago, so its keys are in and reading them does not wait for the slowest
        process's current step; every process gets the same answer in the same round."""
        self.cast(values)
        if self.cast_rounds < 2:
            return None
        return tuple(max(column) for column in zip(*self.collect(), strict=True))

    def gather(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every process's values, in rank order, once every process has voted."""
        self.cast(values)
        return self.collect()

    def cast(self, values: Sequence[int]) -> None:
        """This process's values for the next round, without waiting for anyone."""
        own_key = f"{self.prefix}/{self.cast_rounds}/{self.rank}"
        text = ",".join(str(int(v)) for v in values)
        self.client.key_value_set(own_key, seal(own_key, text, self.secret))
        self.cast_rounds += 1

    def collect(self) -> list[tuple[int, ...]]:
        """Every process's values of the oldest round this process cast and has not collected,
        in rank order, once every process has cast it.

        Only the keys of ranks 0..processes-1 are read (anything else under the prefix is not
        a vote); a value without this job's seal raises ForgedValue; VoteTimeout names the
        ranks that had not voted when timeout_s had passed.
        """
        assert self.rounds < self.cast_rounds, "collect a round only after casting it"
        round_key = f"{self.prefix}/{self.rounds}"
        deadline = time.monotonic() + self.timeout_s
        cast = self._round_in_store(round_key)  # one read: one step behind, all are in
        votes = []
        for rank in range(self.processes):
            key = f"{round_key}/{rank}"
            sealed = cast.get(key)
            if sealed is None:
                sealed = self._wait_for(key, round_key, deadline)
            votes.append(tuple(int(v) for v in unseal(key, sealed, self.secret).split(",")))
        # Every process has cast this round, so every one has collected the round two before
        # (a process casts round r only after collecting round r - 2, even one round behind):
        # its keys are no longer needed. The processes take turns to delete them.
        if self.rounds >= 2 and self.rounds % self.processes == self.rank:
            self.client.key_value_delete(f"{self.prefix}/{self.rounds - 2}")
        self.rounds += 1
        return votes

    def _round_in_store(self, round_key: str) -> dict[str, str]:
        """The keys of a round as the store holds them now, each under its full name."""
        return dict(self.client.key_value_dir_get(round_key))

    def _wait_for(self, key: str, round_key: str, deadline: float) -> str:
        """key's value once it is set; VoteTimeout past the deadline."""
        wait_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            return self.client.blocking_key_value_get(key, wait_ms)
        except Exception as error:  # jax's runtime error: the wait's end, or no service
            if "DEADLINE_EXCEEDED" not in str(error) and time.monotonic() < deadline:
                raise
            raise VoteTimeout(
                self.prefix.removeprefix("msjax/vote/"),
                self.rounds,
                self._missing(round_key),
                self.timeout_s,
            ) from None

    def _missing(self, round_key: str) -> list[int]:
        """The ranks with no key in this round (as the store holds it now)."""
        try:
            present = self._round_in_store(round_key)
        except Exception:  # the store itself cannot answer: every peer is unaccounted for
            present = {f"{round_key}/{self.rank}": ""}
        return [rank for rank in range(self.processes) if f"{round_key}/{rank}" not in present]


class VoteSpacing:
    """The steps a per-step vote casts its rounds in: every step, or every few where steps are
    so short that a round would cost more than 1% of them.

    Each round carries every process's proposal (`proposal`: the steps that make
    VOTE_SPACING_S, from its own time per step since its round before), and the agreed one (the
    maximum, `agreed`) sets how many steps pass before the next round. Every process reads the
    same answer at the same step, so all cast their rounds at the same steps.
    """

    def __init__(
        self, spacing_s: float = VOTE_SPACING_S, max_steps: int = MAX_STEPS_BETWEEN_ROUNDS
    ):
        self.spacing_s = spacing_s
        self.max_steps = max_steps
        self.steps_between = 1
        self.next_round_step: int | None = None  # None: the first step casts
        self._last_round: tuple[int, float] | None = None  # (step, time) of the round before

    def due(self, step: int) -> bool:
        """Whether the round of this step is cast."""
        return self.next_round_step is None or step >= self.next_round_step

    def proposal(self, step: int) -> int:
        """This process's proposal, in steps, from its own time per step since its last round."""
        now = time.monotonic()
        last, self._last_round = self._last_round, (step, now)
        if last is None or step <= last[0]:
            return 1
        seconds_per_step = max((now - last[1]) / (step - last[0]), 1e-9)
        return min(self.max_steps, max(1, math.ceil(self.spacing_s / seconds_per_step)))

    def agreed(self, step: int, steps_between: int | None) -> None:
        """The round cast at this step was answered with steps_between (None: no answer yet)."""
        if steps_between is not None:
            self.steps_between = min(self.max_steps, max(1, steps_between))
        self.next_round_step = step + self.steps_between


def process_vote(name: str, timeout_s: float = VOTE_TIMEOUT_S) -> ProcessVote | None:
    """A vote across the job's processes, or None in a one-process run (its view is the job's)."""
    import jax

    return ProcessVote(name, timeout_s) if jax.process_count() > 1 else None


def agree_any(vote: ProcessVote | None, mine: bool) -> bool:
    """Whether any process says yes (this process alone when there is no vote)."""
    return mine if vote is None else bool(vote.agree([int(mine)])[0])


def agree_min(vote: ProcessVote | None, mine: int) -> int:
    """The least of every process's value; values are >= 0, and -1 (none) is the least."""
    if vote is None:
        return mine
    return -vote.agree([1 if mine < 0 else -mine])[0]


def agree_max(vote: ProcessVote | None, mine: Sequence[int]) -> tuple[int, ...]:
    """The maximum over every process of each value (this process's own when there is no vote)."""
    return tuple(int(v) for v in mine) if vote is None else vote.agree(mine)
