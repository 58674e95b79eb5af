"""Batch normalization whose statistics cover every rank of a communicator, on any backend.

torch's ``nn.SyncBatchNorm`` trains on CUDA only; ChainerMN's and torch_xla's average the
per-rank statistics with equal weights, which is wrong when ranks hold different batch sizes.
Here each rank computes ``(count, mean, M2)`` of its own slice in float32, the ranks exchange
them in one all-gather, and every rank merges them by count with Chan et al.'s formula. The
backward sums two per-channel reductions in one all-reduce. The same code serves the
data-parallel world, a sub-group, or the ranks that each hold a band of the same images
(spatial parallelism), where the statistics then cover the whole image.

The global count stays a device tensor: reading it on the host would stall a GPU stream every
forward (and, on XLA, run the graph mid-step). Only a rank whose own slice holds at most one
value per channel reads it, for torch's checks: the global count can be 1 (an error) or 0
(nothing to update) only when every rank's slice is that small, so either every rank reads it
and they all agree, or the count is known to be at least 2 without a read. On XLA two CPU
kernels that XLA does not lower (``batch_norm_update_stats``, eval-mode
``native_batch_norm_backward``) are replaced by their lowered equivalents.

Legend: x (N_r, C, *S) is this rank's slice, N_r may differ between ranks and may be 0;
``n`` counts the values per channel (N_r * prod(S)) on this rank, ``count`` over all ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from parallelkit.comm import Communicator, world
from parallelkit.spatial import record

_DENSE = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm1d/2d/3d`` with batch statistics over all ranks of ``comm``.

    Takes the arguments of ``torch.nn.BatchNorm*d`` plus ``comm`` (``None``: the world
    communicator of ``pk.init()``, looked up at the first forward) and accepts any input of
    shape (N, C, *S): (N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W), in any memory format,
    in float32/float64, or float16/bfloat16 with the statistics computed and merged in float32.
    Parameter gradients are this rank's share of the whole batch's gradient: data parallelism
    averages them over ranks as it does for every other parameter.

    Eval mode with running statistics, and a communicator of one rank, run plain
    ``F.batch_norm`` and communicate nothing.

    ``grad_comm``: when this layer's input is a block of images split over ranks (spatial
    parallelism) and every rank computes the same loss, each rank's parameter gradient is a
    share of the dense one; ``grad_comm`` (the ranks holding blocks of the same images) sums
    the shares, so every rank holds the dense gradient after backward.
    """

    takes_blocks = "norm"  # parallelkit.spatial.blocks

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        comm: Communicator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        grad_comm: Communicator | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.comm, self.grad_comm = comm, grad_comm

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an (N, C, ...) input, got shape {x.shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if getattr(self, "_input_dim", None) != x.dim():  # a Module attribute write costs us
            self._input_dim = x.dim()
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): input has {x.shape[1]} channels "
                f"(shape {tuple(x.shape)}); channels are dim 1"
            )
        # Momentum and the cumulative average (momentum=None), as torch.nn.BatchNorm*d does.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or self.running_mean is None
        running = not self.training or self.track_running_stats
        return sync_batch_norm(
            x,
            self.running_mean if running else None,
            self.running_var if running else None,
            self.weight,
            self.bias,
            batch_stats,
            factor,
            self.eps,
            comm=self.comm if self.comm is not None else world(),
            grad_comm=self.grad_comm,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, comm={self.comm!r}"

    def communicators(self) -> tuple[Communicator | None, Communicator | None]:
        """(statistics, parameter-gradient) communicators, for ``use_communicators``."""
        return self.comm, self.grad_comm

    def use_communicators(self, comm: Communicator | None, grad_comm: Communicator | None) -> None:
        self.comm, self.grad_comm = comm, grad_comm

    def to_dense(self) -> nn.Module:
        """The plain ``torch.nn.BatchNorm*d`` holding this layer's parameters and buffers.

        Which of 1d/2d/3d: from the last input's rank, else the layer it was made from, else 2d.
        """
        dense = _DENSE[getattr(self, "_input_dim", 4)](
            self.num_features, self.eps, self.momentum, self.affine, self.track_running_stats
        )
        return _copy_state(self, dense)

    @classmethod
    def from_dense(
        cls,
        dense: _BatchNorm,
        comm: Communicator | None = None,
        *,
        grad_comm: Communicator | None = None,
    ) -> SyncBatchNorm:
        """A SyncBatchNorm holding ``dense``'s parameters, buffers and training mode."""
        sync = cls(
            dense.num_features,
            dense.eps,
            dense.momentum,
            dense.affine,
            dense.track_running_stats,
            comm,
            grad_comm=grad_comm,
        )
        sync._input_dim = _dense_input_dim(dense)
        return _copy_state(dense, sync)


def sync_batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    comm: Communicator,
    grad_comm: Communicator | None = None,
) -> torch.Tensor:
    """``F.batch_norm`` with the batch statistics of every rank of ``comm`` (same arguments).

    ``grad_comm`` sums the parameter-gradient shares over the ranks holding blocks of the same
    images (see :class:`SyncBatchNorm`). Normalizing with given statistics, and a communicator
    of one rank, is plain ``F.batch_norm``.
    """
    if grad_comm is not None:
        weight = None if weight is None else record.replicated(weight, grad_comm)
        bias = None if bias is None else record.replicated(bias, grad_comm)
    # One rank: plain batch_norm, except on XLA, whose batch_norm updates running_var with
    # the biased variance (torch uses the unbiased one): there the path below does it.
    if not training or (comm.size == 1 and not _on_xla(x)):
        return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, comm)


def _copy_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    if src.affine:
        dst.weight, dst.bias = src.weight, src.bias
    if src.track_running_stats:
        dst.running_mean, dst.running_var = src.running_mean, src.running_var
        dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def _dense_input_dim(dense: _BatchNorm) -> int:
    for kind, dim in ((nn.BatchNorm1d, 3), (nn.BatchNorm2d, 4), (nn.BatchNorm3d, 5)):
        if isinstance(dense, kind):
            return dim
    return 4


# --------------------------------------------------------------------------- statistics
def _local_stats(x: torch.Tensor) -> torch.Tensor:
    """Packed ``[n, mean (C), var (C)]`` of this rank's slice (biased variance), in float32
    (float64 for f64).

    Two small operations besides the pass over ``x``: each costs a few microseconds, as much
    as the collective itself, and on a GPU each is a kernel launch.
    """
    stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.numel() // x.shape[1]
    if n == 0:
        return torch.zeros(1 + 2 * x.shape[1], dtype=stat_dtype, device=x.device)
    # torch's own one-pass, numerically stable per-channel kernel (3x faster on CPU than
    # var_mean over dims (0, 2, 3)); it keeps 16-bit inputs' dtype, hence the float copy.
    # Not lowered to XLA (it would run on the host, ending the graph), and no fake-tensor
    # kernel for torch.compile's tracing (it would break the graph).
    if _on_xla(x) or torch.compiler.is_compiling():
        var, mean = torch.var_mean(_as(x, stat_dtype), [0, *range(2, x.dim())], correction=0)
    else:
        mean, var = torch.batch_norm_update_stats(_as(x, stat_dtype), None, None, 0.0)
    return torch.cat((mean.new_full((1,), n), mean, var))


def _on_xla(x: torch.Tensor) -> bool:
    """XLA tensor: its values exist only once the step's graph runs."""
    return x.device.type == "xla"


def _merge(gathered: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s parallel merge of per-rank ``(n, mean, var)`` rows: the global mean,
    biased variance and count.

    With weights w_r = n_r / count:  mean = sum_r w_r mean_r;
    var = sum_r w_r (var_r + (mean_r - mean)^2)  (= M2 / count). Differences of means, never
    of raw sums of squares, so large means lose no precision. The count is a 0-d tensor on the
    data's device; an all-empty batch gives zeros. Nine small operations.
    """
    n = gathered[:, :1]
    means, variances = gathered[:, 1 : 1 + c], gathered[:, 1 + c :]
    count = n.sum()
    w = n / count.clamp(min=1)
    mean = (w * means).sum(0)
    d = means - mean
    return mean, (w * torch.addcmul(variances, d, d)).sum(0), count


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without a call where it is already (even a no-op ``.to`` costs
    microseconds, and a layer would make eight a step)."""
    return t if t.dtype == dtype else t.to(dtype)


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``v`` (C,) shaped to broadcast against ``x`` (N, C, *S)."""
    return v.view(-1, *([1] * (x.dim() - 2)))


class _SyncBatchNorm(Function):
    """y = (x - mean) * invstd * weight + bias with mean and invstd over all ranks' slices."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor, eps, comm):  # type: ignore[override]
        c = x.shape[1]
        local = _local_stats(x)
        # One all-gather of every rank's (n, mean, var): Chan's merge needs each rank's triple.
        # (An all-reduce of sums and sums of squares would be as cheap, but E[x^2] - E[x]^2
        # cancels catastrophically when |mean| >> std.)
        gathered = comm.all_gather(local.view(1, -1), sizes=[1] * comm.size)
        mean, var, count = _merge(gathered, c)
        # The count's value, read only where it can be below 2 (see the module docstring);
        # never under torch.compile, where a read would end the graph on the ranks whose
        # slices are small and not on the others: there a count of 0 updates nothing
        # (arithmetically, below), and a count of 1 is not checked.
        tracing = torch.compiler.is_compiling()
        known = round(float(count)) if x.numel() <= c and not tracing else None
        if known == 1:
            raise ValueError(
                "SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"1 over all {comm.size} ranks (this rank's input: {tuple(x.shape)})"
            )
        if running_mean is not None and known != 0:
            # running += factor (new - running), both in one fused call; the variance unbiased
            new_mean, unbiased = mean, var * (count / (count - 1))
            if tracing:
                new_mean = torch.where(count > 0, mean, _as(running_mean, mean.dtype))
                unbiased = torch.where(count > 0, unbiased, _as(running_var, var.dtype))
            torch._foreach_lerp_(
                [running_mean, running_var],
                [_as(new_mean, running_mean.dtype), _as(unbiased, running_var.dtype)], factor,
            )  # fmt: skip
        ctx.comm, ctx.count, ctx.eps = comm, count, eps
        ctx.save_for_backward(x, weight, mean, var)
        if x.numel() == 0:
            return x.clone()
        # Normalizing with given statistics is what eval-mode batch_norm does, in one fused pass
        # (it wants the statistics in the parameters' dtype when those are 16-bit).
        if weight is not None and weight.dtype != mean.dtype:
            mean, var = _as(mean, weight.dtype), _as(var, weight.dtype)
        return _normalize(x, mean, var, weight, bias, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        comm, count, eps = ctx.comm, ctx.count, ctx.eps
        c = x.shape[1]
        stat_dtype = mean.dtype
        # Local per-channel sums  sum(dy)  and  sum(dy * xhat), fused in one pass: training-mode
        # batch_norm_backward given the global mean and invstd as its saved statistics computes
        # exactly these as the bias and weight gradients. They are this rank's parameter
        # gradients, too. (The eval-mode form, given running statistics, is not served
        # everywhere: CUDA asserts that the saved statistics are defined, XLA lowers only this,
        # and only given a weight of the statistics' dtype for 16-bit inputs.)
        invstd = torch.rsqrt(var + eps)
        if grad.device.type == "cpu" and grad.stride() != x.stride():
            # torch's CPU kernel reads the gradient as laid out like the input wherever both
            # pass its contiguity checks, and a batch of one whose gradient is channels last
            # in memory (a class token's cat backward leaves it so) passes the channels-last
            # one: the sums come out wrong. Given the input's layout, it reads it right.
            grad = torch.empty_like(x).copy_(grad)
        if x.numel() == 0:  # an empty rank still joins the all-reduce
            sum_dy_xhat, sum_dy = mean.new_zeros(c), mean.new_zeros(c)
        else:
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad, x, torch.ones_like(mean), None, None, mean, invstd, True, eps,
                [False, True, True],
            )  # fmt: skip
        grad_weight = _as(sum_dy_xhat, weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = _as(sum_dy, weight.dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # One all-reduce of both sums: the input gradient needs their whole-batch values.
            sums = comm.all_reduce(_as(torch.cat([sum_dy, sum_dy_xhat]), stat_dtype))
            grad_x = _input_grad(grad, x, weight, mean, var, invstd, eps, sums, count)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _input_grad(grad, x, weight, mean, var, invstd, eps, sums, count):
    """dx = w invstd (dy - sum(dy)/count - xhat sum(dy xhat)/count) in two passes over the batch.

    That is ``scale dy + xhat k - scale sum(dy)/count`` per channel, with scale = w invstd and
    k = -scale sum(dy xhat)/count. The last two terms are the forward's own normalization of x
    (the same mean, var and eps) with weight k and bias -scale sum(dy)/count: torch's fused
    per-channel affine kernel, which on the CPU is 2.5x faster than ``addcmul`` with
    per-channel operands (CPU torch has no ``batch_norm_backward_elemt``, which fuses all of
    it on CUDA). The first term is added in place.
    """
    if x.numel() == 0:
        return torch.zeros_like(x)
    scale = invstd if weight is None else invstd * _as(weight, invstd.dtype)
    # rows: the bias -scale mean(dy) and the weight k = -scale mean(dy xhat), C each
    terms = sums.view(2, -1) / -count * scale
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        grad, x = grad.float(), x.float()
    dx = _normalize(x, mean, var, terms[1], terms[0], eps)
    dx.addcmul_(grad, _per_channel(scale, x))
    return _as(dx, dtype)


def _normalize(x, mean, var, weight, bias, eps):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` per channel: eval-mode batch norm, one
    fused pass (``torch.batch_norm`` itself: ``F.batch_norm``'s checks cost microseconds and
    are for training mode)."""
    return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps,
                            torch.backends.cudnn.enabled)  # fmt: skip
