"""Run by comm/test_launcher.py under torchrun: pk.init() with no arguments, as a user writes it."""

import torch

import parallelkit as pk

comm = pk.init()
total = comm.all_reduce(torch.tensor([float(comm.rank + 1)]))
print(f"rank {comm.rank}/{comm.size} backend={comm.backend} sum={total.item():g}")
