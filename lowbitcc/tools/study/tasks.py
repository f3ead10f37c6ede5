"""What a study configuration trains (`StudyConfig.model` on `StudyConfig.data`): its model,
the batches of each rank and step, the fixed validation batches, the loss, and for a classifier
the count of right answers.

Every variant of a seed sees the same initial weights (built after ``torch.manual_seed(seed)``),
the same batches in the same order and the same validation batches; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lowbitcc.tools.study.model import TinyGPT, lm_loss, sample_batch, split_corpus, train_batches
from lowbitcc.tools.study.variants import StudyConfig

Batch = tuple[torch.Tensor, torch.Tensor]

VAL_SEED = 12345
"""Draws the validation batches (and the digits' split): the same for every seed."""


class Task:
    """A configuration's model and data (`text` and `digits` build one). Batches are
    ``(inputs, targets)`` on the CPU."""

    classifier = False

    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg

    def model(self) -> nn.Module:
        raise NotImplementedError

    def train_batches(self, seed: int, rank: int) -> Iterator[Batch]:
        """``cfg.steps`` batches of ``cfg.batch`` examples for ``rank``: the same for every
        variant of a seed, different between ranks."""
        raise NotImplementedError

    def val_batches(self, count: int) -> list[Batch]:
        """``count`` fixed validation batches (each rank evaluates its share)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def correct(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
        """Examples of the batch the model classifies right (classifiers only)."""
        raise NotImplementedError


class TextTask(Task):
    """The byte-level GPT (`model.TinyGPT`) on a text of `model.TEXTS`: random windows of
    ``cfg.context`` bytes from the first 90% for training, from the last 10% for validation."""

    def __init__(self, cfg: StudyConfig) -> None:
        super().__init__(cfg)
        self.train, self.val = split_corpus(cfg)

    def model(self) -> nn.Module:
        return TinyGPT(self.cfg)

    def train_batches(self, seed: int, rank: int) -> Iterator[Batch]:
        return train_batches(self.train, self.cfg, seed, rank)

    def val_batches(self, count: int) -> list[Batch]:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(VAL_SEED)
        starts = [torch.randint(len(self.val) - cfg.context - 1, (cfg.batch,), generator=gen)
                  for _ in range(count)]
        return [sample_batch(self.val, s, cfg.context) for s in starts]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(model, x, y)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions (32 and 64 channels, GELU) and two linear layers (256 hidden, 10
    classes) on 8x8 single-channel images: 1.07 M parameters, most in the first linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.GELU(),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.GELU(), nn.Flatten())
        self.classify = nn.Sequential(nn.Linear(64 * 8 * 8, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))


DIGITS_VAL = 797
"""Images of scikit-learn's 1797 held out for validation (a fixed draw); 1000 train."""


class DigitsTask(Task):
    """`DigitsCNN` on scikit-learn's handwritten digits (``sklearn.datasets.load_digits``: 1797
    8x8 images shipped inside the package, pixel values 0-16 scaled to 0-1). Training batches are
    drawn with replacement from 1000 images; validation is the other 797, cut into ``count``
    batches whatever ``count`` is."""

    classifier = True

    def __init__(self, cfg: StudyConfig) -> None:
        super().__init__(cfg)
        try:
            from sklearn.datasets import load_digits
        except ImportError as exc:
            raise RuntimeError("lowbitcc study: the digits configuration needs scikit-learn "
                               "(pip install 'lowbitcc[study]')") from exc
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).div_(16).unsqueeze(1)
        labels = torch.tensor(digits.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(VAL_SEED))
        images, labels = images[order], labels[order]
        self.val = images[:DIGITS_VAL], labels[:DIGITS_VAL]
        self.train = images[DIGITS_VAL:], labels[DIGITS_VAL:]

    def model(self) -> nn.Module:
        return DigitsCNN()

    def train_batches(self, seed: int, rank: int) -> Iterator[Batch]:
        images, labels = self.train
        order = torch.Generator().manual_seed(seed * 1000 + rank)
        for _ in range(self.cfg.steps):
            pick = torch.randint(len(labels), (self.cfg.batch,), generator=order)
            yield images[pick], labels[pick]

    def val_batches(self, count: int) -> list[Batch]:
        images, labels = self.val
        return list(zip(images.tensor_split(count), labels.tensor_split(count), strict=True))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    def correct(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
        return int((model(x).argmax(-1) == y).sum())


TASKS: dict[tuple[str, str], type[Task]] = {
    ("gpt", "stdlib"): TextTask, ("gpt", "pydoc"): TextTask, ("cnn", "digits"): DigitsTask}


def task(cfg: StudyConfig) -> Task:
    """The task of ``cfg``; `ValueError` naming the known pairs for another."""
    kind = TASKS.get((cfg.model, cfg.data))
    if kind is None:
        raise ValueError(f"lowbitcc study: no task trains model {cfg.model!r} on data "
                         f"{cfg.data!r}; known: {sorted(TASKS)}")
    return kind(cfg)
