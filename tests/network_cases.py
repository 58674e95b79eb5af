"""Rank-side whole-network cases: a parallelized network against the dense one, over SGD steps.

Every rank builds the same dense network and a copy that ``pk.parallelize`` converts. Each step
the dense network trains on the whole batch; the parallel one gets the same whole input on
every rank of a model-parallel group (its data group's slice of the batch when there is a data
dimension). Triples: the logits and loss every step, every gradient that is whole on this rank
(replicated parameters), and after every step all parameters and BatchNorm statistics of
``pk.to_dense(model)``, which gathers sharded weights.
"""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_structure

import parallelkit as pk
from parallelkit.comm import Communicator
from parallelkit.geometry import starts
from parallelkit.models import Bottleneck, Discriminator, Generator, ResNet, resnet18

Triple = tuple[str, torch.Tensor, torch.Tensor]


class BatchNormAct2d(nn.BatchNorm2d):
    """Written like timm's ``BatchNormAct2d``: a BatchNorm2d subclass whose own forward calls
    ``F.batch_norm`` and then an activation (here a leaky ReLU, so that dropping it shows)."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked
        stats = self.training or self.running_mean is None
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, stats, factor, self.eps
        )
        return self.act(x)


# name -> (build, input shape without batch, loss of (output, target), keep_dense)
NETWORKS = {
    "resnet18": (
        lambda: resnet18(widths=(4, 6, 8, 8), num_classes=5),
        (3, 32, 32),
        lambda out, t: F.cross_entropy(out, t % 5, reduction="sum"),
        (),
    ),
    # Bottleneck blocks (1x1 convs, the stride on the 3x3, identity and projection shortcuts);
    # inner widths 3 and 5 split unevenly, and some convs have fewer channels than ranks.
    "bottleneck resnet": (
        lambda: ResNet((1, 2), widths=(3, 5), num_classes=5, stem="cifar", block=Bottleneck),
        (3, 16, 16),
        lambda out, t: F.cross_entropy(out, t % 5, reduction="sum"),
        (),
    ),
    # A BatchNorm subclass with behaviour of its own (timm's BatchNormAct2d): kept, synchronized.
    "bottleneck resnet, BatchNormAct2d": (
        lambda: ResNet(
            (1, 1),
            widths=(3, 5),
            num_classes=5,
            stem="cifar",
            block=Bottleneck,
            norm_layer=BatchNormAct2d,
            act_layer=nn.Identity,
        ),
        (3, 16, 16),
        lambda out, t: F.cross_entropy(out, t % 5, reduction="sum"),
        (),
    ),
    "dcgan generator": (
        lambda: Generator(nz=6, ngf=4, nc=3, image_size=16),
        (6, 1, 1),
        lambda out, t: (out - 0.1 * t.view(-1, 1, 1, 1)).square().sum(),
        (),
    ),
    "dcgan discriminator": (
        lambda: Discriminator(ndf=4, nc=3, image_size=16),
        (3, 16, 16),
        lambda out, t: F.binary_cross_entropy_with_logits(
            out, (t % 2).to(out.dtype), reduction="sum"
        ),
        ("head",),
    ),
}


# (ranks, strategy, grid): every strategy on 2 ranks and the 4-rank grids, for the tiers that run
# the networks once per device (lazy tensors, CUDA).
STRATEGY_GRIDS = [
    (2, "data", None),
    (2, "spatial", None),
    (2, "channel", None),
    (4, "spatial", dict(rows=2, cols=2)),
    (4, "spatial", dict(data=2, rows=2)),
    (4, "channel", dict(data=2, channel=2)),
]


# ----------------------------------------------------------------------------- forward code
# Networks whose forward code, not their leaf layers, decides correctness under spatial
# parallelism: the patterns of torchvision's, timm's and smp's models, written small.
class MaxPool2dSame(nn.MaxPool2d):
    """timm's ``MaxPool2dSame`` as timm 1.0 writes it: TensorFlow's "same" padding computed
    from the input's size (``pad_same``), then pooling without padding. The spatial guard
    knows timm's "same" modules by class and module, which this stand-in takes."""

    __module__ = "timm.layers.pool2d_same"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for n in reversed(x.size()[-2:]):  # W first, as F.pad wants
            total = max((math.ceil(n / self.stride) - 1) * self.stride + self.kernel_size - n, 0)
            pads += [total // 2, total - total // 2]
        x = F.pad(x, pads, value=-float("inf"))
        return F.max_pool2d(x, self.kernel_size, self.stride, 0, self.dilation, self.ceil_mode)


class SqueezeExcite(nn.Module):
    """torchvision's SqueezeExcitation (pool module) or timm's (``x.mean((2, 3))``)."""

    def __init__(self, c: int, functional_mean: bool) -> None:
        super().__init__()
        self.functional_mean = functional_mean
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, 2, 1), nn.Conv2d(2, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True) if self.functional_mean else self.pool(x)
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(s))))


class ForwardCodeNet(nn.Module):
    """conv-BN-ReLU, a block chosen by ``kind``, conv, then a head (global pool + Linear, or
    a dict of the per-pixel map and a pooled vector)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        # Only what this kind uses (DataParallel wants a gradient for every parameter).
        if kind.startswith("se"):
            self.se = SqueezeExcite(6, functional_mean=kind == "se mean")
        if kind == "layer scale":
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 6))
            self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        if kind == "cat":
            self.side = nn.Conv2d(6, 2, 1)
        if kind == "eca and repeat":  # ECA's 1-D convolution over the pooled channels
            self.eca = nn.Conv1d(1, 1, 3, padding=1, bias=False)
        if kind == "pooled batchnorm":  # BatchNorm on the pooled (whole) vector
            self.fc1, self.bn = nn.Conv2d(6, 3, 1), nn.BatchNorm2d(3)
            self.fc2 = nn.Conv2d(3, 6, 1)
        if kind == "pyramid pooling":  # PSPNet / DeepLab: pooled, resized back, concatenated
            self.branch = nn.Sequential(nn.Conv2d(6, 2, 1), nn.BatchNorm2d(2), nn.ReLU())
            self.merge = nn.Conv2d(8, 6, 1)
        if kind == "group norm":  # smp's FPN decoder; InstanceNorm too
            self.gn, self.inorm = nn.GroupNorm(2, 6), nn.InstanceNorm2d(6, affine=True)
        if kind == "unet up":
            self.down = nn.Conv2d(6, 6, 3, stride=2, padding=1)
        if kind == "padding modes":  # nn.Conv2d's padding_mode: F.pad, then F.conv2d
            self.modes = nn.ModuleList(
                nn.Conv2d(6, 6, 3, padding=p, dilation=p, padding_mode=mode, groups=g)
                for mode, p, g in (("reflect", 2, 1), ("replicate", 1, 3), ("circular", 3, 6))
            )
        if kind == "layer norm chw":  # a WGAN-GP critic's LayerNorm over C, H and W
            self.ln = nn.LayerNorm([6, 12, 10])
            with torch.no_grad():  # not the default ones and zeros: each place its own
                self.ln.weight.uniform_(0.5, 1.5), self.ln.bias.uniform_(-0.5, 0.5)
        if kind == "tf same pool":  # 11 x 10 maps: rows split 6 + 5, and only 5 rows pad
            self.valid, self.same_pool = nn.Conv2d(6, 6, (2, 1)), MaxPool2dSame(2, 2)
        if kind == "upcat pad":  # 11 x 10 maps: rows split 6 + 5
            self.valid = nn.Conv2d(6, 6, (2, 1))
        if kind == "channels-last ops":
            self.proj = nn.Parameter(torch.randn(6, 6) / 3)
            self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        if kind in ("window attention", "windows across blocks"):  # qkv, a position bias
            ws = 3 if kind == "window attention" else 4
            self.qkv = nn.Parameter(torch.randn(18, 6) / 3)
            self.rel = nn.Parameter(torch.randn(ws * ws, ws * ws) / 4)
        if kind == "halo attention":  # HaloNet: queries, keys with a halo, relative logits
            self.rel_w = nn.Parameter(torch.randn(2 * 7 - 1, 6) / 3)  # key windows 8 x 7
            self.rel_h = nn.Parameter(torch.randn(2 * 8 - 1, 6) / 3)
        if kind == "relative logits":  # BotNet: the tables of relative positions along W, H
            self.rel_w = nn.Parameter(torch.randn(2 * 10 - 1, 6) / 3)
            self.rel_h = nn.Parameter(torch.randn(2 * 12 - 1, 6) / 3)
        if kind == "token pooling":  # Next-ViT: keys pooled over the flattened tokens
            self.sr, self.sr2 = nn.AvgPool1d(16), nn.AvgPool1d(12, 8)
            self.norm = nn.BatchNorm1d(6)
        if kind == "recurrent":  # Sequencer: an LSTM along each row
            self.rnn = nn.LSTM(6, 6, batch_first=True)
        if kind == "lambda positions":  # LambdaNet: Conv3d over (N, 1, H, W, V), window 1 on V
            self.lam = nn.Conv3d(1, 4, (3, 3, 1), padding=(1, 1, 0))
            self.down = nn.Conv3d(1, 2, (3, 3, 1), stride=(2, 2, 1), padding=(1, 1, 0))
        if kind == "global query":  # GCViT: keys and values of each window
            self.kv = nn.Linear(6, 12)
        if kind == "coordinates":  # a positional embedding of the whole size, a parameter
            self.pos = nn.Parameter(torch.randn(1, 6, 12, 10) / 4 + 1)
        if kind == "patches in the batch":  # TNT: a convolution over each patch's pixels
            self.inner = nn.Conv2d(6, 6, 3, padding=1)
        if kind == "warp":  # a displacement field; an affine transform's parameters
            self.flow = nn.Conv2d(6, 2, 3, padding=1)
            self.theta = nn.Parameter(torch.tensor([[0.9, 0.1, 0.05], [-0.1, 1.0, 0.02]]))
        if kind == "pooled windows":  # SAM2's Hiera: each window's queries pooled inside it
            self.win_max, self.win_avg = nn.MaxPool2d(2), nn.AvgPool2d(2)
        if kind == "space to depth":  # mixes the 4 pixels of each 2 x 2 cell
            self.mix = nn.Conv2d(24, 24, 1)
        if kind == "functional conv":  # weight standardization (timm's StdConv2d, BiT)
            self.w, self.b = nn.Parameter(torch.randn(6, 6, 3, 3) / 6), nn.Parameter(torch.zeros(6))
        if kind == "same padding":  # timm's Conv2dSame: F.pad, then a convolution without
            self.strided = nn.Conv2d(6, 6, 3, stride=2)
        if kind == "axis mixing":  # matrices over the whole H (12) and W (10)
            self.bat_p = nn.Parameter(torch.randn(12, 12))
            self.bat_q = nn.Parameter(torch.randn(10, 10))
            self.mix_h, self.mix_w = nn.Linear(12, 12), nn.Linear(10, 10)
        if kind == "rms norms":  # over a token's channels (timm's RmsNorm), over a whole sample
            self.rms = nn.RMSNorm(6)
            self.rms_whole = nn.Parameter(torch.randn(6, 12, 10) / 4 + 1)
        if kind == "convnext block":
            self.dw = nn.Conv2d(6, 6, 7, padding=3, groups=6)
            self.ln = nn.LayerNorm(6)
            self.mlp = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.conv = nn.Conv2d(8 if kind == "cat" else 6, 4, 3, stride=2, padding=1)
        if kind != "flatten":  # its head is the flatten alone
            self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 5)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k.startswith("se"):
            return self.se(x)
        if k == "layer scale":  # ConvNeXt's gamma, used directly on the blocks
            return x + self.dw(x) * self.gamma.view(1, -1, 1, 1)
        if k == "channel shuffle":  # ShuffleNet's: reshapes that keep H and W
            n, c, h, w = x.shape
            return x.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        if k == "eca and repeat":  # timm's ECA gate (expand_as), MONAI VNet's channel repeat
            y = x.mean((2, 3), keepdim=True)  # (N, C, 1, 1): whole
            y = self.eca(y.squeeze(-1).transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
            return x * torch.sigmoid(y).expand_as(x) + x[:, :3].repeat(1, 2, 1, 1)
        if k == "cat":  # DenseNet's concatenation along channels
            return torch.cat([x, self.side(x)], dim=1)
        if k == "axis mixing":  # BAT's bilinear transform p @ x @ q, its matrices made from
            # pooled features (whole); sMLP's linear maps along W, and along H after a transpose
            gate = F.adaptive_avg_pool2d(x, 1).sigmoid()  # (N, C, 1, 1)
            p, q = (gate * self.bat_p).softmax(-1), (gate * self.bat_q).softmax(-2)
            y = p @ x @ q
            return y + self.mix_w(x) + self.mix_h(x.transpose(-1, -2)).transpose(-1, -2)
        if k == "rms norms":  # RMSNorm over channels last, and over (C, H, W) with its weight
            y = self.rms(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            return y + F.rms_norm(x, x.shape[1:], self.rms_whole, eps=1e-4)
        if k == "convnext block":  # channels-last LayerNorm and Linear, layer scale
            y = self.ln(self.dw(x).permute(0, 2, 3, 1))
            return x + (self.gamma * self.mlp(y)).permute(0, 3, 1, 2)
        if k == "pooled batchnorm":
            s = F.relu(self.bn(self.fc1(self.pool(x))))
            return x * torch.sigmoid(self.fc2(s))
        if k == "unet up":  # down, then up to the skip connection's size (bilinear)
            return x + F.interpolate(self.down(x), size=x.shape[-2:], mode="bilinear")
        if k == "pyramid pooling":
            pooled = self.branch(F.adaptive_avg_pool2d(x, (2, 3)))
            up = F.interpolate(pooled, size=x.shape[-2:], mode="bilinear", align_corners=True)
            return self.merge(torch.cat([x, up], dim=1))
        if k == "inception pools":  # functional pooling in forward code (Inception's), and LP
            lp = F.lp_pool2d(F.pad(x, (1, 1, 1, 1)), 2, 3, 1)  # the rule made of the others
            return F.avg_pool2d(x, 3, stride=1, padding=1) + F.max_pool2d(x, 3, 1, 1) + lp
        if k == "group norm":
            return self.inorm(F.relu(self.gn(x)))
        if k == "upsample x2":  # smp's decoders: nearest, by a scale factor
            return F.interpolate(x, scale_factor=2)
        if k == "global max":  # max over H and W (CBAM's channel and spatial attention)
            spatial = x.amax(1, keepdim=True)  # over channels: local
            return x * x.amax((2, 3), keepdim=True) + F.adaptive_max_pool2d(x, 1) * spatial
        if k == "padding modes":
            return sum(conv(x) for conv in self.modes)
        if k == "tf same pool":  # 12 x 10 -> 11 x 10 -> 6 x 5 -> 12 x 10
            return x + F.interpolate(self.same_pool(self.valid(x)), scale_factor=2)
        if k == "layer norm chw":
            return self.ln(x)
        if k == "instance statistics":  # AdaIN-style: var and std over H and W
            centred = x - x.mean((2, 3), keepdim=True)
            spread = x.std((1, 2, 3), correction=0).view(-1, 1, 1, 1)
            return centred / (x.var((2, 3), keepdim=True) + 1e-5).sqrt() + spread
        if k == "functional conv":
            w = F.batch_norm(self.w.reshape(1, 6, -1), None, None, training=True).view(6, 6, 3, 3)
            down = F.conv2d(x, w, self.b, stride=2, padding=1)  # 12 x 10 -> 6 x 5
            return F.interpolate(down, scale_factor=2) + F.conv2d(x, w, None, 1, (2, 1), (2, 1))
        if k == "dynamic pad":  # padding to a multiple of 4, computed from x.shape
            return F.pad(x, (0, -x.shape[-1] % 4, 0, -x.shape[-2] % 4))
        if k == "interpolate to a literal size":  # the whole size, written in the code
            return F.interpolate(x, size=(24, 20))
        if k == "interpolate":  # a segmentation head resizing to a size of its own
            return F.interpolate(x, size=(x.shape[-2] + 1, x.shape[-1]), mode="bilinear")
        if k == "interpolate align_corners":
            return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)
        if k == "interpolate to a size, align_corners":  # smp's FPN-style merge, gathered
            small = F.avg_pool2d(x, 2)
            return x + F.interpolate(small, size=x.shape[-2:], mode="bilinear", align_corners=True)
        if k == "dropout":
            return F.dropout(x, 0.2, self.training)
        if k == "sampling":  # a VAE's latent, mu + sigma * noise; noise in channels-last memory
            z = x[:, :3] + torch.exp(0.5 * x[:, 3:]) * torch.randn_like(x[:, :3])
            return torch.cat([z, z], 1) + torch.rand_like(x.to(memory_format=torch.channels_last))
        if k == "mean by hand":  # sums over H * W and numel() read from x.shape
            mean = x.sum((2, 3), keepdim=True) / (x.shape[2] * x.shape[3])
            return x - mean + x.sum((2, 3), keepdim=True) / x[0, 0].numel()
        if k == "space to depth":  # timm's SpaceToDepth and DepthToSpace, pixel (un)shuffle
            x = F.pad(x, (0, -x.shape[-1] % 4))  # 12 x 12: blocks of 6 rows and columns
            n, c, h, w = x.shape
            y = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
            y = self.mix(y.reshape(n, c * 4, h // 2, w // 2)).view(n, 2, 2, c, h // 2, w // 2)
            y = y.permute(0, 3, 4, 1, 5, 2).reshape(n, c, h, w)
            return y + F.pixel_shuffle(F.pixel_unshuffle(x, 2).sigmoid(), 2)
        if k == "cyclic shift":  # Swin's shifted windows, channels last, and back
            y = torch.roll(x, shifts=(-3, 4), dims=(2, 3)) * torch.sigmoid(x)
            return x + torch.roll(y.permute(0, 2, 3, 1), shifts=(3, -4), dims=(1, 2)).permute(
                0, 3, 1, 2
            )
        if k == "window attention":  # Swin: windows of 3 on 12 x 12 (blocks of 6), merging
            y = F.pad(x, (0, -x.shape[-1] % 6)).permute(0, 2, 3, 1)
            y = y + shifted_window_attention(y, self.qkv, self.rel, 3, 1)
            y = torch.cat([y[:, 0::2, 0::2], y[:, 1::2, 1::2]], -1).permute(0, 3, 1, 2)
            return y[:, :6] * y[:, 6:]  # (N, 6, 6, 6)
        if k == "windows across blocks":  # windows of 4 on 12 x 12: blocks of 6 rows (and
            # columns) are not whole windows, so rows move to 8 + 4 and back
            y = F.pad(x, (0, -x.shape[-1] % 4)).permute(0, 2, 3, 1)
            y = y + shifted_window_attention(y, self.qkv, self.rel, 4, 2)
            return y.permute(0, 3, 1, 2)
        if k == "strides across blocks":  # patch merging on 12 x 10: columns in blocks of 5
            # keep 2 and 3 of 1::2, not 3 and 2; each rank fetches its 3 and 2 first
            y = torch.cat([x[..., 0::2, 0::2], x[..., 1::2, 1::2], x[..., 0::2, 1::2]], 1)
            return y[:, :6] * y[:, 6:12] + y[:, 12:] - x[..., 1::2, 0::2]  # (N, 6, 6, 5)
        if k == "reference grid":  # MONAI's Warp: a whole grid of coordinates made from the
            # sample's size, given the block's dtype by .to(x) and type_as: whole, then cut
            n, c, h, w = x.shape
            grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"))
            grid = grid.to(x)
            grid.requires_grad = False
            ramp = torch.linspace(0, 1, w).expand(1, c, h, w).type_as(x)
            return x * (1 + 0.01 * grid.sum(0)) + ramp
        if k == "warp":  # a registration network's spatial transformer (VoxelMorph, MONAI's
            # Warp): a whole identity grid made from the sample's size plus a displacement of
            # up to 2 pixels, the input sampled there; then an affine transform's whole grid
            n, c, h, w = x.shape
            ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            loc = torch.stack((xs, ys)).to(x) + 2 * torch.tanh(self.flow(x))
            loc = torch.stack((2 * loc[:, 0] / (w - 1) - 1, 2 * loc[:, 1] / (h - 1) - 1), -1)
            y = F.grid_sample(x, loc, align_corners=True)
            grid = F.affine_grid(self.theta.expand(n, 2, 3), [n, c, h, w], align_corners=False)
            z = F.grid_sample(y, grid, mode="nearest", padding_mode="border", align_corners=False)
            return y + z + F.grid_sample(y, grid, align_corners=False)
        if k == "flips and running sums":  # test-time flips and integral images written into
            # the forward, on 13 x 11 maps (blocks of 7 + 6 rows and 6 + 5 columns on 2 ranks)
            y = F.pad(x, (0, 1, 0, 1))
            y = y.flip(2) * torch.sigmoid(y) + torch.flip(y, dims=(-1, 1))
            y = y.cumsum(2) / 13 + torch.cumsum(y, dim=-1) / 11 + y.cumsum(1) / 3
            return (y + (0.5 + y.sigmoid()).cumprod(3))[..., :12, :10]
        if k == "pooled windows":  # SAM2: windows of 4 x 2 folded into the batch (rows and
            # columns move to whole windows), each max- and average-pooled by 2 inside it
            n, c, h, w = x.shape
            p = x.view(n, c, h // 4, 4, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, c, 4, 2)
            q = (self.win_max(p) + self.win_avg(p)).view(n, h // 4, w // 2, c, 2, 1)
            return q.permute(0, 3, 1, 4, 2, 5).reshape(n, c, h // 2, w // 2)
        if k == "patches in the batch":  # TNT: 4 x 5 patches of 12 x 10 folded into the batch
            # (rows move to whole patches on blocks of 6), a 3 x 3 convolution inside each
            n, c, h, w = x.shape
            p = x.view(n, c, h // 4, 4, w // 5, 5).permute(0, 2, 4, 1, 3, 5)
            y = self.inner(p.reshape(-1, c, 4, 5)).view(n, h // 4, w // 5, c, 4, 5)
            return x + y.permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)
        if k == "halo attention":  # HaloNet's blocked attention on 12 x 10: blocks of 6 x 5
            # (whole ones on every grid), keys from windows of 8 x 7 (a halo of 1) with
            # relative logits (timm's skew and expand); then one block of the whole map, whose
            # single key window one rank holds
            n, c, h, w = x.shape
            q = x.view(n, c, 2, 6, 2, 5).permute(0, 2, 4, 3, 5, 1).reshape(n, 4, 30, c)
            kv = F.pad(x, (1, 1, 1, 1)).unfold(2, 8, 6).unfold(3, 7, 5)  # (n, c, 2, 2, 8, 7)
            k = kv.permute(0, 2, 3, 4, 5, 1).reshape(n, 4, 56, c)
            blocks = q.reshape(-1, 6, 5, c)
            rel = halo_logits(blocks, self.rel_w, 8).permute(0, 1, 3, 2, 4)  # (., 6, 5, 8, 7)
            rel = rel + halo_logits(blocks.transpose(1, 2), self.rel_h, 7).permute(0, 3, 1, 4, 2)
            attn = (q @ k.transpose(-1, -2) + rel.reshape(n, 4, 30, 56)).softmax(-1)
            y = (attn @ k).view(n, 2, 2, 6, 5, c).permute(0, 5, 1, 3, 2, 4).reshape(n, c, h, w)
            q = y.reshape(n, c, 1, h * w).permute(0, 2, 3, 1)  # one block: tokens split
            k = F.pad(y, (1, 1, 1, 1)).unfold(2, h + 2, h).unfold(3, w + 2, w)
            k = k.reshape(n, c, 1, -1).permute(0, 2, 3, 1)  # (n, 1, 168, c): one window
            y2 = (q @ k.transpose(-1, -2)).softmax(-1) @ k
            return x + y2.permute(0, 3, 1, 2).reshape(n, c, h, w)
        if k == "relative logits":  # BotNet: attention over all 120 tokens, relative logits
            # skewed to absolute positions along the split dimensions (whole on every rank)
            n, c, h, w = x.shape
            q = x.permute(0, 2, 3, 1)
            rel = halo_logits(q, self.rel_w, h).permute(0, 1, 3, 2, 4)  # (n, h, w, h, w)
            rel = rel + halo_logits(q.transpose(1, 2), self.rel_h, w).permute(0, 3, 1, 4, 2)
            t = q.reshape(n, h * w, c)
            attn = (t @ t.transpose(-1, -2) + rel.reshape(n, h * w, h * w)).softmax(-1)
            return x + (attn @ t).transpose(1, 2).reshape(n, c, h, w)
        if k == "token pooling":  # Next-ViT: windows of 16 of the 120 flattened tokens (across
            # rows of 10, the last 8 tokens left out) and overlapping ones of 12 by 8: whole;
            # and functionally, windows of 25 by 20
            n, c, h, w = x.shape
            t = x.flatten(2)
            k = torch.cat([self.sr(t), self.sr2(t), F.avg_pool1d(t, 25, 20)], -1)
            k = self.norm(k).transpose(1, 2)  # (n, 26, c)
            y = (t.transpose(1, 2) @ k.transpose(-1, -2)).softmax(-1) @ k
            return x + y.transpose(1, 2).reshape(n, c, h, w)
        if k == "recurrent":
            n, c, h, w = x.shape
            y, _ = self.rnn(x.permute(0, 2, 3, 1).reshape(n * h, w, c))
            return x + y.reshape(n, h, w, c).permute(0, 3, 1, 2)
        if k == "lambda positions":  # LambdaNet's position lambdas: the values' V after H, W
            n, c, h, w = x.shape
            v = x.permute(0, 2, 3, 1).reshape(n, 1, h, w, c)
            y = (self.lam(v) * x[:, :4].unsqueeze(-1)).sum(1).permute(0, 3, 1, 2)  # (n, c, h, w)
            down = self.down(v).sum(-1)  # (n, 2, 6, 5): strided, its size from the windows
            return y + F.interpolate(down, scale_factor=2).repeat(1, 3, 1, 1)
        if k == "global query":  # GCViT: a map pooled to one window's size, its tokens the
            # queries of every window of 4 x 5 (rows move to whole windows on blocks of 6)
            n, c, h, w = x.shape
            g = F.avg_pool2d(x, (3, 2)).permute(0, 2, 3, 1)  # (n, 4, 5, c): split too
            y = x.permute(0, 2, 3, 1).reshape(n, 3, 4, 2, 5, c).permute(0, 1, 3, 2, 4, 5)
            y = y.reshape(-1, 20, c)  # (n * 6, 20, c)
            k, v = self.kv(y).view(-1, 20, 2, c).unbind(2)
            q = g.repeat_interleave(y.shape[0] // g.shape[0], dim=0).reshape(-1, 20, c)
            y = ((q @ k.transpose(-1, -2)).softmax(-1) @ v).view(n, 3, 2, 4, 5, c)
            return x + y.permute(0, 5, 1, 3, 2, 4).reshape(n, c, h, w)
        if k == "whole-size constants":  # made from x.shape: this rank's block of each
            mask = torch.ones(x.shape[0], 1, *x.shape[2:], dtype=x.dtype)
            return x * mask + x.new_full(x.shape, 0.5) + torch.zeros_like(x)
        if k == "coordinates":  # CoordConv: whole coordinate maps joined to the blocks
            n, _, h, w = x.shape
            rows = torch.linspace(-1, 1, h, dtype=x.dtype).view(1, 1, h, 1).expand(n, 1, h, w)
            cols = torch.arange(w, dtype=x.dtype) / w  # broadcast over W: cut to the block
            return torch.cat([x[:, :5] + cols, rows], 1) * self.pos
        if k == "channels-last ops":  # Swin's pad and unpad, matmul, einsum, slice writes
            h, w = x.shape[-2:]
            y = F.pad(x.permute(0, 2, 3, 1), (0, 0, 0, 2, 1, 0)) @ self.proj  # 13 x 12
            y = self.dw(y.permute(0, 3, 1, 2))[:, :, 1:, :w]  # padded rows reach the window
            y = y + torch.einsum("nchw,dc->ndhw", x, self.proj)
            y = y + x[:, :, 1:-1].mean((1, 2, 3), keepdim=True)  # a crop, then a mean
            y[:, :3] += x[:, 3:]  # ReXNet's partial shortcut
            return y
        if k == "space to depth by 4 along H":  # 12 rows in blocks of 6: whole groups move
            n, c, h, w = x.shape
            return x.view(n, c, h // 4, 4, w).sum(3)
        if k == "upcat pad":  # MONAI's UpCat: pad by one where the skip's size differs
            e = self.valid(x)  # 11 x 10
            up = F.interpolate(F.max_pool2d(e, 2), scale_factor=2)  # 10 x 10
            sp = [0] * 4
            for i in range(2):
                if e.shape[-i - 1] != up.shape[-i - 1]:
                    sp[i * 2 + 1] = 1
            return e + F.pad(up, sp, "replicate")
        if k == "same padding":  # "same" for stride 2 pads one more row and column after
            y = self.strided(F.pad(x, (0, 1, 0, 1)))
            return F.interpolate(y, scale_factor=2) + x  # 12 x 10 -> 13 x 11 -> 6 x 5 -> 12 x 10
        return x  # flatten: the head does it

    def forward(self, x: torch.Tensor):
        y = self.conv(self.block(self.stem(x)))
        if self.kind == "flatten":  # a classifier head without a global pool
            return y.flatten(1)
        logits = self.fc(self.pool(y).flatten(1))
        return {"out": y, "logits": logits} if self.kind == "cat" else logits


def _forward_code_loss(out, t):
    if isinstance(out, dict):  # per-pixel map and logits, both in the loss
        return F.cross_entropy(out["logits"], t % 5, reduction="sum") + out["out"].square().sum()
    return F.cross_entropy(out, t % 5, reduction="sum")


def halo_logits(q: torch.Tensor, rel: torch.Tensor, other: int) -> torch.Tensor:
    """timm's ``rel_logits_1d`` of HaloNet: queries (B, H, W, C) of a block against keys of a
    window of ``(len(rel) + 1) // 2`` along W, relative to absolute positions by its pad,
    flatten and reshape; (B, H, other, W, win), expanded over the window's other side.
    BotNet's is the same with the window the whole map (``len(rel) == 2 * W - 1``)."""
    b, h, w, _ = q.shape
    size = rel.shape[0]
    win = (size + 1) // 2
    x = (q @ rel.transpose(-1, -2)).reshape(-1, w, size)
    x = F.pad(F.pad(x, [0, 1]).flatten(1), [0, size - w]).reshape(-1, w + 1, size)
    return x[:, :w, win - 1 :].reshape(b, h, 1, w, win).expand(-1, -1, other, -1, -1)


def shifted_window_attention(
    x: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor, ws: int, shift: int
) -> torch.Tensor:
    """torchvision's ``shifted_window_attention`` written small (one head, no padding): a
    cyclic shift, the windows folded into the batch, attention within each window with a
    relative position bias and the shifted windows' mask (made whole, of every window), again
    by ``F.scaled_dot_product_attention``, and the reverse."""
    b, h, w, c = x.shape
    x = torch.roll(x, (-shift, -shift), (1, 2))
    x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
    q, k, v = F.linear(x, qkv).reshape(x.size(0), x.size(1), 3, c).permute(2, 0, 1, 3).unbind(0)
    attn = q.matmul(k.transpose(-2, -1)) * c**-0.5 + bias
    mask = x.new_zeros((h, w))
    count = 0
    for rows in ((0, -ws), (-ws, -shift), (-shift, None)):
        for cols in ((0, -ws), (-ws, -shift), (-shift, None)):
            mask[rows[0] : rows[1], cols[0] : cols[1]] = count
            count += 1
    mask = mask.view(h // ws, ws, w // ws, ws).permute(0, 2, 1, 3).reshape(-1, ws * ws)
    mask = (mask.unsqueeze(1) - mask.unsqueeze(2)).ne(0) * -100.0
    attn = attn.view(x.size(0) // mask.shape[0], mask.shape[0], ws * ws, ws * ws) + mask
    y = attn.view(-1, ws * ws, ws * ws).softmax(-1) @ v
    # timm's and MONAI's way: F.scaled_dot_product_attention, a whole mask of every window
    y = y + F.scaled_dot_product_attention(q, k, v, (bias + mask).repeat(b, 1, 1))
    y = y.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
    return torch.roll(y, (shift, shift), (1, 2))


# Exact under every strategy.
FORWARD_CODE = {
    f"forward code: {kind}": (
        lambda kind=kind: ForwardCodeNet(kind),
        (3, 12, 10),
        _forward_code_loss,
        (),
    )
    for kind in (
        "se pool",
        "se mean",
        "eca and repeat",
        "pooled batchnorm",
        "layer scale",
        "channel shuffle",
        "cat",
        "convnext block",
        "rms norms",
        "axis mixing",
        "unet up",
        "upsample x2",
        "pyramid pooling",
        "inception pools",
        "interpolate align_corners",  # on the gathered whole images (warns)
        "interpolate to a size, align_corners",  # the same
        "group norm",
        "same padding",
        "global max",
        "padding modes",
        "functional conv",
        "instance statistics",
        "layer norm chw",
        "tf same pool",
        # Sizes computed from x.shape, which a block reports whole.
        "dynamic pad",
        "interpolate",
        "interpolate to a literal size",
        "mean by hand",
        "upcat pad",
        "space to depth",
        "cyclic shift",
        "window attention",
        "windows across blocks",
        "space to depth by 4 along H",
        "strides across blocks",
        "patches in the batch",
        "pooled windows",
        "reference grid",
        "flips and running sums",
        "warp",
        "halo attention",
        "relative logits",
        "token pooling",
        "flatten",  # the output (N, C * H * W) gathered whole in the whole order
        "lambda positions",
        "global query",
        "whole-size constants",
        "coordinates",
        "channels-last ops",
    )
}
# Exact under model parallelism without a data dimension: dropout's masks and sampling noise
# are drawn for the whole batch as the dense model draws them (a data rank draws for its slice
# only).
DROPOUT = {
    f"forward code: {kind}": (lambda kind=kind: ForwardCodeNet(kind), (3, 12, 10),
                              _forward_code_loss, ())
    for kind in ("dropout", "sampling")
}
class SwapNet(nn.Module):
    """Every layer ``pk.parallelize`` swaps for a spatial one, in ``dims`` spatial dimensions:
    convolution, BatchNorm, max and average pools, transposed convolution, upsampling
    (nearest and (bi-, tri-)linear), a strided convolution and the global average pool before
    a linear head, on a channels-last input where ``channels_last`` (2-D and 3-D)."""

    def __init__(self, dims: int, channels_last: bool = False) -> None:
        super().__init__()
        conv, pool = getattr(nn, f"Conv{dims}d"), getattr(nn, f"AdaptiveAvgPool{dims}d")
        linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[dims]
        self.memory = {2: torch.channels_last, 3: torch.channels_last_3d}.get(dims)
        self.channels_last = channels_last
        self.body = nn.Sequential(
            conv(3, 6, 3, padding=1), getattr(nn, f"BatchNorm{dims}d")(6), nn.ReLU(),
            getattr(nn, f"MaxPool{dims}d")(2), getattr(nn, f"AvgPool{dims}d")(3, 1, 1),
            getattr(nn, f"ConvTranspose{dims}d")(6, 6, 2, stride=2), nn.Upsample(scale_factor=2),
            nn.Upsample(scale_factor=2, mode=linear), conv(6, 6, 3, stride=4, padding=1),
            pool(1), nn.Flatten(), nn.Linear(6, 5),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=self.memory)
        return self.body(x)


# Every swapped layer in 1-D and 3-D (2-D: the networks above), channels-last included.
SWAPS = {
    f"every swap, {dims}-D{', channels-last' if last else ''}": (
        lambda dims=dims, last=last: SwapNet(dims, last),
        (3, *{1: (16,), 2: (12, 10), 3: (8, 8, 6)}[dims]),
        lambda out, t: F.cross_entropy(out, t % 5, reduction="sum"),
        (),
    )
    for dims, last in ((1, False), (2, True), (3, False), (3, True))
}


# Refused under spatial parallelism with spatial_output="blocks" (kind -> what the message
# names); with the default "whole" they run (the forward-code kinds).
REFUSED = {
    "flatten": "the output",  # (N, C * H * W): no block of a sample, as the loader cuts one
    "recurrent": "torch.lstm",  # Sequencer: a scan along the tokens needs the whole sequence
}


def refusal(comm: Communicator, kind: str, grid: dict | None = None) -> str:
    """The ValueError a spatially parallel ForwardCodeNet(kind) raises in its forward when it
    is asked for its outputs' blocks."""
    torch.manual_seed(0)
    g = pk.Grid(comm, **(grid or dict(rows=comm.size)))
    model = pk.parallelize(ForwardCodeNet(kind).double(), g, g, spatial_output="blocks")
    try:
        model(torch.randn(2, 3, 12, 10, dtype=torch.float64))
    except ValueError as e:
        comm.barrier()  # every rank got here: nobody waits in a collective
        return str(e)
    return "no error"


def network_parity(
    comm: Communicator,
    name: str,
    strategy: str,
    grid: dict | None = None,
    steps: int = 3,
    batch: int = 4,
    dtype: torch.dtype = torch.float64,
    device: str | None = None,
) -> list[Triple]:
    """``device``: where the parallelized network trains (the dense one stays on the CPU)."""
    build, shape, loss_fn, keep_dense = {**NETWORKS, **FORWARD_CODE, **DROPOUT, **SWAPS}[name]
    torch.manual_seed(0)
    dense = build().to(dtype)
    if strategy == "data" and grid is None:
        grid = dict(data=comm.size)
    g = pk.Grid(comm, **grid) if grid else None
    model = copy.deepcopy(dense).to(device)
    model = pk.parallelize(model, g or comm, g or strategy, keep_dense=keep_dense)
    data, d = (g.data, g.coords[0]) if g else (1, 0)
    rows = torch.arange(batch).tensor_split(data)[d]
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    triples: list[Triple] = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(batch, *shape, generator=gen, dtype=dtype)
        target = torch.randint(0, 10, (batch,), generator=gen)
        opt_dense.zero_grad()
        rng = torch.get_rng_state()  # dropout: the parallel forward draws what the dense one did
        out = dense(x)
        loss = loss_fn(out, target) / batch
        loss.backward()
        opt.zero_grad()
        torch.set_rng_state(rng)
        out_mine = model(x[rows].to(device))
        # DataParallel averages over the data group: scale so the mean is the batch's gradient.
        loss_mine = loss_fn(out_mine, target[rows].to(device)) * data / batch
        loss_mine.backward()
        at = f"step {step}"
        # Any nesting of containers: the same types, and each tensor in it.
        same_type = type(out_mine) is type(out) and tree_structure(out_mine) == tree_structure(out)
        triples.append((f"{at} output structure", torch.tensor(same_type), torch.tensor(True)))
        for k, (got, want) in enumerate(zip(tree_leaves(out_mine), tree_leaves(out), strict=True)):
            triples.append((f"{at} output {k}", got, want.detach()[rows]))
        if data == 1:
            triples.append((f"{at} loss", loss_mine.detach(), loss.detach()))
        triples += _grads(at, model, dense)
        opt_dense.step()
        opt.step()
        now = pk.to_dense(model).state_dict()
        # Clone: state_dict values share storage with parameters the next step updates.
        triples += [(f"{at} {k}", now[k].clone(), v.clone()) for k, v in dense.state_dict().items()]
    return triples


def _grads(at: str, model: nn.Module, dense: nn.Module) -> list[Triple]:
    """Gradients of the parameters this rank holds whole, by their dense name."""
    wanted = dict(dense.named_parameters())
    out = []
    for name, p in model.named_parameters():
        # Wrappers (DataParallel, SpatialRegion, keep_dense) add "module" to the path.
        key = ".".join(part for part in name.split(".") if part != "module")
        q = wanted.get(key)
        if q is not None and p.shape == q.shape and p.grad is not None:
            out.append((f"{at} {key} grad", p.grad.clone(), q.grad.clone()))
    return out


def drop_in(comm: Communicator, mode: str, grid=None) -> list[Triple]:
    """One nn.Conv2d inside a dense model replaced by ParallelConv2d: same outputs and grads."""
    from parallelkit.nn import ParallelConv2d

    torch.manual_seed(0)
    dense = nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, 7, 3, stride=2), nn.Flatten()
    ).double()
    model = copy.deepcopy(dense)
    model[2] = ParallelConv2d.from_dense(model[2], comm, mode, grid)
    x = torch.randn(2, 3, 11, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_par = dense(x1), model(x2)
    y.square().sum().backward()
    y_par.square().sum().backward()
    return [
        ("output", y_par, y.detach()),
        ("input grad", x2.grad, x1.grad),
        ("first conv grad", model[0].weight.grad, dense[0].weight.grad),
        ("to_dense", model[2].to_dense().weight.detach(), dense[2].weight.detach()),
    ]


def chained(comm: Communicator, mode: str) -> list[Triple]:
    """Two ParallelConv2d layers keeping the tensor split between them equal two convs."""
    from parallelkit.nn import ParallelConv2d

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3)).double()
    first = ParallelConv2d.from_dense(dense[0], comm, mode, gather_output=False)
    second = ParallelConv2d.from_dense(dense[2], comm, mode, input_is_split=True)
    x = torch.randn(2, 3, 9, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, y_par = dense(x), second(torch.relu(first(x)))
    y.square().sum().backward()
    y_par.square().sum().backward()
    bias = second.conv.bias.grad
    if mode == "channel":  # the first layer's shard: its rows of the dense gradient
        rows = slice(first.conv.out_start, first.conv.out_start + first.conv.out_sizes[comm.rank])
    else:
        rows = slice(None)
    return [
        ("output", y_par, y.detach()),
        ("first weight grad", first.conv.weight.grad, dense[0].weight.grad[rows]),
        ("second bias grad", bias, dense[2].bias.grad),
    ]


def se_without_gradient_sum(comm: Communicator) -> list[str]:
    """Negative control: with the sum of the gradient shares of an SE block's pooled vector
    turned off (the global mean's backward passing this rank's share through, as it may only
    where whole gradients are not shares), the SE block's parameters and everything before the
    pool go wrong. Returns the mismatching labels."""
    import parallelkit.functional as pkf
    from parallelkit.spatial import record

    real = record.summed
    record.summed = pkf.reduce_from_group
    try:
        triples = network_parity(comm, "forward code: se pool", "spatial", steps=1)
    finally:
        record.summed = real
    bad = []
    for label, got, want in triples:
        if not torch.allclose(got.to(want.dtype), want):
            bad.append(label)
    return bad


def _mismatches(comm: Communicator, kind: str, *patches: tuple[Any, str, Any]) -> list[str]:
    """Negative controls: the labels that differ from the dense model when forward-code kind
    ``kind`` runs spatially (one step) with each ``(owner, name, stand-in)`` patched in."""
    with contextlib.ExitStack() as stack:
        for owner, name, stand_in in patches:
            stack.enter_context(mock.patch.object(owner, name, stand_in))
        triples = network_parity(comm, f"forward code: {kind}", "spatial", steps=1)
    return [label for label, got, want in triples if not torch.allclose(got.to(want.dtype), want)]


def windows_from_the_other_end(comm: Communicator) -> list[str]:
    """Negative control: rows moved to whole windows, each rank as many as it should hold but
    counted from the other end of the dimension (rank 0 the last two windows of three, rank 1
    the first), and moved back the same way: every rank then attends over windows whose
    shifted-window mask and bias rows are another rank's. Returns the mismatching labels."""
    from parallelkit.spatial.rules import views

    real = views._grouped

    def from_the_end(m: int, inner: int, axis: tuple) -> list[tuple[int, int]]:
        sizes = [b - a for a, b in real(m, inner, axis)]
        return [(sum(sizes[r + 1 :]), sum(sizes[r:])) for r in range(len(sizes))]

    return _mismatches(comm, "windows across blocks", (views, "_grouped", from_the_end))


def flips_and_scans_on_their_own_blocks(comm: Communicator) -> list[str]:
    """Negative control: each rank flips its own block in place (no rows fetched from the
    mirror place) and runs its own scan without the totals of the blocks before it. Returns
    the mismatching labels."""
    from parallelkit.spatial.rules import padding, reductions

    def own_rows(sizes: list[int], n: int) -> list[tuple[int, int]]:
        return [(a, a + m) for a, m in zip(starts(sizes), sizes, strict=True)]

    def zero_totals(t: torch.Tensor, comm: Communicator, d: int, sizes: list[int]) -> torch.Tensor:
        return torch.cat([torch.zeros_like(t)] * len(sizes), d)

    return _mismatches(comm, "flips and running sums", (padding, "_mirrored", own_rows),
                       (reductions, "pkf", SimpleNamespace(all_gather=zero_totals)))  # fmt: skip


def warp_without_the_next_row(comm: Communicator) -> list[str]:
    """Negative control: each rank fetches the input rows its coordinates fall in but not the
    row after the last of them, which bilinear sampling reads too. Returns the mismatching
    labels."""
    from parallelkit.spatial.rules import resize

    real = resize._reach

    def short(c: torch.Tensor, n: int, corners: bool) -> tuple[int, int]:
        lo, hi = real(c, n, corners)
        return lo, max(lo + 1, hi - 1)

    return _mismatches(comm, "warp", (resize, "_reach", short))


class _WindowBias(nn.Module):
    """Attention inside 2 x 2 windows folded into the batch, with a learned bias, on a 4 x 4
    map: on 3 ranks the rows (2, 1, 1) move to whole windows (2, 2, 0), and the last rank
    holds no window."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3, stride=4, padding=1)
        self.bias = nn.Parameter(torch.randn(1, 1, 4, 4) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)  # (N, 4, 4, 4) from 16 x 16
        n, c, h, w = y.shape
        t = y.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(-1, 1, 4, c)
        a = F.scaled_dot_product_attention(t, t, t, attn_mask=self.bias)
        a = a.view(n, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(n, c, h, w)
        return y + a


def parameters_reached_without_a_window(comm: Communicator) -> list[str]:
    """The parameters that get no gradient on this rank (autograd alone, before DataParallel):
    none may, on a rank that holds no window either, or the gradient all-reduces start at
    other moments there than on the others."""
    model = pk.parallelize(_WindowBias().double(), comm, "spatial")
    out = model(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(out.square().sum(), list(params.values()), allow_unused=True)
    return [name for name, grad in zip(params, grads, strict=True) if grad is None]


class _TokenScan(nn.Module):
    """A running sum over the H x W tokens in raster order: a scan across split tokens is
    refused on blocks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).cumsum(-1).view_as(x)


def keep_dense_way_out(comm: Communicator) -> list[Triple | str]:
    """A module the guard refuses is named in the message; keep_dense=[it] runs it whole."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _TokenScan(), nn.Conv2d(4, 2, 1))
    dense = dense.double()
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    try:
        pk.parallelize(copy.deepcopy(dense), comm, "spatial")(x)
        message = "no error"
    except ValueError as e:
        message = str(e)
    comm.barrier()
    kept = pk.parallelize(copy.deepcopy(dense), comm, "spatial", keep_dense=["1"])
    return [message, ("kept dense output", kept(x), dense(x).detach())]


def block_outputs(comm: Communicator, grid: dict) -> list[Triple]:
    """``spatial_output="blocks"``: a per-pixel loss computed on each rank's block of the
    logits and summed over the spatial group gives the dense loss and gradients (the logits
    are never gathered); each block is the dense logits' block."""
    torch.manual_seed(0)
    dense = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 6, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(6, 4, 1),
    ).double()  # fmt: skip
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(copy.deepcopy(dense), g, g, spatial_output="blocks")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 14, 10, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 4, (4, 14, 10), generator=gen)
    rows = torch.arange(4).tensor_split(g.data)[g.coords[0]]
    out = dense(x)
    loss = F.cross_entropy(out, target, reduction="sum") / 4
    loss.backward()
    logits = model(x[rows])
    mask = pk.spatial.scatter(target[rows, None], g.spatial_comm, g.spatial)[:, 0]
    part = F.cross_entropy(logits, mask, reduction="sum") * g.data / 4
    loss_mine = pk.functional.reduce_from_group(part, g.spatial_comm)
    loss_mine.backward()
    want = pk.spatial.scatter(out.detach()[rows], g.spatial_comm, g.spatial)
    triples = [("logits block", logits.detach(), want)]
    if g.data == 1:
        triples.append(("loss", loss_mine.detach(), loss.detach()))
    return triples + _grads("blocks", model, dense)


def host_exchanges_per_step(comm: Communicator, grid: dict) -> tuple[int, int]:
    """Host all-gathers (``all_gather_ints``: block sizes and the like) in the second training
    step of a parallelized ResNet, where the whole images' size travels with the blocks; and,
    as a control, in one call of a spatial convolution used directly, which must ask."""
    build, shape, loss_fn, _ = NETWORKS["resnet18"]
    torch.manual_seed(0)
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(build().double(), g, g)
    calls = []
    real = type(comm).all_gather_ints

    def counted(self, values):
        calls.append(values)
        return real(self, values)

    x = torch.randn(2, *shape, dtype=torch.float64)
    target = torch.arange(2)
    type(comm).all_gather_ints = counted
    try:
        loss_fn(model(x), target).backward()  # the first backward rebuilds DataParallel's buckets
        calls.clear()
        loss_fn(model(x), target).backward()
        in_step = len(calls)
        conv = pk.nn.SpatialParallelConv2d(3, 2, 3, padding=1, comm=g.spatial_comm, grid=g.spatial)
        conv.double()
        calls.clear()
        conv(pk.spatial.scatter(x, g.spatial_comm, g.spatial))
        direct = len(calls)
    finally:
        type(comm).all_gather_ints = real
    return in_step, direct


def accumulated_grads(comm: Communicator, grid: dict, local_first: bool) -> list[Triple]:
    """Gradients accumulated over two backwards without zero_grad, the first synchronized or
    local (``no_sync``), then a third after zero_grad: the dense model's sums each time (under
    spatial parallelism a rank's gradients are shares of the whole ones)."""
    build, shape, loss_fn, _ = NETWORKS["bottleneck resnet"]
    torch.manual_seed(0)
    dense = build().double()
    g = pk.Grid(comm, **grid)
    model = pk.parallelize(copy.deepcopy(dense), g, g)
    rows = torch.arange(4).tensor_split(g.data)[g.coords[0]]
    triples: list[Triple] = []
    for k in range(3):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(4, *shape, generator=gen, dtype=torch.float64)
        target = torch.randint(0, 10, (4,), generator=gen)
        if k == 2:
            dense.zero_grad()
            model.zero_grad()
        (loss_fn(dense(x), target) / 4).backward()
        local = model.no_sync() if (k == 0 and local_first) else contextlib.nullcontext()
        with local:
            (loss_fn(model(x[rows]), target[rows]) * g.data / 4).backward()
        if k == 0 and local_first:
            continue  # this rank's share only: nothing to compare yet
        triples += _grads(f"backward {k}", model, dense)
    return triples


def axis_maps_without_the_other_rows(comm: Communicator) -> list[str]:
    """Negative control: the maps along one spatial dimension keep each rank's partial
    products of its own rows and never sum the other ranks' shares (no reduce-scatter: the
    rows of the local product that are this rank's). Returns the mismatching labels."""
    from parallelkit.spatial.rules import norms

    def own_share(y: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        return torch.tensor_split(y, comm.size, dim)[comm.rank]

    return _mismatches(comm, "axis mixing", (norms.pkf, "reduce_scatter", own_share))
