"""``specmesh draft distill``: train a small draft from the target, on the CPU, in minutes.

The draft is the target's first ``--layers`` decoder layers with the target's embeddings,
final norm and lm_head (tied to the embeddings in SmolLM2); embeddings and lm_head stay
frozen, so only the layers and the final norm learn. Training text is the dev workload (prompts,
chat-templated), plus, with ``--generate-fraction``, the target's own greedy answers to some of
them (the distribution the draft must predict at serving time). The loss is KL(target ‖ draft)
over the target's top ``--teacher-top-k`` tokens at every position; the target's logits are
computed once per text and cached, so later epochs cost only the small model. The result is an
HF folder (``save_pretrained`` + the target's tokenizer) that ``specmesh serve draft --model``
loads; the command ends by printing the greedy top-1 agreement with the target on held-out text.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proposer_svc.core.target_answers import generate_answers
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
WORKLOAD = Path(__file__).resolve().parents[2] / "workloads" / "specbench_offline_dev.jsonl"


@dataclass(frozen=True)
class DistillConfig:
    layers: int = 4
    minutes: float = 15.0
    seq_len: int = 256
    batch: int = 4
    lr: float = 3e-4
    teacher_top_k: int = 64
    generate_fraction: float = 0.25  # of the time budget spent generating target answers
    generate_tokens: int = 96
    heldout: int = 16  # sequences kept for the agreement report
    threads: int = 2
    seed: int = 0


def truncate_layers(model: Any, layers: int) -> Any:
    """Keep the first ``layers`` decoder layers of an HF causal LM (in place); returns it."""
    decoder = model.get_decoder()
    if not 0 < layers <= len(decoder.layers):
        raise ValueError(f"--layers must be in 1..{len(decoder.layers)}, got {layers}")
    decoder.layers = decoder.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def save_draft(model: Any, tokenizer: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def kl_topk(student_logits: Any, teacher_ids: Any, teacher_logp: Any) -> Any:
    """Mean KL(teacher ‖ student) over positions, on the teacher's top-k support (renormalised).

    student_logits [n, V]; teacher_ids int64 [n, k]; teacher_logp [n, k] (log-probs, any scale).

    >>> import torch
    >>> s = torch.tensor([[2.0, 0.0, 0.0]]); ids = torch.tensor([[0, 1]]); t = torch.log(torch.tensor([[0.8, 0.2]]))
    >>> round(float(kl_topk(s, ids, t)), 4)  # 0.8 ln(0.8/0.787) + 0.2 ln(0.2/0.107)
    0.1391
    """
    import torch

    t_logp = torch.log_softmax(teacher_logp.float(), dim=-1)  # renormalise over the k
    s_logp = torch.log_softmax(student_logits.float(), dim=-1).gather(1, teacher_ids)  # [n, k]
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


def workload_texts(tokenizer: Any) -> list[list[int]]:
    """Chat-templated first turns (and reference answers where present) of the dev workload."""
    rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
    out = []
    for row in rows:
        msgs = [{"role": "user", "content": row["turns"][0]}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def _chunks(texts: list[list[int]], seq_len: int) -> list[list[int]]:
    return [t[i : i + seq_len] for t in texts for i in range(0, len(t), seq_len) if len(t[i : i + seq_len]) > 8]


def distill(target_spec: str | None, out: Path, cfg: DistillConfig) -> dict[str, float]:
    import copy

    import torch

    from specmesh_server.model_loading import load_model

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    t_start = time.monotonic()
    deadline = t_start + cfg.minutes * 60
    lm = load_model(target_spec, "cpu", "float32")
    teacher, tok = lm.model, lm.tokenizer
    student = truncate_layers(copy.deepcopy(teacher), cfg.layers)
    for p in student.parameters():
        p.requires_grad_(False)
    trainable = [p for layer in student.get_decoder().layers for p in layer.parameters()]
    trainable += list(student.get_decoder().norm.parameters())
    for p in trainable:
        p.requires_grad_(True)

    texts = workload_texts(tok)
    random.Random(cfg.seed).shuffle(texts)
    heldout, train = texts[: cfg.heldout], texts[cfg.heldout :]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    if cfg.generate_fraction > 0:
        gen_deadline = time.monotonic() + cfg.generate_fraction * (deadline - time.monotonic())
        heldout = generate_answers(teacher, heldout, cfg.generate_tokens, gen_deadline, pad) or heldout
        train = generate_answers(teacher, train, cfg.generate_tokens, gen_deadline, pad) + train
    chunks = _chunks(train, cfg.seq_len)
    log.info("%d training chunks of <= %d tokens, %d held-out texts", len(chunks), cfg.seq_len, len(heldout))

    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    teacher_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    step, seen, losses = 0, 0, []
    order = list(range(len(chunks)))
    while time.monotonic() < deadline - 10:  # leave time to save and evaluate
        if seen % len(order) == 0:
            random.Random(cfg.seed + seen).shuffle(order)
        idx = [order[(seen + j) % len(order)] for j in range(cfg.batch)]
        seen += cfg.batch
        batch_loss = 0.0
        opt.zero_grad()
        for i in idx:
            ids = torch.tensor([chunks[i]])
            if i not in teacher_cache:
                with torch.inference_mode():
                    t_logits = teacher(ids).logits[0].float()  # [n, V]
                top = t_logits.topk(cfg.teacher_top_k, dim=-1)
                teacher_cache[i] = (top.indices.clone(), torch.log_softmax(t_logits, -1).gather(1, top.indices))
            t_ids, t_logp = teacher_cache[i]
            loss = kl_topk(student(ids).logits[0], t_ids, t_logp) / len(idx)
            loss.backward()
            batch_loss += float(loss.detach())
        lr = cfg.lr * min(1.0, (step + 1) / 20)  # short warm-up
        for g in opt.param_groups:
            g["lr"] = lr
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        losses.append(batch_loss)
        step += 1
        if step % 10 == 0:
            log.info("step %d  KL %.3f  (%.0f s)", step, sum(losses[-10:]) / 10, time.monotonic() - t_start)
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    save_draft(student, tok, out)
    agreement = top1_agreement(teacher, student, heldout)
    return {"steps": step, "final_kl": sum(losses[-10:]) / max(len(losses[-10:]), 1), "top1_agreement": agreement}


def top1_agreement(teacher: Any, student: Any, texts: list[list[int]]) -> float:
    """Fraction of positions where the draft's argmax equals the target's (teacher-forced)."""
    import torch

    hit = total = 0
    with torch.inference_mode():
        for t in texts:
            ids = torch.tensor([t[-512:]])
            a, b = teacher(ids).logits[0].argmax(-1), student(ids).logits[0].argmax(-1)
            hit += int((a == b).sum())
            total += a.numel()
    return hit / max(total, 1)


def command() -> ToolCommand:
    """``specmesh draft distill``'s command line."""
    c = DistillConfig()
    flags = (
        target_flag("--model"),
        ToolFlag("--layers", "target decoder layers kept", int, c.layers, minimum=1),
        shared_flag("--minutes", c.minutes),
        out_flag("output HF folder (for `specmesh serve draft --model`)"),
        ToolFlag("--seq-len", "tokens per training sequence", int, c.seq_len, minimum=2),
        shared_flag("--batch", c.batch, "sequences per step"),
        shared_flag("--lr", c.lr),
        shared_flag("--generate-fraction", c.generate_fraction),
        shared_flag("--threads", c.threads),
        shared_flag("--seed", c.seed),
    )
    return ToolCommand(
        "specmesh draft",
        "Draft models for the draft proposer.",
        "distill",
        "train a small draft from the target (CPU, minutes)",
        "Train a few-layer draft from the target: its embeddings and head frozen, KL to its top-64.",
        flags,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parse_tool(command(), argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    cfg = tool_config(DistillConfig, a)
    result = distill(a.model, Path(a.out), cfg)
    print(
        f"draft distill: {cfg.layers} layers, {result['steps']} steps, final KL {result['final_kl']:.3f}, "
        f"held-out top-1 agreement with the target {result['top1_agreement']:.1%}; saved to {a.out}",
        flush=True,
    )
    if not math.isfinite(result["final_kl"]):
        raise SystemExit("distillation diverged (non-finite KL)")
