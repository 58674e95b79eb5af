"""The model zoo: real networks from torchvision, timm and segmentation_models_pytorch, built
small, and the strategies each one is tried under.

Why these: ``pk.parallelize`` promises the dense numbers (or a clear refusal) for networks
nobody here wrote. Each architecture below brings forward code the library never saw: SE
gates (``x * scale``), layer scale parameters used directly, ``F.interpolate`` in a decoder,
``F.adaptive_avg_pool2d`` to sizes other than 1, BatchNorm subclasses that also apply an
activation (timm's ``BatchNormAct2d``), dict and namedtuple outputs, channel shuffles,
grouped and depthwise convolutions, ``ceil_mode`` pooling, dilated backbones.

Every model is built with random weights (nothing is downloaded), small enough that one
(architecture, strategy) case runs in seconds on 2 CPU ranks in float64: few classes, the
smallest input the architecture accepts well (64 x 64 unless noted), the small variant or a
reduced encoder depth. Randomness inside the model (dropout, stochastic depth) is switched
off, so the dense and the parallel model compute the same function.

``EXPECTED`` at the bottom is today's outcome of every case, written by
``python tests/zoo/survey.py --write-expected``; ``test_zoo.py`` turns it into pytest marks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Arch:
    """One network: where it comes from, how to build it small, and its input (C, H, W)."""

    source: str  # "torchvision" | "timm" | "smp"
    build: Callable[[], nn.Module]
    shape: tuple[int, int, int] = (3, 64, 64)
    what: str = ""  # the feature this architecture brings to the tier
    steps: int = 2  # SGD steps compared (fewer where the dense model itself is chaotic)


def no_randomness(model: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off: the dense and the parallel model must see the same
    function, and their random streams differ by construction."""
    for m in model.modules():
        if hasattr(m, "p") and isinstance(m.p, float) and "Drop" in type(m).__name__:
            m.p = 0.0
        if type(m).__name__ == "StochasticDepth":
            m.p = 0.0
        if hasattr(m, "drop_prob") and isinstance(m.drop_prob, float):
            m.drop_prob = 0.0
    return model


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision.models as tvm

        return no_randomness(tvm.get_model(name, weights=None, **kw))

    return build


def _tv_seg(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision.models.segmentation as tvs

        fn = getattr(tvs, name)
        return no_randomness(fn(weights=None, weights_backbone=None, **kw))

    return build


def _vgg11_bn() -> nn.Module:
    """torchvision's VGG-11 with BN; its 120M-parameter classifier replaced by one Linear (the
    features and the AdaptiveAvgPool2d((7, 7)) are what the tier is after)."""
    import torchvision.models as tvm

    model = tvm.vgg11_bn(weights=None, num_classes=5)
    model.classifier = nn.Linear(512 * 7 * 7, 5)
    return model


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        kw.setdefault("num_classes", 5)
        return no_randomness(timm.create_model(name, pretrained=False, **kw))

    return build


def _timm_bnact_resnet18() -> nn.Module:
    """timm's ResNet-18 with ``norm_layer=BatchNormAct2d``: each norm also applies an
    activation. SiLU, not ReLU: the block adds its shortcut in place into the norm's output,
    which ReLU's backward needs (the dense model itself would fail)."""
    from functools import partial

    from timm.layers import BatchNormAct2d

    return _timm("resnet18", norm_layer=partial(BatchNormAct2d, act_layer=nn.SiLU))()


def _smp(kind: str, encoder: str = "resnet18", **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        cls = getattr(smp, kind)
        return no_randomness(cls(encoder_name=encoder, encoder_weights=None, classes=2, **kw))

    return build


ARCHS: dict[str, Arch] = {
    # ---------------------------------------------------------------- torchvision classifiers
    "tv resnet18": Arch("torchvision", _tv("resnet18", num_classes=5), what="basic blocks"),
    "tv resnet50": Arch("torchvision", _tv("resnet50", num_classes=5), what="bottlenecks"),
    "tv mobilenet_v2": Arch(
        "torchvision", _tv("mobilenet_v2", num_classes=5, width_mult=0.5),
        what="depthwise convs, ReLU6",
    ),
    "tv mobilenet_v3_small": Arch(
        "torchvision", _tv("mobilenet_v3_small", num_classes=5),
        what="SE (adaptive_avg_pool2d, x * scale), hardswish",
    ),
    "tv efficientnet_b0": Arch(
        "torchvision", _tv("efficientnet_b0", num_classes=5), what="SE, SiLU, stochastic depth"
    ),
    "tv regnet_x_400mf": Arch(
        "torchvision", _tv("regnet_x_400mf", num_classes=5), what="grouped convs"
    ),
    "tv regnet_y_400mf": Arch(
        "torchvision", _tv("regnet_y_400mf", num_classes=5), what="grouped convs + SE"
    ),
    "tv convnext_tiny": Arch(
        "torchvision", _tv("convnext_tiny", num_classes=5, stochastic_depth_prob=0.0),
        what="LayerNorm2d, layer scale parameter, 7x7 depthwise",
    ),
    "tv densenet121": Arch(
        "torchvision", _tv("densenet121", num_classes=5), what="concatenation, F.relu + pool"
    ),
    "tv googlenet": Arch(
        "torchvision", _tv("googlenet", num_classes=5, aux_logits=True, init_weights=True),
        what="inception, ceil_mode pools, namedtuple output with aux heads",
    ),
    "tv shufflenet_v2_x0_5": Arch(
        "torchvision", _tv("shufflenet_v2_x0_5", num_classes=5),
        what="channel shuffle, x.mean([2, 3])",
    ),
    "tv squeezenet1_1": Arch(
        "torchvision", _tv("squeezenet1_1", num_classes=5), what="fire modules, ceil_mode pools"
    ),
    "tv vgg11_bn": Arch(
        "torchvision", _vgg11_bn, (3, 32, 32), what="AdaptiveAvgPool2d((7, 7)), flatten"
    ),
    "tv mnasnet0_5": Arch("torchvision", _tv("mnasnet0_5", num_classes=5), what="x.mean([2, 3])"),
    # ---------------------------------------------------------------- torchvision segmentation
    "tv fcn_resnet50": Arch(
        "torchvision", _tv_seg("fcn_resnet50", num_classes=3),
        what="dilated backbone, F.interpolate, dict output",
    ),
    "tv deeplabv3_mobilenet_v3_large": Arch(
        "torchvision", _tv_seg("deeplabv3_mobilenet_v3_large", num_classes=3),
        what="ASPP (global pool branch + interpolate), dict output",
    ),
    "tv lraspp_mobilenet_v3_large": Arch(
        "torchvision", _tv_seg("lraspp_mobilenet_v3_large", num_classes=3),
        what="AdaptiveAvgPool2d(1) gate on split features, dict output",
    ),
    # ---------------------------------------------------------------- timm
    "timm resnet18": Arch("timm", _timm("resnet18"), what="timm ResNet, SelectAdaptivePool2d"),
    "timm resnet18 BatchNormAct2d": Arch(
        "timm", _timm_bnact_resnet18,
        what="BatchNormAct2d: a BatchNorm2d subclass that also applies SiLU",
    ),
    "timm seresnext26d_32x4d": Arch(
        "timm", _timm("seresnext26d_32x4d"), what="SE, 32 groups, deep stem, avg-pool downsample"
    ),
    "timm efficientnet_b0": Arch(
        "timm", _timm("efficientnet_b0"), what="BatchNormAct2d with SiLU, SE"
    ),
    "timm mobilenetv3_small_050": Arch(
        "timm", _timm("mobilenetv3_small_050"), what="BatchNormAct2d, hard sigmoid SE"
    ),
    "timm convnext_atto": Arch(
        "timm", _timm("convnext_atto"), what="LayerNorm2d, gamma parameter used directly"
    ),
    "timm regnety_002": Arch("timm", _timm("regnety_002"), what="grouped convs + SE"),
    "timm tf_efficientnet_lite0": Arch(
        "timm", _timm("tf_efficientnet_lite0"), (3, 72, 72),
        # 72: its stride-2 layers see 18 x 18 maps, whose 9-row blocks pad differently
        what="Conv2dSame: TensorFlow 'same' padding computed from the input's size",
    ),
    "timm resnetblur18": Arch(
        "timm", _timm("resnetblur18"),
        what="BlurPool2d: F.pad in reflect mode, a depthwise F.conv2d with stride 2",
    ),
    "timm inception_v3": Arch(
        "timm",
        _timm("inception_v3"),
        (3, 75, 75),
        what="asymmetric kernels, 75 x 75 minimum",
        # At 75 x 75 its last maps are 1 x 1, and its BatchNorms normalize a handful of values:
        # the dense model alone turns 1e-13 relative noise in its weights into 1.2e-4 in its
        # second step's output (measured), so only the first step can be compared.
        steps=1,
    ),
    # ---------------------------------------------------------------- segmentation_models_pytorch
    # Default encoder depths (5): a shallower smp encoder keeps its unused deeper stages,
    # which data parallelism refuses (no gradient); PSPNet's default depth is 3 and shows it.
    "smp Unet resnet18": Arch(
        "smp", _smp("Unet", decoder_channels=(32, 16, 16, 8, 8)),
        what="skip concatenation, F.interpolate nearest in forward code",
    ),
    "smp FPN resnet18": Arch(
        "smp", _smp("FPN", decoder_pyramid_channels=32, decoder_segmentation_channels=32),
        what="pyramid sums, bilinear upsampling (align_corners=True)",
    ),
    "smp DeepLabV3 resnet18": Arch(
        "smp", _smp("DeepLabV3", decoder_channels=32),
        what="dilated encoder, ASPP with a global pool branch",
    ),
    "smp PSPNet resnet18": Arch(
        "smp", _smp("PSPNet", psp_out_channels=32),
        what="pyramid pooling to 1, 2, 3, 6; default encoder depth 3 (unused stages)",
    ),
    "smp Linknet mobilenet_v2": Arch(
        "smp", _smp("Linknet", encoder="mobilenet_v2"),
        what="mobilenet_v2 encoder, transposed-conv decoder",
    ),
}

STRATEGIES: dict[str, tuple[int, dict]] = {
    # name -> (ranks, Grid dimensions)
    "data": (2, dict(data=2)),
    "rows": (2, dict(rows=2)),
    "cols": (2, dict(cols=2)),
    "channel": (2, dict(channel=2)),
    "data x rows": (4, dict(data=2, rows=2)),
}

FOUR_RANKS = (
    "tv resnet18",
    "tv mobilenet_v3_small",
    "tv googlenet",
    "tv deeplabv3_mobilenet_v3_large",
    "timm resnet18 BatchNormAct2d",
    "timm convnext_atto",
    "smp Unet resnet18",
    "smp FPN resnet18",
)
"""The architectures also run under "data x rows" (4 ranks): one of each kind of feature, as
the 2-core budget allows; the 2-rank strategies run every architecture."""


def cases() -> list[tuple[str, str]]:
    """Every (architecture, strategy) of the tier, grouped by strategy (by pool size)."""
    return [
        (arch, strategy)
        for strategy, (size, _) in STRATEGIES.items()
        for arch in ARCHS
        if size == 2 or arch in FOUR_RANKS
    ]


BATCH = 2
"""Images per step: one per rank of a data group of 2 (SyncBatchNorm merges them)."""

# ----------------------------------------------------------------------------- expected
# (architecture, strategy) -> (outcome, reason). Written by `survey.py --write-expected`.
# BEGIN EXPECTED
EXPECTED: dict[tuple[str, str], tuple[str, str]] = {
    ('tv resnet18', 'data'): (
        'exact',
        '',
    ),
    ('tv resnet50', 'data'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v2', 'data'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v3_small', 'data'): (
        'exact',
        '',
    ),
    ('tv efficientnet_b0', 'data'): (
        'exact',
        '',
    ),
    ('tv regnet_x_400mf', 'data'): (
        'exact',
        '',
    ),
    ('tv regnet_y_400mf', 'data'): (
        'exact',
        '',
    ),
    ('tv convnext_tiny', 'data'): (
        'exact',
        '',
    ),
    ('tv densenet121', 'data'): (
        'exact',
        '',
    ),
    ('tv googlenet', 'data'): (
        'exact',
        '',
    ),
    ('tv shufflenet_v2_x0_5', 'data'): (
        'exact',
        '',
    ),
    ('tv squeezenet1_1', 'data'): (
        'exact',
        '',
    ),
    ('tv vgg11_bn', 'data'): (
        'exact',
        '',
    ),
    ('tv mnasnet0_5', 'data'): (
        'exact',
        '',
    ),
    ('tv fcn_resnet50', 'data'): (
        'exact',
        '',
    ),
    ('tv deeplabv3_mobilenet_v3_large', 'data'): (
        'exact',
        '',
    ),
    ('tv lraspp_mobilenet_v3_large', 'data'): (
        'exact',
        '',
    ),
    ('timm resnet18', 'data'): (
        'exact',
        '',
    ),
    ('timm resnet18 BatchNormAct2d', 'data'): (
        'exact',
        '',
    ),
    ('timm seresnext26d_32x4d', 'data'): (
        'exact',
        '',
    ),
    ('timm efficientnet_b0', 'data'): (
        'exact',
        '',
    ),
    ('timm mobilenetv3_small_050', 'data'): (
        'exact',
        '',
    ),
    ('timm convnext_atto', 'data'): (
        'exact',
        '',
    ),
    ('timm regnety_002', 'data'): (
        'exact',
        '',
    ),
    ('timm tf_efficientnet_lite0', 'data'): (
        'exact',
        '',
    ),
    ('timm resnetblur18', 'data'): (
        'exact',
        '',
    ),
    ('timm inception_v3', 'data'): (
        'exact',
        '',
    ),
    ('smp Unet resnet18', 'data'): (
        'exact',
        '',
    ),
    ('smp FPN resnet18', 'data'): (
        'exact',
        '',
    ),
    ('smp DeepLabV3 resnet18', 'data'): (
        'exact',
        '',
    ),
    ('smp PSPNet resnet18', 'data'): (
        'refused',
        "DataParallel: parameters ['encoder.layer3.0.conv1.weight', 'encoder.laye"
        "r3.0.bn1.weight', 'encoder.l ... er.layer4.1.bn2.bias'] got no gradient "
        'in this backward. Pass find_unused_parameters=True if the model does not'
        ' use every parameter in every step, or reduce_over={name: None} to leave'
        ' a parame...',
    ),
    ('smp Linknet mobilenet_v2', 'data'): (
        'exact',
        '',
    ),
    ('tv resnet18', 'rows'): (
        'exact',
        '',
    ),
    ('tv resnet50', 'rows'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v2', 'rows'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v3_small', 'rows'): (
        'exact',
        '',
    ),
    ('tv efficientnet_b0', 'rows'): (
        'exact',
        '',
    ),
    ('tv regnet_x_400mf', 'rows'): (
        'exact',
        '',
    ),
    ('tv regnet_y_400mf', 'rows'): (
        'exact',
        '',
    ),
    ('tv convnext_tiny', 'rows'): (
        'exact',
        '',
    ),
    ('tv densenet121', 'rows'): (
        'exact',
        '',
    ),
    ('tv googlenet', 'rows'): (
        'exact',
        '',
    ),
    ('tv shufflenet_v2_x0_5', 'rows'): (
        'exact',
        '',
    ),
    ('tv squeezenet1_1', 'rows'): (
        'exact',
        '',
    ),
    ('tv vgg11_bn', 'rows'): (
        'exact',
        '',
    ),
    ('tv mnasnet0_5', 'rows'): (
        'exact',
        '',
    ),
    ('tv fcn_resnet50', 'rows'): (
        'exact',
        '',
    ),
    ('tv deeplabv3_mobilenet_v3_large', 'rows'): (
        'exact',
        '',
    ),
    ('tv lraspp_mobilenet_v3_large', 'rows'): (
        'exact',
        '',
    ),
    ('timm resnet18', 'rows'): (
        'exact',
        '',
    ),
    ('timm resnet18 BatchNormAct2d', 'rows'): (
        'exact',
        '',
    ),
    ('timm seresnext26d_32x4d', 'rows'): (
        'exact',
        '',
    ),
    ('timm efficientnet_b0', 'rows'): (
        'exact',
        '',
    ),
    ('timm mobilenetv3_small_050', 'rows'): (
        'exact',
        '',
    ),
    ('timm convnext_atto', 'rows'): (
        'exact',
        '',
    ),
    ('timm regnety_002', 'rows'): (
        'exact',
        '',
    ),
    ('timm tf_efficientnet_lite0', 'rows'): (
        'exact',
        '',
    ),
    ('timm resnetblur18', 'rows'): (
        'exact',
        '',
    ),
    ('timm inception_v3', 'rows'): (
        'exact',
        '',
    ),
    ('smp Unet resnet18', 'rows'): (
        'exact',
        '',
    ),
    ('smp FPN resnet18', 'rows'): (
        'exact',
        '',
    ),
    ('smp DeepLabV3 resnet18', 'rows'): (
        'exact',
        '',
    ),
    ('smp PSPNet resnet18', 'rows'): (
        'exact',
        '',
    ),
    ('smp Linknet mobilenet_v2', 'rows'): (
        'exact',
        '',
    ),
    ('tv resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('tv resnet50', 'cols'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v2', 'cols'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v3_small', 'cols'): (
        'exact',
        '',
    ),
    ('tv efficientnet_b0', 'cols'): (
        'exact',
        '',
    ),
    ('tv regnet_x_400mf', 'cols'): (
        'exact',
        '',
    ),
    ('tv regnet_y_400mf', 'cols'): (
        'exact',
        '',
    ),
    ('tv convnext_tiny', 'cols'): (
        'exact',
        '',
    ),
    ('tv densenet121', 'cols'): (
        'exact',
        '',
    ),
    ('tv googlenet', 'cols'): (
        'exact',
        '',
    ),
    ('tv shufflenet_v2_x0_5', 'cols'): (
        'exact',
        '',
    ),
    ('tv squeezenet1_1', 'cols'): (
        'exact',
        '',
    ),
    ('tv vgg11_bn', 'cols'): (
        'exact',
        '',
    ),
    ('tv mnasnet0_5', 'cols'): (
        'exact',
        '',
    ),
    ('tv fcn_resnet50', 'cols'): (
        'exact',
        '',
    ),
    ('tv deeplabv3_mobilenet_v3_large', 'cols'): (
        'exact',
        '',
    ),
    ('tv lraspp_mobilenet_v3_large', 'cols'): (
        'exact',
        '',
    ),
    ('timm resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('timm resnet18 BatchNormAct2d', 'cols'): (
        'exact',
        '',
    ),
    ('timm seresnext26d_32x4d', 'cols'): (
        'exact',
        '',
    ),
    ('timm efficientnet_b0', 'cols'): (
        'exact',
        '',
    ),
    ('timm mobilenetv3_small_050', 'cols'): (
        'exact',
        '',
    ),
    ('timm convnext_atto', 'cols'): (
        'exact',
        '',
    ),
    ('timm regnety_002', 'cols'): (
        'exact',
        '',
    ),
    ('timm tf_efficientnet_lite0', 'cols'): (
        'exact',
        '',
    ),
    ('timm resnetblur18', 'cols'): (
        'exact',
        '',
    ),
    ('timm inception_v3', 'cols'): (
        'exact',
        '',
    ),
    ('smp Unet resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('smp FPN resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('smp DeepLabV3 resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('smp PSPNet resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('smp Linknet mobilenet_v2', 'cols'): (
        'exact',
        '',
    ),
    ('tv resnet18', 'channel'): (
        'exact',
        '',
    ),
    ('tv resnet50', 'channel'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v2', 'channel'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v3_small', 'channel'): (
        'exact',
        '',
    ),
    ('tv efficientnet_b0', 'channel'): (
        'exact',
        '',
    ),
    ('tv regnet_x_400mf', 'channel'): (
        'exact',
        '',
    ),
    ('tv regnet_y_400mf', 'channel'): (
        'exact',
        '',
    ),
    ('tv convnext_tiny', 'channel'): (
        'exact',
        '',
    ),
    ('tv densenet121', 'channel'): (
        'exact',
        '',
    ),
    ('tv googlenet', 'channel'): (
        'exact',
        '',
    ),
    ('tv shufflenet_v2_x0_5', 'channel'): (
        'exact',
        '',
    ),
    ('tv squeezenet1_1', 'channel'): (
        'exact',
        '',
    ),
    ('tv vgg11_bn', 'channel'): (
        'exact',
        '',
    ),
    ('tv mnasnet0_5', 'channel'): (
        'exact',
        '',
    ),
    ('tv fcn_resnet50', 'channel'): (
        'exact',
        '',
    ),
    ('tv deeplabv3_mobilenet_v3_large', 'channel'): (
        'exact',
        '',
    ),
    ('tv lraspp_mobilenet_v3_large', 'channel'): (
        'exact',
        '',
    ),
    ('timm resnet18', 'channel'): (
        'exact',
        '',
    ),
    ('timm resnet18 BatchNormAct2d', 'channel'): (
        'exact',
        '',
    ),
    ('timm seresnext26d_32x4d', 'channel'): (
        'exact',
        '',
    ),
    ('timm efficientnet_b0', 'channel'): (
        'exact',
        '',
    ),
    ('timm mobilenetv3_small_050', 'channel'): (
        'exact',
        '',
    ),
    ('timm convnext_atto', 'channel'): (
        'exact',
        '',
    ),
    ('timm regnety_002', 'channel'): (
        'exact',
        '',
    ),
    ('timm tf_efficientnet_lite0', 'channel'): (
        'exact',
        '',
    ),
    ('timm resnetblur18', 'channel'): (
        'exact',
        '',
    ),
    ('timm inception_v3', 'channel'): (
        'exact',
        '',
    ),
    ('smp Unet resnet18', 'channel'): (
        'exact',
        '',
    ),
    ('smp FPN resnet18', 'channel'): (
        'exact',
        '',
    ),
    ('smp DeepLabV3 resnet18', 'channel'): (
        'exact',
        '',
    ),
    ('smp PSPNet resnet18', 'channel'): (
        'exact',
        '',
    ),
    ('smp Linknet mobilenet_v2', 'channel'): (
        'exact',
        '',
    ),
    ('tv resnet18', 'data x rows'): (
        'exact',
        '',
    ),
    ('tv mobilenet_v3_small', 'data x rows'): (
        'exact',
        '',
    ),
    ('tv googlenet', 'data x rows'): (
        'exact',
        '',
    ),
    ('tv deeplabv3_mobilenet_v3_large', 'data x rows'): (
        'exact',
        '',
    ),
    ('timm resnet18 BatchNormAct2d', 'data x rows'): (
        'exact',
        '',
    ),
    ('timm convnext_atto', 'data x rows'): (
        'exact',
        '',
    ),
    ('smp Unet resnet18', 'data x rows'): (
        'exact',
        '',
    ),
    ('smp FPN resnet18', 'data x rows'): (
        'exact',
        '',
    ),
}
# END EXPECTED
