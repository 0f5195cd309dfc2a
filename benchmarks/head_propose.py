"""Micro-benchmark: the head proposer's drafting latency per round (one tree per request, all
requests together, one head forward per depth) and the hidden-state bytes per token on the wire.

States are the target's real final hidden states of a workload answer, so the trees are the ones
the service would draft.

.venv/bin/python benchmarks/head_propose.py --head DIR [--threads 1] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from proposer_svc.core.tree_search import DraftConfig, SearchRow
from proposer_svc.head.proposer import DraftRow, draft_trees, load_head
from specmesh.v1 import proposer_pb2
from specmesh_server.hidden import encode
from specmesh_server.model_loading import load_model, tokenizer_hash


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="head folder (specmesh head train --out)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the service's default: 2)")
    p.add_argument("--rounds", type=int, default=200)
    a = p.parse_args(argv)
    lm = load_model(None, "cpu", "float32")
    head = load_head(a.head, lm.path, tokenizer_hash(lm.tokenizer))
    torch.set_num_threads(a.threads)
    chat = [{"role": "user", "content": "Explain how a hash table handles collisions."}]
    ids = lm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=2)[0].tolist()
        states = lm.model.get_decoder()(input_ids=torch.tensor([out])).last_hidden_state[0].float()  # [T, H]
    cfg = DraftConfig(max_nodes=24, max_depth=5)  # the service's defaults
    for batch in (1, 8):
        for temperature in (0.0, 1.0):
            times = []
            for r in range(a.rounds):
                pos = [len(ids) + (r * 7 + i * 5) % 60 for i in range(batch)]  # positions inside the answer
                rows = [DraftRow(states[q - 1], out[q], SearchRow(24, 5, q + 1, temperature, 1.0, 0, r)) for q in pos]
                t0 = time.perf_counter()
                draft_trees(head, rows, cfg)
                times.append(time.perf_counter() - t0)
            print(
                f"batch {batch}, temperature {temperature:g}: median {1e3 * statistics.median(times):.2f} ms per round "
                f"({1e3 * statistics.median(times) / batch:.2f} ms per tree), {a.threads} thread(s)"
            )
    one = proposer_pb2.ProposeAdvance(accepted_token_ids=[out[-1]], hidden_states=encode(states[-1:], 0))
    four = proposer_pb2.ProposeAdvance(accepted_token_ids=out[-4:], hidden_states=encode(states[-4:], 0))
    print(
        f"wire: hidden size {states.shape[1]}, fp16: {one.ByteSize()} B for an Advance of 1 token, "
        f"{four.ByteSize()} B for 4 tokens ({(four.ByteSize() - one.ByteSize()) / 3:.0f} B per extra token)"
    )


if __name__ == "__main__":
    main()
