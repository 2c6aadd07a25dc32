"""Recommendation models: matrix factorization with biases, and NCF (GMF + MLP, He et al. 2017).

Both take ``(users, items)``: ``items`` is a vector (one item per user) or a matrix (candidates per
user, for ranking), and return one score per pair. Embeddings may produce sparse gradients
(``sparse=True``); every other parameter is small and dense.

Regularization is an L2 penalty on the rows a batch uses (the classic matrix factorization
objective), not weight decay: weight decay touches every row at every step and is not defined for
sparse gradients. ``forward`` leaves the batch's mean penalty in ``self.penalty`` for the loss.
"""

from __future__ import annotations

import torch
from torch import nn


def embedding(rows: int, dim: int, sparse: bool, std: float) -> nn.Embedding:
    table = nn.Embedding(rows, dim, sparse=sparse)
    nn.init.normal_(table.weight, 0.0, std)
    return table


def pairs(users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Users broadcast to the shape of ``items``."""
    return users[:, None].expand_as(items) if items.dim() == 2 else users


def squared(*rows: torch.Tensor) -> torch.Tensor:
    """The mean over pairs of the summed squares of each pair's rows."""
    return sum(row.pow(2).sum(-1) for row in rows).mean()


class MatrixFactorization(nn.Module):
    """score = global bias + user bias + item bias + user factors . item factors."""

    def __init__(self, num_users: int, num_items: int, dim: int, sparse: bool, global_bias: float = 0.0):
        super().__init__()
        self.user = embedding(num_users, dim, sparse, 0.1)
        self.item = embedding(num_items, dim, sparse, 0.1)
        self.user_bias = embedding(num_users, 1, sparse, 0.0)
        self.item_bias = embedding(num_items, 1, sparse, 0.0)
        self.global_bias = nn.Parameter(torch.tensor([float(global_bias)]))
        self.penalty = torch.zeros(())

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        users, items = inputs
        users = pairs(users, items)
        p, q = self.user(users), self.item(items)
        bu, bi = self.user_bias(users), self.item_bias(items)
        self.penalty = squared(p, q, bu, bi)
        return (p * q).sum(-1) + bu.squeeze(-1) + bi.squeeze(-1) + self.global_bias


class NCF(nn.Module):
    """NeuMF: a generalized matrix factorization branch and an MLP branch over separate
    embeddings, concatenated into one linear output (He et al. 2017, section 3.4)."""

    def __init__(self, num_users: int, num_items: int, dim: int, mlp: tuple[int, ...], sparse: bool,
                 output_bias: float = 0.0):
        super().__init__()
        half = mlp[0] // 2
        self.gmf_user = embedding(num_users, dim, sparse, 0.01)
        self.gmf_item = embedding(num_items, dim, sparse, 0.01)
        self.mlp_user = embedding(num_users, half, sparse, 0.01)
        self.mlp_item = embedding(num_items, half, sparse, 0.01)
        layers: list[nn.Module] = []
        for width_in, width_out in zip((2 * half,) + mlp[1:-1], mlp[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.output = nn.Linear(dim + (mlp[-1] if len(mlp) > 1 else 2 * half), 1)
        nn.init.constant_(self.output.bias, output_bias)
        self.penalty = torch.zeros(())

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        users, items = inputs
        users = pairs(users, items)
        gu, gi, mu, mi = self.gmf_user(users), self.gmf_item(items), self.mlp_user(users), self.mlp_item(items)
        self.penalty = squared(gu, gi, mu, mi)
        features = torch.cat([gu * gi, self.mlp(torch.cat([mu, mi], dim=-1))], dim=-1)
        return self.output(features).squeeze(-1)


def parse_layers(text: str) -> tuple[int, ...]:
    """``recommendation.mlp_layers``: "64,32,16" -> (64, 32, 16)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(text)
    return tuple(int(part) for part in parts)
