"""Pure helpers, no processes."""

import torch

from parallelkit.comm import tensor_split_sizes


def test_tensor_split_sizes_match_torch():
    for total in range(0, 12):
        for parts in range(1, 6):
            expected = [len(c) for c in torch.tensor_split(torch.arange(total), parts)]
            assert tensor_split_sizes(total, parts) == expected
