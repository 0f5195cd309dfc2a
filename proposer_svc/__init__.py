"""Proposer services: each its own process speaking ``ProposerService.Propose``."""
