"""A learned draft head over the target's own hidden states (EAGLE / MLP-speculator style).

The head maps (the target's final hidden state h_t, the embedding of token x_{t+1}) to a predicted
state f_{t+1} ≈ h_{t+1}; the target's own output projection, restricted to a reduced draft
vocabulary, turns f into logits. Drafting runs the head over its own predicted states: depth d
feeds the state predicted at depth d - 1 with the token chosen there.

    f = norm_out(z + Σ_blocks MLP(norm(z))),  z = W_in [norm_h(h); norm_e(E[x])]
    logits = E_out[draft_ids] · f                      # [draft_vocab]

Draft vocabulary (EAGLE-3's d2t / FR-Spec): the N tokens the target emits most often, sorted by
target id; ``draft_ids[i]`` is draft token i's target id. Greedy trees are exact whenever the
target's token is in it; elsewhere the head simply misses.

Trees (batched across requests, one head forward per depth for all of them) come from the batched
tree search the draft model runs too (``proposer_svc.core.tree_search``): greedy requests grow
EAGLE-2 dynamic trees (children: each frontier node's top ``branch``; next frontier: the ``width``
best by path probability; sent: the ``max_nodes`` best, best first, with their path probabilities);
sampled requests get the static ``sampling_template`` shape, children drawn without replacement
from the head's truncated softmax over its support, each sent with the exact distribution it was
drawn from.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from proposer_svc.core.tree_search import DraftConfig, SearchRow, SearchTree, TreeSearch

_HEAD_SEED_MIX = 0x2545F4914F6CDD1D  # head noise: a stream apart from the verifier's uniforms and the draft's
HEAD_FILE, WEIGHTS_FILE = "head.json", "head.safetensors"


@dataclass(frozen=True)
class HeadArch:
    """The head's shape and the target it was trained for (``head.json``)."""

    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab: int  # N
    target_model: str  # the target's name (informational)
    tokenizer_hash: str  # the target tokenizer's (``model_loading.tokenizer_hash``): checked at start
    blocks: int = 2
    mlp_ratio: int = 2
    rms_eps: float = 1e-5


# --- draft vocabulary ---------------------------------------------------------------------------


def draft_vocabulary(counts: torch.Tensor, n: int, always: list[int] = ()) -> torch.Tensor:
    """The ``n`` most frequent token ids (``always`` first, e.g. EOS), sorted by id.

    counts: [V] occurrences per target id → int64 [min(n, V)].

    >>> draft_vocabulary(torch.tensor([5, 0, 9, 1, 3]), 3, always=[1]).tolist()
    [0, 1, 2]
    """
    score = counts.double().clone()
    score[list(always)] = math.inf
    return score.topk(min(n, len(counts))).indices.sort().values


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The inverse map: target id → draft index, -1 outside the draft vocabulary.

    >>> ids = torch.tensor([0, 2, 5])
    >>> inv = target_to_draft(ids, 6); inv.tolist()
    [0, -1, 1, -1, -1, 2]
    >>> ids[inv[ids]].tolist() == ids.tolist()    # round trip
    True
    """
    inv = torch.full((vocab_size,), -1, dtype=torch.long)
    inv[draft_ids] = torch.arange(len(draft_ids))
    return inv


# --- the model ----------------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class _Block(nn.Module):
    def __init__(self, size: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.norm = _RMSNorm(size, eps)
        self.up, self.gate = nn.Linear(size, ratio * size, bias=False), nn.Linear(size, ratio * size, bias=False)
        self.down = nn.Linear(ratio * size, size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class Head(nn.Module):
    """The trainable head plus the target's frozen embedding and (draft-vocabulary) output rows."""

    def __init__(self, arch: HeadArch, embed: torch.Tensor, out_rows: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_eps
        self.arch = arch
        self.norm_h, self.norm_e = _RMSNorm(h, eps), _RMSNorm(h, eps)
        self.fc_in = nn.Linear(2 * h, h, bias=False)
        self.blocks = nn.ModuleList(_Block(h, arch.mlp_ratio, eps) for _ in range(arch.blocks))
        self.norm_out = _RMSNorm(h, eps)
        # Frozen, the target's: buffers, so they are neither trained nor saved with the head.
        self.register_buffer("embed", embed, persistent=False)  # [V, H]
        self.register_buffer("out_rows", out_rows, persistent=False)  # [N, H]
        self.register_buffer("draft_ids", draft_ids, persistent=True)  # [N] target ids
        self.register_buffer("to_draft", target_to_draft(draft_ids, arch.vocab_size), persistent=False)

    def forward(self, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state [..., H] (a target final state or the head's own), tokens [...] target ids →
        (predicted next state [..., H], logits over the draft vocabulary [..., N])."""
        z = self.fc_in(torch.cat([self.norm_h(state), self.norm_e(self.embed[tokens])], dim=-1))
        for block in self.blocks:
            z = block(z)
        f = self.norm_out(z)
        return f, f @ self.out_rows.T


def target_weights(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and output projection [V, H] (tied models: the same)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a dict
                if key.endswith("embed_tokens.weight") or key == "lm_head.weight":
                    found["lm_head" if key == "lm_head.weight" else "embed"] = st.get_tensor(key).float()
    if "embed" not in found:
        raise ValueError(f"{folder}: no embed_tokens weight")
    return found["embed"], found.get("lm_head", found["embed"])


def save_head(head: Head, out: Path, extra: dict | None = None) -> None:
    """``head.json`` (arch + identity + ``extra``, e.g. the training report) and the weights."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    (out / HEAD_FILE).write_text(json.dumps({"arch": asdict(head.arch), **(extra or {})}, indent=2) + "\n")


def read_arch(folder: Path) -> HeadArch:
    path = Path(folder) / HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {HEAD_FILE} (train one with `specmesh head train`)")
    return HeadArch(**json.loads(path.read_text())["arch"])


def load_head(folder: Path, target_folder: Path, target_tokenizer_hash: str) -> Head:
    """The head saved in ``folder`` over the target's weights in ``target_folder``; ValueError when
    it was trained for another target (tokenizer hash, vocabulary or hidden size)."""
    from safetensors.torch import load_file

    arch = read_arch(folder)
    if arch.tokenizer_hash != target_tokenizer_hash:
        raise ValueError(
            f"head {folder} was trained for target {arch.target_model!r} (tokenizer hash {arch.tokenizer_hash}); "
            f"this target's tokenizer hash is {target_tokenizer_hash}"
        )
    embed, out = target_weights(target_folder)
    if tuple(embed.shape) != (arch.vocab_size, arch.hidden_size):
        raise ValueError(
            f"head {folder} expects a target of vocabulary {arch.vocab_size} × hidden {arch.hidden_size}; "
            f"{target_folder} has {tuple(embed.shape)}"
        )
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    draft_ids = state["draft_ids"].long()
    head = Head(arch, embed, out[draft_ids].contiguous(), draft_ids)
    head.load_state_dict(state)
    return head.eval()


# --- batched tree drafting ----------------------------------------------------------------------


@dataclass(frozen=True)
class DraftRow:
    """One request's inputs to a drafting round."""

    state: torch.Tensor  # [H]: the target state that predicted ``token``
    token: int  # the context's last token
    search: SearchRow  # budget, context length and sampling


@torch.inference_mode()
def draft_trees(head: Head, rows: list[DraftRow], cfg: DraftConfig) -> list[SearchTree]:
    """One tree per row, all rows together: one head forward per depth (see the module doc)."""
    search = TreeSearch([r.search for r in rows], cfg, _HEAD_SEED_MIX, torch.device("cpu"))
    state = torch.stack([r.state for r in rows])[:, None]  # [b, F=1, H]
    feat, logits = head(state, torch.tensor([[r.token] for r in rows]))  # [b, 1, H], [b, 1, N]
    for d in range(1, search.depth + 1):
        search.expand(logits, d)
        if d == search.depth:
            break
        pick = search.next_frontier()  # [b, Wn]
        parents = feat.gather(1, (pick // cfg.branch)[:, :, None].expand(*pick.shape, feat.shape[-1]))  # [b, Wn, H]
        feat, logits = head(parents, head.draft_ids[search.frontier_tokens])  # [b, Wn, H], [b, Wn, N]
    return search.trees(head.draft_ids)
