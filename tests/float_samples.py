"""float32 samples for the rounding tests: random magnitudes over 2^-30..2^30,
plus the values where TF32 rounding is decided (halfway between two TF32
neighbours, the largest float32, the smallest normal, both zeros)."""

import torch


def tf32_samples(n: int = 4000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    x = (torch.rand(n, generator=gen) * 2 - 1) * mag
    ties = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 3 * 2 ** -12 + 2 ** -23,
                         1.5 + 2 ** -12, 3.4028234663852886e38, 2.0 ** -126, 0.0, -0.0])
    return torch.cat([x, ties])
