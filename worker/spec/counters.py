"""Speculative decoding's counters on one worker (GetLoad reports them; a leaf module)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # of those, accepted by the target
    request_steps: int = 0  # (request, verify step) pairs: each emits its accepted drafts + 1
    verify_steps: int = 0  # engine steps that verified drafts
    draft_seconds: float = 0.0  # host time spent drafting
    verify_seconds: float = 0.0  # time of the verify steps (forward + acceptance)
    # accepted_hist[i]: request-steps that accepted exactly i drafts
    accepted_hist: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """One request's verify step: `drafted` drafts scored, `accepted` of them kept."""
        self.drafted += drafted
        self.accepted += accepted
        self.request_steps += 1
        if len(self.accepted_hist) <= accepted:
            self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1

    def reset(self) -> None:
        """Back to zero in place (the engine's warm-up request is not counted; the schedulers
        and the model drafter keep this same object)."""
        fresh = SpecCounters(accepted_hist=[0] * len(self.accepted_hist))  # the same buckets
        self.__dict__.update(fresh.__dict__)
