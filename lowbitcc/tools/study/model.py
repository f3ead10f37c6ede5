"""The study's GPT and its texts: a byte-level GPT on the standard library's Python sources or
on its English documentation topics (`pydoc_data.topics`, shipped with Python); the optimizer
every configuration trains with."""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from lowbitcc.tools.study.variants import StudyConfig


def corpus(max_bytes: int) -> bytes:
    """The standard library's ``.py`` files (tests excluded), in sorted path order, concatenated
    up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "idlelib") or "tests" in rel:
            continue
        try:
            out += path.read_bytes()
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if len(out) < 1 << 16:
        raise RuntimeError(f"lowbitcc study: found only {len(out)} bytes of Python source in {root}")
    return bytes(out[:max_bytes])


def docs_corpus(max_bytes: int) -> bytes:
    """The standard library's documentation topics (`pydoc_data.topics`: the language
    reference's sections as plain English text, about 0.47 MB), in sorted topic order, UTF-8,
    up to ``max_bytes``."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode()[:max_bytes]


TEXTS: dict[str, Callable[[int], bytes]] = {"stdlib": corpus, "pydoc": docs_corpus}
"""The texts a GPT configuration trains on (`StudyConfig.data`)."""


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level decoder: vocabulary 256, learned positions, pre-norm blocks (``block(d_model,
    heads)``: `Block`, or another block of the same interface)."""

    def __init__(self, cfg: StudyConfig, block: Callable[[int, int], nn.Module] = Block) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def split_corpus(cfg: StudyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: the first 90% and the last 10% of the corpus, uint8."""
    if cfg.data not in TEXTS:
        raise ValueError(f"lowbitcc study: the GPT trains on a text ({list(TEXTS)}), "
                         f"not {cfg.data!r}")
    data = torch.frombuffer(bytearray(TEXTS[cfg.data](cfg.corpus_bytes)), dtype=torch.uint8)
    split = int(len(data) * 0.9)
    return data[:split], data[split:]


def sample_batch(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-byte targets, ``(len(starts), context)`` int64 each."""
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def train_batches(train: torch.Tensor, cfg: StudyConfig, seed: int, rank: int) -> Iterator[
        tuple[torch.Tensor, torch.Tensor]]:
    """The training batches of ``rank``, one per step: the same for every variant of a seed."""
    order = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(cfg.steps):
        starts = torch.randint(len(train) - cfg.context - 1, (cfg.batch,), generator=order)
        yield sample_batch(train, starts, cfg.context)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def optimizer(params: Iterable[nn.Parameter], cfg: StudyConfig) -> tuple[
        torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW at ``cfg.lr`` (no weight decay), linear warm-up then cosine decay to 0."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
        * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    return opt, sched

