"""Speculation routing: which proposer and how much to speculate, per request.

Knows no model: it decides from request parameters, the runtime policy, live acceptance
statistics (``router.stats``: in process, or shared through Redis by ``router.redis_stats``) and
the measured cost of a verification step (``router.cost_model``). ``router.selection`` holds the policy core.
"""

from specmesh_router.cost_model import LiveStepCost, StepCost, choose_width, choose_widths
from specmesh_router.policy import PolicyStore, SpeculationPolicy, resolve_proposer
from specmesh_router.selection import Decision, Router, SelectionConfig, choose
from specmesh_router.stats import AcceptanceStats, StatsBackend, StatsConfig, StatsKey, open_stats

__all__ = [
    "AcceptanceStats",
    "Decision",
    "LiveStepCost",
    "PolicyStore",
    "Router",
    "SelectionConfig",
    "SpeculationPolicy",
    "StatsBackend",
    "StatsConfig",
    "StatsKey",
    "StepCost",
    "choose",
    "choose_width",
    "choose_widths",
    "open_stats",
    "resolve_proposer",
]
