"""A dense convolution (1-D, 2-D or 3-D) whose channels are split over the ranks of a
communicator.

``ChannelParallelConv2d`` computes exactly what ``torch.nn.Conv2d`` computes, with each rank
holding one block of the weight; ``ChannelParallelConv1d`` and ``ChannelParallelConv3d`` do the
same for ``nn.Conv1d`` on signals (N, C, L) and ``nn.Conv3d`` on volumes (N, C, D, H, W). The
three differ only in the number of spatial dimensions (``spatial_dims``): the channels are dim 1 in
every case, so the splits, collectives and checks below are written once.

It is a dense convolution: every output channel still sums over every input channel. (Running
a grouped convolution with ``groups=comm.size`` instead, each rank convolving its own input
block into its own output block, drops all the cross-block terms; it is a different, smaller
model, and the tests check that it does not match.)

Two ways to split, both exact:

``split="out"``: rank r owns the output channels ``out_sizes[r]`` and sees every input channel.
    Each rank computes its block of the output from the whole input; the blocks are gathered.
    The input gradient is a sum over ranks of partial gradients (each from its own output
    channels), hence an all-reduce. Bias: sharded like the output channels.
``split="in"``: rank r owns the input channels ``in_sizes[r]`` and produces all output channels.
    Each rank convolves its input block into a partial output; the partial outputs are summed
    (all-reduce). Each rank's input gradient is exact for its own block; they are gathered.
    Bias: replicated (added once, after the sum), with the full gradient on every rank.

Blocks follow ``torch.tensor_split`` (``tensor_split_sizes``: the first blocks one larger). With
``groups > 1`` a rank owns whole groups (``tensor_split`` of the groups, times the channels per
group), which makes its input and output blocks one self-contained grouped convolution: no
partial sums exist, and the two modes differ only in the bias and in their options.

Legend: N batch, C / C' input / output channels, H W / H' W' input / output size (read L or
D H W for 1-D and 3-D; the tables below show 2-D), r this rank,
c = in_sizes[r], c' = out_sizes[r]; "replicated" = the same tensor on every rank; every rank
computes the same loss from a replicated output, so it holds the whole gradient of it; a shard
(``_shard``) gets the gradient of its own block only. The collectives are the autograd pairs of
``parallelkit.functional``:

    split="out"    forward                          backward
    x (N,C,H,W)    copy_to_group: identity          all-reduce of the partial input grads
      conv W_r b_r (N,c',H',W')  weight (c',C/groups,kh,kw), bias (c',)
    y (N,C',H',W') gather_from_group: all-gather    keep own block (dy is replicated)
      gather_output=False: return y_shard (N,c',H',W'), no all-gather, dy_shard expected
      input_is_split=True: x_shard (N,c,H,W) -> all_gather (bwd: reduce-scatter) -> x

    split="in"     forward                          backward
    x (N,C,H,W)    scatter_to_group: own block      all-gather of the block gradients
      conv W_r     (N,C',H',W') partial sum         weight (C',c,kh,kw), no bias
    y (N,C',H',W') reduce_from_group: all-reduce    identity (dy is replicated)
      + bias       (C',) replicated                 full bias gradient on every rank
      input_is_split=True: start from x_shard (N,c,H,W): no scatter, the shard's gradient
      scatter_output=True: reduce_scatter -> y_shard (N,c',H',W') (bwd: all-gather of the
          shard gradients) + bias[block r] through scatter_to_group (bwd: all-gather)

Each layer issues one collective forward and one backward, except ``scatter_output``, whose
backward all-gathers three gradients: the output's (the reduce-scatter's adjoint), the input's,
and the bias's (a small one; none without bias). ``gather_output=False`` has none forward.
Chaining ``split="out", gather_output=False`` into ``split="in", input_is_split=True`` (with
anything channel-wise in between: ReLU, a depthwise convolution) runs two convolutions on one
all-reduce forward and one backward. Volumes per rank, in units of (R-1)/R of a tensor (ring
algorithms): "out" moves y forward and 2x backward (all-reduce), "in" moves 2y forward and x
backward, so "out" is cheaper when the output is the larger tensor (channel expansion), "in"
when the input is (channel reduction, stride 2).

Why ``scatter_output`` stays exact: the reduce-scatter's adjoint is an all-gather, which is
right when each rank holds the gradient of its own shard and only that (the shard convention
that ``gather_output=False`` also follows): after the all-gather every rank holds the whole
output gradient, which is what its partial convolution needs. A consumer that turns the shard
back into a replicated tensor must therefore use ``gather_from_group`` (which keeps its own
block in backward), not ``all_gather``. The replicated bias is added by block through
``scatter_to_group``, whose backward all-gathers the block gradients, so every rank again holds
the whole bias gradient, as with ``reduce_from_group``.

Every padding of ``nn.Conv*d`` works: ints, tuples, "valid", "same" (stride 1), and padding
modes "zeros", "reflect", "replicate", "circular": the image is never split, so padding stays a
local, per-channel operation. Bad arguments raise ``ValueError`` at construction, and bad inputs
before the first collective, the same way on every rank (for a replicated input, whose shape
every rank sees). A shard passed with ``input_is_split`` is checked on its own rank only; in
debug mode (``comm.debug``) the ranks first exchange their shard sizes so that all raise alike.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _reverse_repeat_tuple

import parallelkit.functional as pkf
from parallelkit.comm import Communicator, world
from parallelkit.geometry import per_dim, tensor_split_sizes
from parallelkit.nn.channel_checks import (  # noqa: F401 (importable from here, as before)
    PADDING_MODES,
    SPLITS,
    ChannelConvChecks,
)

PerDim = int | tuple[int, ...]
"""An int for every spatial dimension, or one each, as ``nn.Conv*d`` takes its kernel size,
stride, padding and dilation (not a sample's size: that is a tuple everywhere else)."""


class ChannelParallelConvNd(ChannelConvChecks, nn.Module):
    """``torch.nn.Conv{dims}d`` with its channels split over the ranks of ``comm`` (exact,
    dense); use :class:`ChannelParallelConv1d`, :class:`ChannelParallelConv2d` or
    :class:`ChannelParallelConv3d`.

    Takes ``nn.Conv*d``'s arguments plus:
        comm: the channel-parallel group (``None``: the world communicator of ``pk.init()``).
        split: "out" (each rank owns output channels) or "in" (input channels); see the module
            docstring for the collectives and which one suits which layer.
        gather_output: "out" only; False returns this rank's output channels (N, c', *S').
        input_is_split: take this rank's input channels (N, c, *S) instead of the whole input.
        scatter_output: "in" only; True returns this rank's output channels, reduce-scattered.

    ``in_sizes`` / ``out_sizes`` list every rank's input / output channel block (the layout of
    split inputs and outputs); ``split_output`` says whether the output is such a block.
    Every rank must construct the layer: with ``split="in"`` the replicated bias is broadcast
    from rank 0, so that ranks seeded differently agree. Weights are drawn as ``nn.Conv*d``
    draws them (the whole weight, then this rank's block is kept), so under the same random
    state the layer holds the shard of the ``nn.Conv*d`` it replaces.
    """

    spatial_dims: int = 2
    """Spatial dimensions: 1 (N, C, L), 2 (N, C, H, W), 3 (N, C, D, H, W)."""
    dense_type: type[nn.Module] = nn.Conv2d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: PerDim,
        stride: PerDim = 1,
        padding: str | PerDim = 0,
        dilation: PerDim = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        comm: Communicator | None = None,
        split: str = "out",
        gather_output: bool = True,
        input_is_split: bool = False,
        scatter_output: bool = False,
    ) -> None:
        super().__init__()
        self.comm = comm if comm is not None else world()
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        dims = self.spatial_dims
        self.kernel_size, self.stride = per_dim(kernel_size, dims), per_dim(stride, dims)
        self.dilation = per_dim(dilation, dims)
        self.padding = padding if isinstance(padding, str) else per_dim(padding, dims)
        self.padding_mode, self.split = padding_mode, split
        self.gather_output, self.input_is_split = gather_output, input_is_split
        self.scatter_output = scatter_output
        # The output is this rank's block of the output channels, not the whole output.
        self.split_output = not gather_output or scatter_output
        self._check_arguments()
        self._pad = _reversed_padding(self.padding, self.kernel_size, self.dilation)

        size, rank = self.comm.size, self.comm.rank
        if groups > 1:  # whole groups per rank
            self.group_sizes = tensor_split_sizes(groups, size)
            self.in_sizes = [g * (in_channels // groups) for g in self.group_sizes]
            self.out_sizes = [g * (out_channels // groups) for g in self.group_sizes]
        else:
            self.group_sizes = [1] * size
            self.in_sizes = tensor_split_sizes(in_channels, size)
            self.out_sizes = tensor_split_sizes(out_channels, size)
        self.in_start = sum(self.in_sizes[:rank])
        self.out_start = sum(self.out_sizes[:rank])

        factory = dict(device=device, dtype=dtype)
        if split == "in" and groups == 1:
            shape = (out_channels, self.in_sizes[rank], *self.kernel_size)
        else:
            shape = (self.out_sizes[rank], in_channels // groups, *self.kernel_size)
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            n = out_channels if split == "in" else self.out_sizes[rank]
            self.bias = nn.Parameter(torch.empty(n, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    def _weight_block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a dense weight (C', C/groups, *kernel_size)."""
        rank = self.comm.rank
        if self.split == "in" and self.groups == 1:
            return full.narrow(1, self.in_start, self.in_sizes[rank])
        return full.narrow(0, self.out_start, self.out_sizes[rank])

    def _bias_block(self, full: torch.Tensor) -> torch.Tensor:
        if self.split == "in":
            return full
        return full.narrow(0, self.out_start, self.out_sizes[self.comm.rank])

    def reset_parameters(self) -> None:
        """``nn.Conv*d``'s initialization of the whole weight; this rank keeps its block."""
        w = self.weight
        shape = (self.out_channels, self.in_channels // self.groups, *self.kernel_size)
        full = torch.empty(shape, dtype=w.dtype, device=w.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        with torch.no_grad():
            w.copy_(self._weight_block(full))
            if self.bias is not None:
                fan_in = full[0].numel()
                full_bias = torch.empty(self.out_channels, dtype=w.dtype, device=w.device)
                nn.init.uniform_(full_bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
                self.bias.copy_(self._bias_block(full_bias))
                if self.split == "in" and self.comm.size > 1 and w.device.type != "meta":
                    self.comm.broadcast(self.bias.data, src=0, out=self.bias.data)

    @classmethod
    def from_dense(
        cls, dense: nn.Module, comm: Communicator | None = None, **kw
    ) -> ChannelParallelConvNd:
        """A layer holding this rank's block of ``dense``'s weight and bias (copies).

        ``kw``: ``split``, ``gather_output``, ``input_is_split``, ``scatter_output``.
        Every rank must pass the same ``dense``.
        """
        if not isinstance(dense, cls.dense_type):
            raise ValueError(
                f"{cls.__name__}.from_dense: expected an nn.{cls.dense_type.__name__}, got "
                f"{type(dense)}"
            )
        layer = cls(
            dense.in_channels,
            dense.out_channels,
            dense.kernel_size,
            dense.stride,
            dense.padding,
            dense.dilation,
            dense.groups,
            dense.bias is not None,
            dense.padding_mode,
            device="meta",
            dtype=dense.weight.dtype,
            comm=comm,
            **kw,
        )
        weight = layer._weight_block(dense.weight.detach()).clone(
            memory_format=torch.contiguous_format
        )
        layer.weight = nn.Parameter(weight, requires_grad=dense.weight.requires_grad)
        if dense.bias is not None:
            bias = layer._bias_block(dense.bias.detach()).clone()
            layer.bias = nn.Parameter(bias, requires_grad=dense.bias.requires_grad)
        return layer.train(dense.training)

    def to_dense(self) -> nn.Module:
        """The equivalent ``nn.Conv*d``, its weight gathered from every rank (call it on all)."""
        w = self.weight.detach()
        dense = self.dense_type(
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            self.bias is not None,
            self.padding_mode,
            device=w.device,
            dtype=w.dtype,
        )
        if self.split == "in" and self.groups == 1:
            full = self.comm.all_gather(w, 1, self.in_sizes)
        else:
            full = self.comm.all_gather(w, 0, self.out_sizes)
        with torch.no_grad():
            dense.weight.copy_(full)
            if self.bias is not None:
                b = self.bias.detach()
                dense.bias.copy_(
                    b if self.split == "in" else self.comm.all_gather(b, 0, self.out_sizes)
                )
        return dense.train(self.training)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self.groups > 1:
            return self._forward_groups(x)
        return self._forward_out(x) if self.split == "out" else self._forward_in(x)

    def _forward_out(self, x: torch.Tensor) -> torch.Tensor:
        """split="out": whole input, this rank's output channels."""
        if self.input_is_split:  # x_shard (N, c, *S); backward reduce-scatters
            x = pkf.all_gather(x, self.comm, 1, self.in_sizes)
        else:  # replicated x; backward sums the partial input gradients
            x = pkf.copy_to_group(x, self.comm)
        y_shard = self._conv(x, self.bias, 1)  # (N, c', *S')
        if not self.gather_output:
            return y_shard
        return pkf.gather_from_group(y_shard, self.comm, 1, self.out_sizes)

    def _forward_in(self, x: torch.Tensor) -> torch.Tensor:
        """split="in": this rank's input channels, a partial sum of every output channel."""
        x_shard = x if self.input_is_split else self._scatter_input(x)
        partial = self._conv(x_shard, None, 1)  # (N, C', *S'), this rank's share of the sum
        if not self.scatter_output:
            return _add_bias(pkf.reduce_from_group(partial, self.comm), self.bias)
        y_shard = pkf.reduce_scatter(partial, self.comm, 1, self.out_sizes)  # (N, c', *S')
        return _add_bias(y_shard, self._bias_shard())

    def _forward_groups(self, x: torch.Tensor) -> torch.Tensor:
        """groups > 1: this rank's whole groups form a grouped convolution of their own."""
        x_shard = x if self.input_is_split else self._scatter_input(x)
        if self.split == "out":
            bias = self.bias
        else:  # the replicated bias goes after the gather, or by block onto the shard
            bias = self._bias_shard() if self.split_output else None
        y_shard = self._conv(x_shard, bias, self.group_sizes[self.comm.rank])
        if self.split_output:
            return y_shard
        y = pkf.gather_from_group(y_shard, self.comm, 1, self.out_sizes)
        return y if self.split == "out" else _add_bias(y, self.bias)

    def _scatter_input(self, x: torch.Tensor) -> torch.Tensor:
        return pkf.scatter_to_group(x, self.comm, 1, self.in_sizes)

    def _conv(self, x: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
        conv = _CONV[self.spatial_dims]
        if self.padding_mode != "zeros":
            x = F.pad(x, self._pad, mode=self.padding_mode)
            return conv(x, self.weight, bias, self.stride, 0, self.dilation, groups)
        return conv(x, self.weight, bias, self.stride, self.padding, self.dilation, groups)

    def _bias_shard(self) -> torch.Tensor | None:
        """This rank's block of the replicated bias; backward all-gathers the block gradients,
        so every rank holds the whole bias gradient."""
        if self.bias is None:
            return None
        return pkf.scatter_to_group(self.bias, self.comm, 0, self.out_sizes)

    def extra_repr(self) -> str:
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}"
        )
        if set(self.dilation) != {1}:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        s += f", split={self.split!r}, comm={self.comm!r}"
        for flag, default in (
            ("gather_output", True),
            ("input_is_split", False),
            ("scatter_output", False),
        ):
            if getattr(self, flag) != default:
                s += f", {flag}={getattr(self, flag)}"
        return s


class ChannelParallelConv1d(ChannelParallelConvNd):
    """``torch.nn.Conv1d`` on (N, C, L) with its channels split over ``comm``; see
    :class:`ChannelParallelConvNd` for the arguments."""

    spatial_dims, dense_type = 1, nn.Conv1d


class ChannelParallelConv2d(ChannelParallelConvNd):
    """``torch.nn.Conv2d`` on (N, C, H, W) with its channels split over ``comm``; see
    :class:`ChannelParallelConvNd` for the arguments."""

    spatial_dims, dense_type = 2, nn.Conv2d


class ChannelParallelConv3d(ChannelParallelConvNd):
    """``torch.nn.Conv3d`` on (N, C, D, H, W) with its channels split over ``comm``; see
    :class:`ChannelParallelConvNd` for the arguments."""

    spatial_dims, dense_type = 3, nn.Conv3d


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.view(1, -1, *[1] * (y.dim() - 2))


def _reversed_padding(
    padding: str | tuple[int, ...], kernel_size: tuple[int, ...], dilation: tuple[int, ...]
) -> list[int]:
    """F.pad's (last dim's left, right, the one before's, ...) for a padding, as ``nn.Conv*d``
    computes it."""
    dims = len(kernel_size)
    if padding == "valid":
        return [0] * 2 * dims
    if padding == "same":
        pad = [0] * 2 * dims
        for d in range(dims):  # F.pad lists the last dim first
            total = dilation[d] * (kernel_size[d] - 1)
            at = 2 * (dims - 1 - d)
            pad[at], pad[at + 1] = total // 2, total - total // 2
        return pad
    return list(_reverse_repeat_tuple(padding, 2))
