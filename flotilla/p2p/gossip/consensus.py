"""How far a gossiping swarm is from agreeing, without moving its models around.

Each peer publishes a sketch of its parameters: their projection on ``dims`` random
Gaussian directions that every peer draws alike from the run's seed (Johnson-Lindenstrauss:
distances between sketches estimate distances between the full parameter vectors, within
about ``1 / sqrt(dims)`` relative error). Whoever reads the sketches (``status``, the
coordinator, a benchmark) computes the consensus distance: the largest distance of a peer
from the swarm's mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Directions a sketch projects on: 32 floats a peer, distances within about 18 %.
SKETCH_DIMS = 32
#: Parameters whose directions a sketch draws at once.
SKETCH_CHUNK = 2**16


def sketch(tensors: Sequence[torch.Tensor], seed: int, dims: int = SKETCH_DIMS) -> list[float]:
    """The parameters' projection on ``dims`` seeded directions, scaled so that distances
    between sketches estimate Euclidean distances between the parameters."""
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(dims, dtype=torch.float64)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(torch.float64)
        # A slice of directions at a time: memory stays dims x SKETCH_CHUNK, whatever the
        # model's size (a 10M-float layer would need 2.5 GB at once).
        for start in range(0, flat.numel(), SKETCH_CHUNK):
            part = flat[start : start + SKETCH_CHUNK]
            directions = torch.randn(dims, part.numel(), generator=gen, dtype=torch.float64)
            total += directions @ part
    return [float(v) for v in total / math.sqrt(dims)]


def consensus_distance(points: Sequence[Sequence[float]]) -> float:
    """The largest Euclidean distance of a point (a peer's sketch, or its flattened
    parameters) from their mean; 0 for fewer than two."""
    if len(points) < 2:
        return 0.0
    stacked = torch.tensor([list(p) for p in points], dtype=torch.float64)
    return float((stacked - stacked.mean(dim=0)).norm(dim=1).max())
