"""What the benchmark records share: judging the ranks of one fault case against the pass
rule (benchmarks/fault_campaign.py, partition_campaign.py) and writing a record to the
terminal and ``--out`` (those two, lifetimes.py, bad_input.py)."""
from __future__ import annotations


def emit(text: str | list[str], out: str | None, *, quiet: bool = False) -> str:
    """Print ``text`` (lines are joined) unless ``quiet``, and write it to ``out`` when
    given (rewritten whole: a bounded run cut short still leaves its record so far)."""
    if not isinstance(text, str):
        text = "\n".join(text)
    if not quiet:
        print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return text


def case_line(ok: bool, label: str, seconds: float, why: str = "") -> str:
    """The line a campaign prints as each case ends."""
    return f"{'PASS' if ok else 'FAIL'} {label} ({seconds:.1f} s)" + (f": {why}" if why else "")


class Verdict:
    """The ranks of one case against the pass rule: a rank that should fail raises within
    ``bound_s`` of the fault; a slow-but-alive one never raises; none returns a wrong result
    as valid; nothing of the communicator is left in /dev/shm; all ranks agree on it.

    Each rank's value is a dict with ``token``, ``wrong`` (what came back wrong) and
    ``error`` (its CollectiveError text or None)."""

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self.problems: list[str] = []
        self.tokens: set = set()
        self.others: set = set()
        self.slowest = 0.0
        self.said = ""

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def rank_failed(self, r) -> None:
        """A rank that returned no value (a RankResult that is not ok)."""
        self.problem(f"rank {r.rank}: {r.error_type}: {(r.message or '')[:300]}")

    def survivor(self, rank: int, v: dict, dt: float | None, *, must_fail: bool = True,
                 never_raised: str = "") -> None:
        """Rank ``rank``'s value ``v``; ``dt``: seconds from the fault to its error."""
        self.tokens.add(v["token"])
        if v["wrong"]:
            self.problem(f"rank {rank} returned wrong data as valid: {v['wrong'][:3]}")
        if not must_fail:
            if v["error"] is not None:
                self.problem(f"rank {rank}: FALSE POSITIVE: a slow but alive rank was reported "
                             f"as failed: {v['error'][:300]}")
            return
        if v["error"] is None:
            self.problem(f"rank {rank} never raised{never_raised}")
            return
        self.slowest = max(self.slowest, dt)
        if dt > self.bound_s:
            self.problem(f"rank {rank} raised {dt:.2f} s after the fault (> the bound "
                         f"{self.bound_s:g} s): {v['error'][:200]}")
        else:
            self.said = self.said or v["error"]

    def also_check(self, token: str) -> None:
        """Another communicator of the case (one made afterwards) whose /dev/shm names must
        be gone too."""
        self.others.add(token)

    def check_leftovers(self) -> None:
        """After the processes exited: /dev/shm, and one communicator among the ranks."""
        from helpers import shm_leftovers
        left = [n for t in self.tokens | self.others for n in shm_leftovers(t)]
        if left:
            self.problem(f"/dev/shm left behind: {left}")
        if len(self.tokens) > 1:
            self.problem(f"ranks disagree on the communicator: {self.tokens}")

    def result(self) -> tuple[bool, str, float]:
        """(passed, the problems or the first error a survivor raised, slowest seconds)."""
        why = "; ".join(self.problems) or (f"raised: {self.said[:240]}" if self.said else "")
        return not self.problems, why, self.slowest
