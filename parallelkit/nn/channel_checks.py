"""The checks of the channel-parallel convolutions: mistakes in the arguments raised when a
layer is made, and in an input before the first collective, as ``ValueError`` naming the
layer, the same on every rank.

Arguments depend only on what every rank passes and on ``comm.size``, so all ranks raise
alike. A replicated input's shape is the same on every rank too; a shard passed with
``input_is_split`` is checked on its own rank, or in debug mode (``comm.debug``) after the ranks
exchange their shard sizes, so that all of them raise the same error.
"""

from __future__ import annotations

import torch

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
SPLITS = ("out", "in")
_LAYOUT = {1: "(N, C, L)", 2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}


class ChannelConvChecks:
    """The checks of :class:`~parallelkit.nn.channel_parallel.ChannelParallelConvNd`, which
    derives from this: they read the layer's arguments as its ``__init__`` keeps them, and
    the channel blocks (``in_sizes``) and padding (``_pad``) it works out from them."""

    def _name(self) -> str:
        return (
            f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
            f"kernel_size={self.kernel_size}, groups={self.groups}, split={self.split!r})"
        )

    def _check_arguments(self) -> None:
        """User mistakes in the arguments; the same on every rank (they depend on comm.size)."""
        name, size = self._name(), self.comm.size
        c_in, c_out, groups = self.in_channels, self.out_channels, self.groups
        if self.split not in SPLITS:
            raise ValueError(f"{name}: split must be one of {SPLITS}, got {self.split!r}")
        if min(c_in, c_out, groups) < 1 or c_in % groups or c_out % groups:
            raise ValueError(
                f"{name}: in_channels and out_channels must be positive multiples of groups"
            )
        if self.padding_mode not in PADDING_MODES:
            raise ValueError(
                f"{name}: padding_mode must be one of {PADDING_MODES}, got {self.padding_mode!r}"
            )
        if isinstance(self.padding, str):
            if self.padding not in ("same", "valid"):
                raise ValueError(
                    f"{name}: padding must be 'same', 'valid' or ints, got {self.padding!r}"
                )
            if self.padding == "same" and set(self.stride) != {1}:
                raise ValueError(f"{name}: padding='same' needs stride 1, got {self.stride}")
        elif min(self.padding) < 0:
            raise ValueError(f"{name}: padding must be >= 0, got {self.padding}")
        if min(*self.kernel_size, *self.stride, *self.dilation) < 1:
            raise ValueError(f"{name}: kernel_size, stride and dilation must be >= 1")
        if self.split == "in" and not self.gather_output:
            raise ValueError(f"{name}: gather_output is for split='out'; use scatter_output=True")
        if self.split == "out" and self.scatter_output:
            raise ValueError(f"{name}: scatter_output is for split='in'; use gather_output=False")
        if groups > 1:
            if groups < size:
                raise ValueError(
                    f"{name}: {groups} groups cannot be split into whole groups over {size} "
                    "ranks; use groups=1 (dense), at least as many groups as ranks, or fewer ranks"
                )
            return
        # Which channel counts are split into blocks, each of which must be non-empty.
        split_in = self.split == "in" or self.input_is_split
        split_out = self.split == "out" or self.scatter_output
        for what, n, needed in (("input", c_in, split_in), ("output", c_out, split_out)):
            if needed and n < size:
                other = "split='out'" if what == "input" else "split='in'"
                raise ValueError(
                    f"{name}: {n} {what} channels cannot be split over {size} ranks (each rank "
                    f"needs at least one); use {other} without split {what}s, or fewer ranks"
                )

    def _check_input(self, x: torch.Tensor) -> None:
        """Input mistakes, raised before any collective (the layer's name made only for one:
        formatting it costs microseconds a call)."""
        if not isinstance(x, torch.Tensor) or x.dim() != self.spatial_dims + 2:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{self._name()}: expected an {_LAYOUT[self.spatial_dims]} input, got {shape}"
            )
        if self.input_is_split:
            self._check_shard(x)
        elif x.shape[1] != self.in_channels:
            raise ValueError(
                f"{self._name()}: expected {self.in_channels} input channels (the whole, "
                f"replicated input; channels are dim 1), got shape {tuple(x.shape)}"
            )
        for d, n in enumerate(x.shape[2:]):
            reach = self.dilation[d] * (self.kernel_size[d] - 1) + 1
            at = 2 * (self.spatial_dims - 1 - d)  # F.pad lists the last dim first
            padded = n + self._pad[at] + self._pad[at + 1]
            if padded < reach:
                raise ValueError(
                    f"{self._name()}: input {tuple(x.shape)} is {padded} wide along dim {d + 2} "
                    f"after padding, smaller than the dilated kernel ({reach}); use a larger input"
                )

    def _check_shard(self, x: torch.Tensor) -> None:
        """A split input holds this rank's channel block. In debug mode the ranks exchange
        their block sizes first, so that all of them raise the same error."""
        rank, size = self.comm.rank, self.comm.size
        if self.comm.debug and size > 1:
            got = [n for (n,) in self.comm.all_gather_ints([x.shape[1]])]
            bad = [r for r in range(size) if got[r] != self.in_sizes[r]]
            seen = f"got {got} channels (wrong on ranks {bad})"
        else:
            bad = [] if x.shape[1] == self.in_sizes[rank] else [rank]
            seen = f"rank {rank} got {x.shape[1]} channels (shape {tuple(x.shape)})"
        if bad:
            raise ValueError(
                f"{self._name()}: with input_is_split each rank takes its block of the "
                f"{self.in_channels} input channels, {self.in_sizes} over the ranks; {seen}; "
                "split the channels like this layer's in_sizes"
            )
