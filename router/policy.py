"""The runtime speculation policy and how a request's proposer is resolved against it.

The default policy applies to requests that leave ``SpecDecodeParams.proposer`` at
``auto``; an operator switches it at runtime through ``AdminService.SetPolicy``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

MODES = ("auto", "fixed", "off")


@dataclass(frozen=True)
class SpeculationPolicy:
    mode: str = "auto"  # "auto" | "fixed" | "off"
    proposer: str = ""  # for "fixed"
    num_speculative_tokens: int = 0  # cap; 0 = none
    max_tree_nodes: int = 0  # cap; 0 = server default


@dataclass(frozen=True)
class PolicyLimits:
    """The server's bounds on the policy's knobs: a cap becomes every ``auto`` request's tree budget,
    so an unbounded one would build trees of that size per request per step."""

    max_speculative_tokens: int = 64
    max_tree_nodes: int = 128


@dataclass(frozen=True)
class ProposerChoice:
    proposer: str  # a configured proposer name, or "none"
    reason: str  # why no speculation, when proposer == "none"


class PolicyStore:
    """Thread-safe holder of the current default policy."""

    def __init__(
        self,
        available: tuple[str, ...],
        limits: PolicyLimits | None = None,  # the server's; None = the defaults
        initial: SpeculationPolicy | None = None,
    ) -> None:
        self.available, self.limits = available, limits or PolicyLimits()
        self._lock = threading.Lock()
        self._policy = self.validate(initial or SpeculationPolicy())

    def validate(self, policy: SpeculationPolicy) -> SpeculationPolicy:
        """Raise ValueError naming the field; return the normalised policy."""
        if policy.mode not in MODES:
            raise ValueError(f"policy.mode: must be one of {', '.join(MODES)}, got {policy.mode!r}")
        if policy.mode == "fixed" and policy.proposer not in self.available:
            raise ValueError(
                f"policy.proposer: {policy.proposer!r} is not configured here "
                f"(configured: {', '.join(self.available) or 'none'})"
            )
        for name, value, limit in (
            ("num_speculative_tokens", policy.num_speculative_tokens, self.limits.max_speculative_tokens),
            ("max_tree_nodes", policy.max_tree_nodes, self.limits.max_tree_nodes),
        ):
            if not 0 <= value <= limit:
                raise ValueError(f"policy.{name}: must be in [0, {limit}] (this server's limit), got {value}")
        return policy if policy.mode == "fixed" else replace(policy, proposer="")

    def get(self) -> SpeculationPolicy:
        with self._lock:
            return self._policy

    def set(self, policy: SpeculationPolicy) -> SpeculationPolicy:
        policy = self.validate(policy)
        with self._lock:
            self._policy = policy
        return policy


def resolve_proposer(requested: str, policy: SpeculationPolicy, available: tuple[str, ...]) -> ProposerChoice:
    """Which proposer serves a request, before any statistics are consulted.

    >>> resolve_proposer("auto", SpeculationPolicy(mode="off"), ("ngram",))
    ProposerChoice(proposer='none', reason='speculation is off by the server policy')
    >>> resolve_proposer("ngram", SpeculationPolicy(mode="off"), ("ngram",)).proposer
    'ngram'
    """
    if requested == "none":
        return ProposerChoice("none", "")
    if requested != "auto":
        return ProposerChoice(requested, "")
    if policy.mode == "off":
        return ProposerChoice("none", "speculation is off by the server policy")
    if policy.mode == "fixed":
        return ProposerChoice(policy.proposer, "")
    if not available:
        return ProposerChoice("none", "no proposer is configured on this verifier")
    return ProposerChoice(available[0], "")
