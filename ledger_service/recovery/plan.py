"""The recovery planner: rebuild the projections with a bounded cost, or refuse.

Pure: sources (each with a cost and a risk) and a policy in, a manifest out,
its verdict HARD_ABORT, RISK_TOO_HIGH, EXCEEDS_BUDGET or ADMISSIBLE, in that
order of checks (docs/recovery.md, The planner). Its digest covers every field
that made the decision.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from ledger_service.domain.counts import counted

# Risk scores: 0 = the state is exactly what the verified log implies.
RISK_VERIFIED = 0.0
# Events appended before the hash chain existed: their content cannot be checked.
RISK_UNSEALED = 0.2
# A snapshot made by another projection format (another fold): stale.
RISK_STALE_FORMAT = 0.9
# A digest or a link that does not check out: the source was altered or damaged.
RISK_UNVERIFIABLE = 1.0


class Verdict(enum.Enum):
    ADMISSIBLE = "ADMISSIBLE"
    EXCEEDS_BUDGET = "EXCEEDS_BUDGET"
    RISK_TOO_HIGH = "RISK_TOO_HIGH"
    HARD_ABORT = "HARD_ABORT"


@dataclasses.dataclass(frozen=True)
class Source:
    """One way to rebuild the projections completely."""

    source_id: str
    cost_seconds: float
    risk_score: float
    detail: str = ""
    # False when the source cannot reach the position the ledger must be restored to.
    possible: bool = True


class PolicyRefused(ValueError):
    """A recovery policy field out of its range; `field` names it, so that each
    command can name its own flag or variable."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    max_budget_seconds: float
    max_risk_score: float
    min_viable_sources: int = 1

    def validate(self) -> None:
        if not (math.isfinite(self.max_budget_seconds) and self.max_budget_seconds >= 0):
            raise PolicyRefused(
                "max_budget_seconds", "the recovery budget must be a finite number of seconds >= 0"
            )
        if not 0.0 <= self.max_risk_score <= 1.0:
            raise PolicyRefused(
                "max_risk_score", "the largest acceptable risk score must be between 0 and 1"
            )
        if self.min_viable_sources < 1:
            raise PolicyRefused("min_viable_sources", "at least one viable source is needed")


@dataclasses.dataclass(frozen=True)
class Manifest:
    verdict: Verdict
    sources: tuple[Source, ...]
    # The sources the reconstruction uses, cheapest first (empty unless admissible
    # or over budget).
    chosen: tuple[str, ...]
    total_cost_seconds: float
    policy: RecoveryPolicy
    directive: str
    # Why a reconstruction was considered: what the assessment found.
    findings: tuple[str, ...]
    digest: str
    # The broken links (ChainBreak.describe()) the chosen sources go past: an
    # admissible plan that has them accepts the log as it is there, and
    # `ledger verify` names them as accepted once the rebuild is done.
    accepted: tuple[str, ...] = ()

    @property
    def admissible(self) -> bool:
        return self.verdict is Verdict.ADMISSIBLE

    def body(self) -> dict[str, Any]:
        policy = self.policy
        return {
            "verdict": self.verdict.value,
            "sources": [
                {
                    **dataclasses.asdict(source),
                    "cost_seconds": _seconds(source.cost_seconds),
                    "risk_score": _seconds(source.risk_score),
                }
                for source in self.sources
            ],
            "chosen": list(self.chosen),
            "total_cost_seconds": _seconds(self.total_cost_seconds),
            "policy": {
                **dataclasses.asdict(policy),
                "max_budget_seconds": _seconds(policy.max_budget_seconds),
                "max_risk_score": _seconds(policy.max_risk_score),
            },
            "directive": self.directive,
            "findings": list(self.findings),
            # Only when there are some: the digests of other manifests stay as they were.
            **({"accepted_breaks": list(self.accepted)} if self.accepted else {}),
        }

    def to_json(self) -> str:
        return json.dumps({**self.body(), "digest": self.digest}, sort_keys=True)


def _seconds(value: float) -> str:
    # Fixed decimals: the digest must not depend on float formatting.
    return f"{value:.3f}"


def plan(
    sources: Iterable[Source],
    policy: RecoveryPolicy,
    findings: Iterable[str] = (),
    breaks: Mapping[str, Iterable[str]] | None = None,
) -> Manifest:
    """The decision, deterministic in its inputs (sources are ordered by id).
    `breaks`: the broken links each source goes past, by source id; those of
    the chosen sources of an admissible plan are the manifest's `accepted`."""
    policy.validate()
    every = tuple(sorted(sources, key=lambda source: source.source_id))
    possible = [source for source in every if source.possible]
    safe = sorted(
        (source for source in possible if source.risk_score <= policy.max_risk_score),
        key=lambda source: (source.cost_seconds, source.source_id),
    )
    chosen = tuple(safe[: policy.min_viable_sources])
    total = sum(source.cost_seconds for source in chosen)
    if not possible:
        verdict, chosen = Verdict.HARD_ABORT, ()
        directive = (
            "HALT: no source can reconstruct the projections; restore the database "
            "(its event log) from a backup"
        )
    elif len(safe) < policy.min_viable_sources:
        verdict, chosen = Verdict.RISK_TOO_HIGH, ()
        directive = (
            f"HALT: {counted(len(safe), 'source')} with risk <= {policy.max_risk_score:.2f} "
            f"< minimum {policy.min_viable_sources}"
        )
    elif total > policy.max_budget_seconds:
        verdict = Verdict.EXCEEDS_BUDGET
        directive = f"HALT: cost {total:.3f}s exceeds budget {policy.max_budget_seconds:.3f}s"
    else:
        verdict = Verdict.ADMISSIBLE
        directive = (
            f"PROCEED: rebuild from {' and '.join(source.source_id for source in chosen)} "
            f"within budget ({total:.3f}s / {policy.max_budget_seconds:.3f}s)"
        )
    ids = tuple(source.source_id for source in chosen)
    total = sum(source.cost_seconds for source in chosen)
    accepted: dict[str, None] = {}  # in the sources' order, each once
    if verdict is Verdict.ADMISSIBLE:
        for source_id in ids:
            accepted.update(dict.fromkeys((breaks or {}).get(source_id, ())))
    manifest = Manifest(
        verdict, every, ids, total, policy, directive, tuple(findings), "", tuple(accepted)
    )
    text = json.dumps(manifest.body(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return dataclasses.replace(manifest, digest=hashlib.sha256(text.encode("utf-8")).hexdigest())


def replay_cost_seconds(units: int, units_per_second: float) -> float:
    """Seconds to replay `units` events or rows at a measured rate."""
    return max(units, 0) / max(units_per_second, 1e-9)
