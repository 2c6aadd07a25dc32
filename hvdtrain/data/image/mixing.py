"""Mixup and CutMix on a batch, with torchvision ``transforms.v2.MixUp`` / ``CutMix`` semantics.

A batch is paired with itself rolled by one (image i with image i-1), as torchvision does:

* MixUp: ``lam ~ Beta(alpha, alpha)``; ``x = lam * x + (1 - lam) * x.roll(1)``;
* CutMix: ``lam ~ Beta(alpha, alpha)``; a box centred at a uniform point with sides
  ``sqrt(1 - lam)`` of the image's, clipped to the image, is pasted from ``x.roll(1)``, and
  ``lam`` becomes the share of the image left uncovered;
* the targets become ``lam * onehot(y) + (1 - lam) * onehot(y.roll(1))``.

As in timm's ``Mixup``, ``mix_prob`` is the chance a batch is mixed at all and ``switch_prob``
chooses CutMix over MixUp when both are on. Every draw comes from a generator seeded by the
batch's place in the run (``engine.batch_seed``), never from the global generators, so a resumed
run mixes exactly as the uninterrupted one. Label smoothing is applied by the loss
(``F.cross_entropy(label_smoothing=eps)`` on soft targets smooths each one-hot part:
``(1 - eps) * mixed + eps / classes``, the same targets as timm's ``mixup_target``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MixDraw:
    """One batch's decision: no mixing (kind "none"), or the kind, lambda and (CutMix) box."""

    kind: str = "none"
    lam: float = 1.0
    box: tuple[int, int, int, int] = (0, 0, 0, 0)  # x1, y1, x2, y2


def cutmix_draw(lam: float, center_x: int, center_y: int, height: int, width: int) -> MixDraw:
    """torchvision CutMix's box for a drawn ``lam`` and centre, and the ``lam`` it leaves."""
    half = 0.5 * math.sqrt(1.0 - lam)
    half_w, half_h = int(half * width), int(half * height)
    x1, y1 = max(center_x - half_w, 0), max(center_y - half_h, 0)
    x2, y2 = min(center_x + half_w, width), min(center_y + half_h, height)
    return MixDraw("cutmix", 1.0 - (x2 - x1) * (y2 - y1) / (width * height), (x1, y1, x2, y2))


class BatchMix:
    """The batch-level mixer (see the module docstring)."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, mix_prob: float, switch_prob: float,
                 num_classes: int):
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mix_prob, self.switch_prob = mix_prob, switch_prob
        self.num_classes = num_classes

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def draw(self, seed: int, height: int, width: int) -> MixDraw:
        """The random decisions for one batch of images of this size."""
        rng = np.random.default_rng(seed)
        if rng.random() >= self.mix_prob:
            return MixDraw()
        cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < self.switch_prob)
        if not cutmix:
            return MixDraw("mixup", float(rng.beta(self.mixup_alpha, self.mixup_alpha)))
        lam = float(rng.beta(self.cutmix_alpha, self.cutmix_alpha))
        return cutmix_draw(lam, int(rng.integers(width)), int(rng.integers(height)), height, width)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C, H, W) images and class indices -> mixed images and soft targets (float32)."""
        return self.apply(images, labels, self.draw(seed, images.shape[-2], images.shape[-1]))

    def apply(self, images: torch.Tensor, labels: torch.Tensor, draw: MixDraw) -> tuple[torch.Tensor, torch.Tensor]:
        onehot = F.one_hot(labels, self.num_classes).to(torch.float32)
        if draw.kind == "none":
            return images, onehot
        lam = draw.lam
        if draw.kind == "mixup":
            images = images.roll(1, 0).mul_(1.0 - lam).add_(images.mul(lam))
        else:
            x1, y1, x2, y2 = draw.box
            images = images.clone()
            images[..., y1:y2, x1:x2] = images.roll(1, 0)[..., y1:y2, x1:x2]
        return images, onehot.roll(1, 0).mul_(1.0 - lam).add_(onehot.mul(lam))
