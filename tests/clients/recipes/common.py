"""What every recipe trains: a small MLP on a fixed regression set, the same on every rank."""

from __future__ import annotations

import json

import torch
from torch import nn

import lowbitcc


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                         nn.Linear(512, 8))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x[:, :8]))


def report(backend: str, loss: float, logged: list[str]) -> None:
    """Rank 0's line the test reads."""
    print("RESULT " + json.dumps({"backend": backend, "loss": loss,
                                  "compressed_calls": lowbitcc.stats()["compressed"]["calls"],
                                  "logged": sorted(logged)}), flush=True)
