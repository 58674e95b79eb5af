"""How sensitive is a zoo architecture's own dense model? ``python tests/zoo/sensitivity.py
NAME ...`` trains two dense copies (float64, the zoo's SGD, 2 steps), one with every weight
moved by 1e-13, and prints how far each step's input gradient moves, relative to its scale.

A case the zoo labels "wrong" only from its second step on, by less than this, is the dense
model's own chaos (BatchNorm over a few values per channel), not a parallelism defect: compare
its first step only (``Arch(steps=1)``), or give it a larger input.
"""

from __future__ import annotations

import copy
import sys

import torch

from zoo_cases import ARCHS


def sensitivity(name: str, steps: int = 2, scale: float = 1e-13) -> list[float]:
    """Per step, max |grad - grad'| / max |grad| of the input gradient between the dense model
    and a copy whose weights moved by ``scale`` (same inputs, same SGD)."""
    arch = ARCHS[name]
    torch.manual_seed(0)
    models = [arch.build().double()]
    models.append(copy.deepcopy(models[0]))
    with torch.no_grad():
        for p in models[1].parameters():
            p.add_(torch.randn_like(p) * scale)
    grads: list[list[torch.Tensor]] = []
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        grads.append([])
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(2, *arch.shape, generator=gen, dtype=torch.float64)
            x.requires_grad_()
            opt.zero_grad()
            out = model(x)
            (out if torch.is_tensor(out) else out[0]).square().sum().backward()
            grads[-1].append(x.grad.clone())
            opt.step()
    return [float((a - b).abs().max() / a.abs().max()) for a, b in zip(*grads, strict=True)]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for arch_name in sys.argv[1:]:
        moved = ", ".join(f"step {i}: {v:.1e}" for i, v in enumerate(sensitivity(arch_name)))
        print(f"{arch_name}: input gradient moved by a 1e-13 weight change: {moved}")
