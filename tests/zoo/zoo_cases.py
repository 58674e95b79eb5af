"""The model zoo's cases: which real networks (``zoo_networks.ARCHS``, and the wider sweep's in
``zoo_sweep.SWEEP_ARCHS``) are tried under which strategies, and what each case gives today
(``zoo_expected``).

Images run under ``IMAGE_STRATEGIES``; volumes (MONAI's 3-D segmentation networks and
classifiers, torchvision's video classifiers) under ``VOLUME_STRATEGIES``: data, channel,
depth, rows, depth x cols, and data x depth for ``FOUR_RANKS_3D``.
"""

from __future__ import annotations

from zoo_expected import EXPECTED, EXPECTED_GATHER
from zoo_networks import ARCHS, Arch
from zoo_sweep import SWEEP_ARCHS

__all__ = [
    "ARCHS", "BATCH", "EXPECTED", "EXPECTED_GATHER", "IMAGE_STRATEGIES", "SLOW", "SPATIAL",
    "STRATEGIES", "SWEEP_ARCHS", "VOLUME_STRATEGIES", "Arch", "applies", "cases", "gather_cases",
]  # fmt: skip

ARCHS.update(SWEEP_ARCHS)

STRATEGIES: dict[str, tuple[int, dict]] = {
    # name -> (ranks, Grid dimensions)
    "data": (2, dict(data=2)),
    "rows": (2, dict(rows=2)),
    "cols": (2, dict(cols=2)),
    "channel": (2, dict(channel=2)),
    "data x rows": (4, dict(data=2, rows=2)),
    "depth": (2, dict(depth=2)),
    "depth x cols": (4, dict(depth=2, cols=2)),
    "data x depth": (4, dict(data=2, depth=2)),
}

IMAGE_STRATEGIES = ("data", "rows", "cols", "channel", "data x rows")
"""What a 2-D network runs under (data x rows only for ``FOUR_RANKS``)."""
VOLUME_STRATEGIES = ("data", "channel", "depth", "rows", "depth x cols", "data x depth")
"""What a 3-D network runs under (data x depth only for ``FOUR_RANKS_3D``). "depth" splits D
over 2 ranks (what the plain "spatial" strategy does to a volume), "rows" splits H (rules that
name a dimension), "depth x cols" is a 2-D grid of 4 ranks over D and W (faces and edges: a
block's halo comes from three neighbours), "data x depth" merges statistics over a data group
whose members hold planes. "cols" alone is left out: W is split by "depth x cols"."""

FOUR_RANKS = (
    "timm resnet18 BatchNormAct2d",
    "smp FPN resnet18",
    "timm mobilevit_xxs",
)
"""The architectures also run under "data x rows" (4 ranks). What that grid adds to "data" and
"rows" run apart is the two at once: SyncBatchNorm statistics merged over a data group whose
members each hold only rows, and the replicated parameters' gradients summed over rows before
they are averaged over data. One network per kind proves it: a BatchNorm subclass that also
applies an activation, a segmentation decoder that interpolates, and a hybrid refused on blocks,
whose attention blocks fallback="gather" gathers over the rows of each data group. Six of the
eight that ran here until 2026-11 only repeated it (docs/zoo.md); 4-rank cases are the dearest
(four dense references on two cores)."""

FOUR_RANKS_3D = ("monai AttentionUnet", "monai SegResNetDS", "tv r2plus1d_18")
"""The volumes also run under "data x depth" (4 ranks): BatchNorm3d statistics merged over a
data group whose members hold planes, under an attention gate, a deep-supervision list output
and a factored (2+1)-D video network."""

COLS = (
    # the network's own code names H or W apart, or reshapes them
    "tv vgg_bn",  # flatten of the pooled 7 x 7 map, H-major
    "tv convnext",  # LayerNorm2d through channels-last permutes
    "timm convnextv2_atto",  # GRN: a norm over dims (1, 2) of channels-last blocks
    "tv shufflenet_v2_x0_5",  # channel shuffle views (B, g, C/g, H, W); x.mean([2, 3])
    "timm cs3darknet_focus_s",  # x[..., ::2, ::2] and its shifts
    "timm ghostnet_050",  # x[:, :n, :, :], full slices written out over H and W
    "smp PSPNet resnet18",  # adaptive pooling to 1, 2, 3 and 6 bins per dimension
    # windows or padding that differ between H and W
    "timm inception_v3",  # 1 x 7, 7 x 1, 1 x 3 and 3 x 1 kernels
    "timm inception_next_atto",  # square, 1 x k and k x 1 depthwise branches
    "timm tf_efficientnet_lite0",  # 'same' padding computed per dimension from the size
    "timm resnetblur18",  # F.pad in reflect mode, then a strided blur
    # window attention on blocks: the window grid of columns folded into the batch
    "tv swin", "tv swin 40",
    # patches folded into the batch, a convolution inside each (5 patches over 2 ranks)
    "timm tnt",
    # relative logits skewed along the split dimension: all-gathered, cut at the scores
    "timm botnet26t",
    # hybrids and a ViT: attention over the flattened tokens, patch reshapes
    "tv maxvit", "timm maxvit", "timm coatnet", "timm mobilevit_xxs", "timm mobilevitv2_050",
    "timm edgenext_xx_small", "timm efficientformerv2_s0", "smp Segformer mit_b0",
    "smp MAnet mobilenetv3", "timm tresnet", "timm vit_tiny gap",
    # class tokens: a prefix held by the first rank, whose tokens are columns' blocks here
    "timm vit_tiny", "timm deit_tiny distilled", "timm eva02_tiny", "timm volo_d1",
    "timm mvitv2_tiny", "timm mvitv2 cls",
    # sub-pixel upsampling regroups W with its factor
    "monai BasicUNet pixelshuffle",
)  # fmt: skip
"""The images also run split over columns ("cols"). The rest of them are purely convolutional
networks with square windows and reductions over H and W together: there the spatial rules are
the same code on either dimension, so "cols" repeated "rows" with the image transposed (30 of the
51 ran under cols until 2026-11, all exact; docs/zoo.md). What is left is what names a dimension
or treats H and W apart, and the hybrids. The rules themselves run on columns and 2 x 2 grids in
the pool tier (tests/test_spatial_*.py), and every volume splits W under "depth x cols"."""

SUBSETS = {"data x rows": FOUR_RANKS, "data x depth": FOUR_RANKS_3D, "cols": COLS}
"""Strategies that run only some of the architectures of their kind."""

SPATIAL = tuple(
    name
    for name, (_, dims) in STRATEGIES.items()
    if any(dims.get(d, 1) > 1 for d in ("depth", "rows", "cols"))
)
"""The strategies that split samples: the only ones whose refusals ``fallback="gather"`` lifts
(a data group's unused parameters, or a channel split, are not about blocks)."""


SLOW = ("monai VNet", "monai BasicUNetPlusPlus", "smp PAN resnet18", "smp DeepLabV3Plus resnet18",
        "tv swin_t", "tv swin3d_t", "monai SwinUNETR", *SWEEP_ARCHS)
"""Architectures kept out of the test tier for their cost (VNet's 45M weights, U-Net++'s
nested decoder at 32^3 in float64, PAN at 256 x 256, DeepLabV3+ whose ASPP and skip the tier's
DeepLabV3 and U-Nets already cover; swin_t at 448 x 224, swin3d_t at 32 x 64^2 and SwinUNETR
at 64^3, the sizes whose blocks are whole windows at every stage, whose code the tier's small
"tv swin", "tv swin3d" and "monai SwinUNETR 2-D" run) and the wider sweep (SWEEP_ARCHS), by hand:
``survey.py --arch 'monai VNet'``."""


def applies(arch: str, strategy: str) -> bool:
    """Does ``arch`` run under ``strategy``? Images under IMAGE_STRATEGIES, volumes under
    VOLUME_STRATEGIES, a strategy of SUBSETS only for its architectures."""
    kinds = VOLUME_STRATEGIES if ARCHS[arch].volume else IMAGE_STRATEGIES
    return strategy in kinds and (strategy not in SUBSETS or arch in SUBSETS[strategy])


def cases(slow: bool = False) -> list[tuple[str, str]]:
    """Every (architecture, strategy) of the tier, grouped by strategy (and of SLOW)."""
    return [(a, s) for s in STRATEGIES for a in ARCHS
            if applies(a, s) and (slow or a not in SLOW)]  # fmt: skip


def gather_cases(refuse: dict | None = None) -> list[tuple[str, str]]:
    """The cases that run again under ``fallback="gather"``: those refused today under a spatial
    strategy (by ``refuse``, {case: label}, or EXPECTED). Nothing else changes under gather: a
    case that is exact under refuse has nothing refused, so nothing to gather, and runs the same
    computation again."""
    labels = refuse if refuse is not None else {case: v[0] for case, v in EXPECTED.items()}
    return [
        case
        for case in cases()
        if case[1] in SPATIAL and labels.get(case, "exact").startswith("refused")
    ]


BATCH = 2
"""Images per step: one per rank of a data group of 2 (SyncBatchNorm merges them)."""
