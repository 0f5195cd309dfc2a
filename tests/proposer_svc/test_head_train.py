"""The head's training data: which workload rows it learns from."""

from __future__ import annotations

import json

import pytest

from proposer_svc.head.train import parse_args, prompts


class CharTokenizer:
    """Templating stand-in: one id per character of the user turn."""

    def apply_chat_template(self, messages, **_):
        return [ord(c) for c in messages[0]["content"]]


def test_the_rows_the_bench_warms_up_on_are_left_out_per_category(tmp_path):
    rows = [("code", "a"), ("qa", "b"), ("code", "c"), ("qa", "d"), ("code", "e")]
    path = tmp_path / "warmup.jsonl"
    path.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in rows))
    assert prompts(CharTokenizer(), path) == [[ord(t)] for _, t in rows]
    assert prompts(CharTokenizer(), path, skip_per_category=1) == [[ord("c")], [ord("d")], [ord("e")]]
    assert prompts(CharTokenizer(), path, skip_per_category=5) == []


def test_the_skip_flag_parses_and_a_negative_one_is_refused():
    assert parse_args(["train", "--out", "x", "--skip-per-category", "5"]).skip_per_category == 5
    with pytest.raises(SystemExit):
        parse_args(["train", "--out", "x", "--skip-per-category", "-1"])
