"""Synthetic batches: the input pipeline costs nothing (benchmarks of the model and communication)."""

from __future__ import annotations

from typing import Iterator

import torch


class SyntheticBatches:
    """One random uint8 batch, yielded ``steps`` times: the input pipeline costs nothing."""

    def __init__(self, steps: int, batch_size: int, image_size: int, num_classes: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8,
                                    generator=generator)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        self.steps = steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.steps):
            yield self.images, self.labels

    def __len__(self) -> int:
        return self.steps
