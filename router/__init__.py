"""Speculation routing: which proposer and how much to speculate, per request.

Knows no model: it decides from request parameters, the runtime policy and statistics.
"""
