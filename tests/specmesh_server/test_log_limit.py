"""Rate-limited warnings: the first of a kind is logged, then one line per interval that counts
the lines dropped since; kinds are limited independently."""

from __future__ import annotations

import logging

from specmesh_server.log_limit import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_logs_the_first_line_then_one_summary_per_interval_with_the_dropped_count(caplog):
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("test.flood"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        for i in range(1000):  # 1000 in 5 s: only the first goes out
            clock.now = 100.0 + i * 0.005
            limited.warning("tree", "bad tree %d", i)
        clock.now = 110.0  # the interval is over: the next line carries the count
        limited.warning("tree", "bad tree %d", 1000)
        clock.now = 115.0
        limited.warning("tree", "bad tree %d", 1001)
    assert [r.getMessage() for r in caplog.records] == [
        "bad tree 0",
        "bad tree 1000 (999 more like this in the last 10 s)",
    ]


def test_kinds_are_limited_independently_and_a_quiet_kind_logs_again_without_a_count(caplog):
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("test.kinds"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.kinds"):
        assert limited.warning(("tree", "a"), "a") and limited.warning(("tree", "b"), "b")
        assert not limited.warning(("tree", "a"), "a")
        clock.now += 60.0
        assert limited.warning(("tree", "b"), "b again")
    assert [r.getMessage() for r in caplog.records] == ["a", "b", "b again"]


def test_the_record_points_at_the_caller_and_keeps_exc_info(caplog):
    limited = RateLimitedLog(logging.getLogger("test.caller"))
    with caplog.at_level(logging.ERROR, logger="test.caller"):
        try:
            raise ValueError("boom")
        except ValueError:
            limited.error("k", "failed", exc_info=True)
    (record,) = caplog.records
    assert record.funcName == "test_the_record_points_at_the_caller_and_keeps_exc_info"
    assert record.exc_info is not None and record.exc_info[0] is ValueError
