"""``specmesh head train``: distil a draft head from the target, on the CPU, in minutes.

Data: the warm-up half of the dev workload (``workloads/specbench_dev_warmup.jsonl``; the bench
measures the other half), chat-templated, with the target's own greedy answers (the text the head
must predict at serving time), then, while the generation budget lasts, sampled ones. One target
forward per text gives every position's final hidden state h_t; the target's distribution at t is
softmax(lm_head · h_t), exact on the draft vocabulary, so no logits are stored.

Loss, unrolled over ``unroll`` steps the way drafting runs (depth k feeds the head its own state
from depth k - 1 with the true token): KL(target ‖ head) over the draft vocabulary (the target's
log-probabilities computed once, bf16) plus ``feature_weight`` × smooth-L1 between the predicted
and the target's state. The draft vocabulary is the ``draft_vocab`` most frequent tokens of the
training texts' answers and prompts (EOS always in).

Reports (and saves in ``head.json``): held-out top-1 agreement at depth 1..4 (the head run over its
own states, fed the true tokens), and per draft-vocabulary size the share of held-out answer tokens
it contains (a greedy head cannot propose the rest).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from proposer_svc.core.training_cli import (
    ToolCommand,
    ToolFlag,
    out_flag,
    parse_tool,
    shared_flag,
    target_flag,
    tool_config,
)

log = logging.getLogger(__name__)
WARMUP = Path(__file__).resolve().parents[2] / "workloads" / "specbench_dev_warmup.jsonl"
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class HeadTrainConfig:
    minutes: float = 10.0
    draft_vocab: int = 4096  # 88% of held-out answer tokens on the dev workload (8192: 92%, twice the cost)
    blocks: int = 1
    mlp_ratio: int = 2
    generate_fraction: float = 0.45  # of the budget: the target answering the training prompts
    generate_tokens: int = 128
    batch: int = 512  # positions per step
    unroll: int = 3
    lr: float = 2e-3
    feature_weight: float = 0.1
    heldout_fraction: float = 0.1  # of the prompts, never trained on
    sample_temperature: float = 0.8  # answers sampled once every prompt has its greedy one
    weight_decay: float = 0.01
    threads: int = 2
    seed: int = 0
    max_prompts: int = 0  # 0 = every warm-up prompt (tests use a few)
    # The first rows of each category are left out: those `specmesh bench --warmup-limit N` warms
    # up on, so `auto` does not learn the head's acceptance on its own training prompts.
    skip_per_category: int = 0


def prompts(tokenizer: Any, path: Path = WARMUP, skip_per_category: int = 0) -> list[list[int]]:
    """Chat-templated first turns of the workload file, past the first ``skip_per_category`` rows
    of each category."""
    out = []
    seen: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            seen[row["category"]] = seen.get(row["category"], 0) + 1
            if seen[row["category"]] <= skip_per_category:
                continue
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["turns"][0]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def coverage(counts: Any, heldout_tokens: Any, sizes: tuple[int, ...] = COVERAGE_SIZES) -> dict[int, float]:
    """Per vocabulary size N: the share of ``heldout_tokens`` among the N most frequent of ``counts``.

    >>> import torch
    >>> coverage(torch.tensor([0, 5, 3, 1]), torch.tensor([1, 1, 2, 3]), sizes=(1, 2))
    {1: 0.5, 2: 0.75}
    """
    import torch

    order = torch.argsort(counts, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    r = rank[heldout_tokens]
    return {n: float((r < n).float().mean()) for n in sizes}


def _features(model: Any, texts: list[list[int]]) -> list[Any]:
    """The target's final hidden states (after its last norm) per text: fp32 [len, H]."""
    import torch

    out = []
    with torch.no_grad():
        for t in texts:
            out.append(model.get_decoder()(input_ids=torch.tensor([t])).last_hidden_state[0].float().clone())
    return out


def _unrolled_loss(head: Any, feats: Any, t_logp: Any, tokens: Any, starts: Any, cfg: HeadTrainConfig) -> Any:
    """Mean loss over the unroll depths for positions ``starts`` of the concatenated texts.

    feats [T, H]: h_t, which predicted tokens[t + 1]; t_logp [T, N]: the target's log-probabilities
    on the draft vocabulary at t. Depth k (1-based) gives the head (state, tokens[s + k]) and compares
    with h_{s + k} and the target's distribution there.
    """
    import torch
    import torch.nn.functional as F

    state = feats[starts]  # [B, H]
    total = 0.0
    for k in range(1, cfg.unroll + 1):
        pred, logits = head(state, tokens[starts + k])  # [B, H], [B, N]
        target_lp = t_logp[starts + k].float()  # [B, N]
        kl = (target_lp.exp() * (target_lp - torch.log_softmax(logits, dim=-1))).sum(-1).mean()
        total = total + kl + cfg.feature_weight * F.smooth_l1_loss(pred, feats[starts + k])
        state = pred
    return total / cfg.unroll


def agreement(head: Any, out_proj: Any, feats: list[Any], tokens: list[Any], depths: int = 4) -> list[float]:
    """Held-out top-1 agreement with the target at depth 1..``depths``: the head over its own
    states, fed the true tokens (argmax over the draft vocabulary vs the target's argmax over
    ``out_proj`` [V, H], its full output projection)."""
    import torch

    hits, total = [0] * depths, [0] * depths
    with torch.inference_mode():
        for f, t in zip(feats, tokens, strict=True):
            n = len(t) - depths - 1
            if n <= 0:
                continue
            starts = torch.arange(n)
            state = f[starts]
            for k in range(depths):
                state, logits = head(state, t[starts + k + 1])
                mine = head.draft_ids[logits.argmax(-1)]
                theirs = (f[starts + k + 1] @ out_proj.T).argmax(-1)  # the target's greedy token
                hits[k] += int((mine == theirs).sum())
                total[k] += n
    return [h / max(n, 1) for h, n in zip(hits, total, strict=True)]


def train(target_spec: str | None, out: Path, cfg: HeadTrainConfig) -> dict[str, Any]:
    import torch

    from proposer_svc.core.target_answers import generate_answers
    from proposer_svc.head.proposer import Head, HeadArch, draft_vocabulary, save_head, target_weights
    from specmesh_server.model_loading import load_model, resolve_model_path, tokenizer_hash

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    t_start = time.monotonic()
    deadline = t_start + cfg.minutes * 60
    lm = load_model(target_spec, "cpu", "float32")
    model, tok = lm.model, lm.tokenizer
    texts = prompts(tok, skip_per_category=cfg.skip_per_category)
    random.Random(cfg.seed).shuffle(texts)
    if cfg.max_prompts:
        texts = texts[: cfg.max_prompts]
    n_held = max(1, int(len(texts) * cfg.heldout_fraction))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    gen_deadline = t_start + cfg.generate_fraction * cfg.minutes * 60
    held, rest = texts[:n_held], sorted(texts[n_held:], key=len)  # similar lengths batch with less padding
    held = generate_answers(model, held, cfg.generate_tokens, gen_deadline, pad) or held
    answered = generate_answers(model, rest, cfg.generate_tokens, gen_deadline, pad)
    train_texts = answered + rest[len(answered) :]  # unanswered prompts: the prompt alone
    while time.monotonic() < gen_deadline:  # time left: sampled answers too (more of the target's text)
        train_texts += generate_answers(model, rest, cfg.generate_tokens, gen_deadline, pad, cfg.sample_temperature)
    log.info("%d training texts (%d answered), %d held out", len(train_texts), len(answered), len(held))

    embed, out_proj = target_weights(resolve_model_path(target_spec))
    counts = torch.zeros(embed.shape[0], dtype=torch.long)
    for t in train_texts:
        counts += torch.bincount(torch.tensor(t), minlength=embed.shape[0])
    eos = [e for e in (tok.eos_token_id, pad) if e is not None]
    held_tokens = torch.tensor([x for t in held for x in t])
    cover = coverage(counts, held_tokens)
    draft_ids = draft_vocabulary(counts, cfg.draft_vocab, eos)
    arch = HeadArch(
        hidden_size=embed.shape[1],
        vocab_size=embed.shape[0],
        draft_vocab=len(draft_ids),
        target_model=lm.name,
        tokenizer_hash=tokenizer_hash(tok),
        blocks=cfg.blocks,
        mlp_ratio=cfg.mlp_ratio,
    )
    head = Head(arch, embed, out_proj[draft_ids].contiguous(), draft_ids)

    train_feats, held_feats = _features(model, train_texts), _features(model, held)
    del model
    feats = torch.cat(train_feats)  # [T, H], texts end to end; positions whose unroll crosses a text end are skipped
    tokens = torch.cat([torch.tensor(t) for t in train_texts])
    with torch.no_grad():  # the target on the draft vocabulary, once: [T, N] (bf16 halves the memory)
        t_logp = torch.cat([torch.log_softmax(f @ head.out_rows.T, -1).bfloat16() for f in feats.split(4096)])
    valid = torch.cat([torch.arange(len(t)) < len(t) - cfg.unroll for t in train_texts]).nonzero().squeeze(1)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_s = max(deadline - time.monotonic() - 5, 1.0)
    t_train, step, losses = time.monotonic(), 0, []
    gen = torch.Generator().manual_seed(cfg.seed)
    while True:
        frac = (time.monotonic() - t_train) / train_s
        if frac >= 1 or len(valid) == 0:
            break
        for g in opt.param_groups:  # warm-up, then linear decay to 0 at the deadline
            g["lr"] = cfg.lr * min(1.0, (step + 1) / 20) * (1 - frac)
        starts = valid[torch.randint(len(valid), (cfg.batch,), generator=gen)]
        loss = _unrolled_loss(head, feats, t_logp, tokens, starts, cfg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 50 == 0:
            log.info("step %d  loss %.3f  (%.0f s)", step, sum(losses[-50:]) / 50, time.monotonic() - t_start)
    head.eval()
    agree = agreement(head, out_proj, held_feats, [torch.tensor(t) for t in held])
    report = {
        "minutes": round((time.monotonic() - t_start) / 60, 2),
        "train_texts": len(train_texts),
        "train_tokens": int(tokens.numel()),
        "steps": step,
        "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
        "heldout_top1_agreement_by_depth": [round(a, 4) for a in agree],
        "draft_vocab_coverage": {str(n): round(c, 4) for n, c in cover.items()},
        "config": asdict(cfg),
    }
    save_head(head, out, {"training": report})
    return report


def cached_head(target_spec: str | None, minutes: float) -> Path:
    """The target's cached head, trained once on first use (like the GGUF conversion)."""
    from transformers import AutoTokenizer

    from proposer_svc.head.proposer import HEAD_FILE
    from specmesh.paths import cache_dir
    from specmesh_server.model_loading import resolve_model_path, tokenizer_hash

    target = resolve_model_path(target_spec)
    folder = cache_dir() / "heads" / f"{target.name}-{tokenizer_hash(AutoTokenizer.from_pretrained(target))}"
    if not (folder / HEAD_FILE).is_file():
        print(f"specmesh: training a draft head for {target.name} once (~{minutes:g} min) into {folder}", flush=True)
        train(target_spec, folder, HeadTrainConfig(minutes=minutes))
    return folder


def command() -> ToolCommand:
    """``specmesh head train``'s command line."""
    c = HeadTrainConfig()
    flags = (
        target_flag("--target"),
        shared_flag("--minutes", c.minutes, "wall-clock budget, generation included"),
        out_flag("head folder (for `specmesh serve head --head`)"),
        ToolFlag("--draft-vocab", "draft vocabulary size N", int, c.draft_vocab, minimum=2),
        ToolFlag("--blocks", "residual MLP blocks", int, c.blocks, minimum=0),
        shared_flag("--generate-fraction", c.generate_fraction, "share of the budget generating answers"),
        shared_flag("--batch", c.batch, "positions per step"),
        ToolFlag("--unroll", "draft depths trained per position", int, c.unroll, minimum=1),
        shared_flag("--lr", c.lr),
        shared_flag("--threads", c.threads),
        ToolFlag("--max-prompts", "use only this many prompts (0 = all)", int, c.max_prompts, minimum=0),
        ToolFlag(
            "--skip-per-category",
            "leave out the first N rows of each category (those `specmesh bench --warmup-limit N` warms up on)",
            int,
            c.skip_per_category,
            minimum=0,
        ),
        shared_flag("--seed", c.seed),
    )
    return ToolCommand(
        "specmesh head",
        "Learned draft heads for the head proposer.",
        "train",
        "distil a head from the target (CPU, minutes)",
        "Train a head on the target's hidden states and answers (the warm-up half of the dev workload).",
        flags,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parse_tool(command(), argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    cfg = tool_config(HeadTrainConfig, a)
    print(f"specmesh head train: {cfg.minutes:g} min on {cfg.threads} threads, into {a.out}", flush=True)
    r = train(a.target, Path(a.out), cfg)
    agree = ", ".join(f"d{k + 1} {x:.1%}" for k, x in enumerate(r["heldout_top1_agreement_by_depth"]))
    print(
        f"head train: {r['steps']} steps over {r['train_tokens']} tokens in {r['minutes']} min, final loss "
        f"{r['final_loss']:.3f}; held-out top-1 agreement {agree}; saved to {a.out}",
        flush=True,
    )
    if not math.isfinite(r["final_loss"]):
        raise SystemExit("head training diverged (non-finite loss)")
