"""Gradient buckets: which parameters share one flat buffer and one all-reduce.

Pure bookkeeping, no communication. Parameters are taken in the order their gradients are
expected to arrive (reverse order of use), and cut into buckets of about ``cap_bytes``; the
first bucket is smaller so that its all-reduce starts early in backward, as in DDP. Parameters
that must be reduced differently (another communicator, another dtype or device) never share a
bucket. A bucket's layout is fixed: ``offsets[i]`` is where parameter ``params[i]`` starts in
the flat buffer.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

FIRST_BUCKET_BYTES = 1 << 20
"""The first bucket holds at most 1 MiB, like DDP's, so communication starts early."""


@dataclass
class Bucket:
    """Parameters reduced together; ``key`` says how (communicator, dtype, device)."""

    key: Hashable
    params: list[int] = field(default_factory=list)  # indices into the model's parameter list
    offsets: list[int] = field(default_factory=list)
    numel: int = 0


def assign_buckets(
    numels: Sequence[int],
    keys: Sequence[Hashable],
    element_sizes: Sequence[int],
    order: Sequence[int],
    cap_bytes: float,
    first_cap_bytes: float = FIRST_BUCKET_BYTES,
) -> list[Bucket]:
    """Cut the parameters, taken in ``order``, into buckets of about ``cap_bytes``.

    A bucket is closed as soon as it holds ``cap_bytes`` or more (so it may exceed the cap by
    its last parameter). Each key fills its own buckets; the buckets are listed in the order
    their first parameter appears in ``order``. ``cap_bytes=0`` puts every parameter in a
    bucket of its own.
    """
    open_buckets: dict[Hashable, Bucket] = {}
    buckets: list[Bucket] = []
    for i in order:
        key = keys[i]
        bucket = open_buckets.get(key)
        if bucket is None:
            bucket = open_buckets[key] = Bucket(key)
            buckets.append(bucket)
        bucket.params.append(i)
        bucket.offsets.append(bucket.numel)
        bucket.numel += numels[i]
        # Close a bucket once it reaches its cap, as DDP does: the last bucket, whose
        # all-reduce cannot start before backward ends, stays as small as it can be.
        cap = min(first_cap_bytes, cap_bytes) if bucket is buckets[0] else cap_bytes
        if bucket.numel * element_sizes[i] >= cap:
            del open_buckets[key]
    return buckets
