"""The suffix proposer's configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 24  # deepest node (the verifier's budget may cut further)
    max_nodes: int = 32
    min_token_prob: float = 0.05  # nodes whose count ratio is below are not proposed
    spec_factor: float = 2.0  # depth ≤ spec_factor × match length + spec_offset
    spec_offset: int = 4
    min_match: int = 1  # shortest suffix matched in the sealed index (unindexed buffers match ≥ 2)
    max_match: int = 12  # longest suffix matched (the sealed index resolves 3 × index_levels)
    max_occurrences: int = 64  # occurrences per tree (the most recent; of an indexed match, an even sample)
    max_scan: int = 1024  # occurrences of the last token looked at per unindexed buffer (most recent first)
    min_support: int = 4  # fewer occurrences of the longest match: also try half its length
    max_cached_tokens: int = 1_000_000  # global cache, every scope together; FIFO by request
    cache_prompts: bool = False  # the global cache also learns prompts, not only outputs
    index_every: int = 8192  # tail tokens that trigger a re-index (or 1/8 of the indexed size)
    calibrate: bool = True  # send measured acceptance per node kind instead of raw count ratios
    calibration_prior: float = 2.0  # pseudo-trials behind a bin's prior (its count ratio)
