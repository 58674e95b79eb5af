"""The dtypes a collective moves, in one table that every communicator file reads.

It lives apart from :mod:`parallelkit.comm.base` so that the files below the communicator can
read it too: :class:`~parallelkit.comm.base.Communicator` refuses a tensor of any other dtype,
and debug mode (:mod:`parallelkit.comm.debug`) sends a dtype to the other ranks as its index
here, a small integer that every rank decodes alike.
"""

from __future__ import annotations

import torch

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
)
