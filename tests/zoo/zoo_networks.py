"""The model zoo: real networks from torchvision, timm, segmentation_models_pytorch and MONAI,
built small, and the strategies each one is tried under.

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

Volumes: MONAI's 3-D segmentation networks and classifiers and torchvision's video
classifiers take (N, C, D, H, W) and run under their own strategies (``VOLUME_STRATEGIES``:
data, channel, depth, rows, depth x cols, and data x depth for ``FOUR_RANKS_3D``); images run
under ``IMAGE_STRATEGIES`` as before.

Today's outcome of every case is in ``zoo_expected.py``; the wider sweep in ``zoo_sweep.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Arch:
    """One network: where it comes from, how to build it small, and its input: (C, H, W) for
    an image, (C, D, H, W) for a volume or a clip."""

    source: str  # "torchvision" | "timm" | "smp" | "monai"
    build: Callable[[], nn.Module]
    shape: tuple[int, ...] = (3, 64, 64)
    what: str = ""  # the feature this architecture brings to the tier
    steps: int = 2  # SGD steps compared (fewer where the dense model itself is chaotic)

    @property
    def volume(self) -> bool:
        """A 3-D network: its input has three spatial dimensions."""
        return len(self.shape) == 4


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
        if isinstance(getattr(m, "drop_rate", None), float):
            m.drop_rate = 0.0  # timm heads: F.dropout(x, p=self.drop_rate) (GhostNet's 0.2)
        if isinstance(getattr(m, "drop_connect_rate", None), float):
            m.drop_connect_rate = 0.0  # MONAI's EfficientNet blocks: drop_connect(x, p=...)
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


def _vgg_bn() -> nn.Module:
    """torchvision's VGG with BN on a narrow vgg11 configuration (16-128 channels, the same
    convolutions and pools). Its 102M-weight classifier is made on the meta device (nothing
    allocated) and replaced by one Linear: the features and the AdaptiveAvgPool2d((7, 7)) are
    what the tier is after."""
    import torch
    from torchvision.models.vgg import VGG, make_layers

    cfg = [16, "M", 32, "M", 64, 64, "M", 128, 128, "M", 128, 128, "M"]
    features = make_layers(cfg, batch_norm=True)
    with torch.device("meta"):
        model = VGG(features, num_classes=5)
    model.classifier = nn.Linear(128 * 7 * 7, 5)
    return model


def _tv_resnet50_backbone(**kw) -> nn.Module:
    """torchvision's resnet50 (16 Bottleneck blocks) with width_per_group=16: the inner 3 x 3
    convolutions a quarter as wide, the blocks' outputs as in resnet50 (256-2048)."""
    import torchvision.models as tvm

    return tvm.resnet50(weights=None, width_per_group=16, **kw)


def _tv_fcn_resnet50() -> nn.Module:
    """torchvision's FCN on a dilated resnet50 (strides of layers 3 and 4 replaced by dilation),
    built as fcn_resnet50 builds it (``_fcn_resnet``), with the width_per_group=16 backbone."""
    from torchvision.models.segmentation.fcn import _fcn_resnet

    backbone = _tv_resnet50_backbone(replace_stride_with_dilation=[False, True, True])
    return _fcn_resnet(backbone, num_classes=3, aux=False)


def _tv_convnext() -> nn.Module:
    """torchvision's ConvNeXt (convnext_tiny's CNBlock: 7 x 7 depthwise, permute, LayerNorm,
    layer scale) at 16-128 channels with depths 1-1-2-1 instead of 96-768 and 3-3-9-3."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    settings = [
        CNBlockConfig(16, 32, 1),
        CNBlockConfig(32, 64, 1),
        CNBlockConfig(64, 128, 2),
        CNBlockConfig(128, None, 1),
    ]
    return ConvNeXt(settings, stochastic_depth_prob=0.0, num_classes=5)


def _tv_densenet() -> nn.Module:
    """torchvision's DenseNet (densenet121's dense layers and transitions), growth rate 8 and
    two layers per block instead of 32 and 6-12-24-16."""
    import torchvision.models as tvm

    return tvm.DenseNet(
        growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, bn_size=2, num_classes=5
    )


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


def _tv_efficientnet_v2() -> nn.Module:
    """torchvision's EfficientNetV2 code built small: two FusedMBConv stages (a full 3 x 3
    convolution in place of expand + depthwise), then two MBConv stages with SE; one block each."""
    from functools import partial

    import torchvision.models.efficientnet as tve

    settings = [
        tve.FusedMBConvConfig(1, 3, 1, 16, 16, 1),
        tve.FusedMBConvConfig(4, 3, 2, 16, 24, 1),
        tve.MBConvConfig(4, 3, 2, 24, 32, 1),
        tve.MBConvConfig(6, 3, 2, 32, 48, 1),
    ]
    norm = partial(nn.BatchNorm2d, eps=1e-3)
    return tve.EfficientNet(settings, 0.0, 0.0, num_classes=5, norm_layer=norm, last_channel=128)


def _tv_maxvit() -> nn.Module:
    """torchvision's MaxViT built small: two stages of MBConv, then attention in 4 x 4 windows
    (block) and over a 4 x 4 grid of strided positions (grid), with relative position bias."""
    import torchvision.models as tvm

    return tvm.MaxVit(
        input_size=(64, 64), stem_channels=16, partition_size=4, block_channels=[16, 32],
        block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=5,
    )  # fmt: skip


def _tv_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return no_randomness(VisionTransformer(
        image_size=64, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=5,
    ))  # fmt: skip


def _tv_swin() -> nn.Module:
    """torchvision's Swin Transformer (swin_t's code) built small: 4 x 4 patches, two stages in
    4 x 4 windows, each a window block and a shifted-window block (torch.roll and the
    attention mask), with patch merging between (x[..., 0::2, 0::2, :])."""
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=5,
    )  # fmt: skip


def _tv_swin3d() -> nn.Module:
    """torchvision's video Swin Transformer (swin3d_t's code) built small: 2 x 4 x 4 patches,
    two stages in 4 x 2 x 2 windows, shifted every other block (a roll over T, H and W and the
    3-D attention mask), patch merging over H and W between them."""
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    return SwinTransformer3d(
        patch_size=[2, 4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=[4, 2, 2], stochastic_depth_prob=0.0, num_classes=4,
    )  # fmt: skip


def _timm_maxvit() -> nn.Module:
    """timm's MaxxVit code (MaxViT) built small: two stages of MBConv + window attention in 4 x
    4 blocks + grid attention over a 4 x 4 grid (its partition/reverse reshapes of NHWC)."""
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitConvCfg, MaxxVitTransformerCfg

    cfg = MaxxVitCfg(
        embed_dim=(16, 32), depths=(1, 1), block_type=("M", "M"), stem_width=16,
        stem_bias=True,
        conv_cfg=MaxxVitConvCfg(block_type="mbconv", expand_ratio=4.0, pre_norm_act=True,
                                stride_mode="dw", attn_layer="se"),
        transformer_cfg=MaxxVitTransformerCfg(dim_head=8, window_size=(4, 4), grid_size=(4, 4)),
    )  # fmt: skip
    return MaxxVit(cfg, img_size=64, num_classes=5)


def _timm_coatnet() -> nn.Module:
    """timm's MaxxVit code as CoAtNet, built small: two MBConv stages, then a transformer stage
    whose attention spans every position of the 4 x 4 map (relative position bias)."""
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitConvCfg, MaxxVitTransformerCfg

    cfg = MaxxVitCfg(
        embed_dim=(16, 32, 32), depths=(1, 1, 1), block_type=("C", "C", "T"), stem_width=16,
        conv_cfg=MaxxVitConvCfg(block_type="mbconv", expand_ratio=4.0, attn_layer="se"),
        transformer_cfg=MaxxVitTransformerCfg(dim_head=8),
    )  # fmt: skip
    return MaxxVit(cfg, img_size=64, num_classes=5)


def _timm_poolformerv2() -> nn.Module:
    """timm's MetaFormer as PoolFormerV2 (poolformerv2_s12's layers), one block per stage and
    narrow: GroupNorm with one group (a norm over C, H and W), x - avg_pool(x) as the token
    mixer (count_include_pad=False), layer and residual scale parameters."""
    from timm.models.metaformer import GroupNorm1NoBias, MetaFormer

    return MetaFormer(
        depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), norm_layers=GroupNorm1NoBias,
        use_mlp_head=False, num_classes=5,
    )  # fmt: skip


def _timm_volo() -> nn.Module:
    from timm.models.volo import VOLO

    return no_randomness(VOLO(
        layers=(1, 1, 1, 1), img_size=64, embed_dims=(32, 64, 64, 64), num_heads=(2, 4, 4, 4),
        stem_hidden_dim=16, num_classes=5,
    ))  # fmt: skip


def _timm_mvitv2_cls() -> nn.Module:
    import dataclasses

    from timm.models.mvitv2 import MultiScaleVit, model_cfgs

    cfg = dataclasses.replace(model_cfgs["mvitv2_tiny"], use_cls_token=True, depths=(1, 1, 1, 1),
                              embed_dim=(16, 32, 64, 128))  # fmt: skip
    return no_randomness(MultiScaleVit(cfg, img_size=64, num_classes=5))


def _timm_tresnet() -> nn.Module:
    """timm's TResNet (tresnet_m's code) with one block per stage at half width: a
    space-to-depth stem (view/permute of 4 x 4 patches into channels), anti-aliased
    downsampling, SE, in-place activated BatchNorm."""
    from timm.models.tresnet import TResNet

    return TResNet(layers=[1, 1, 1, 1], width_factor=0.5, num_classes=5)


def _smp(kind: str, encoder: str = "resnet18", **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        cls = getattr(smp, kind)
        return no_randomness(cls(encoder_name=encoder, encoder_weights=None, classes=2, **kw))

    return build


def _monai(name: str, *args, **kw) -> Callable[[], nn.Module]:
    """MONAI's ``monai.networks.nets.NAME(*args, **kw)``, 3-D, random weights."""

    def build() -> nn.Module:
        import monai.networks.nets as mn

        return no_randomness(getattr(mn, name)(*args, **kw))

    return build


def _monai_highresnet() -> nn.Module:
    """MONAI's HighResNet with its default six layer groups, narrow (4-16 features) and one
    residual block per group instead of three: the dilations 1, 2 and 4 of res_1-res_3 and
    the zero-padded channel matching of its residual shortcuts are kept."""
    import monai.networks.nets as mn

    layers = (
        {"name": "conv_0", "n_features": 4, "kernel_size": 3},
        {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
        {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
        {"name": "res_3", "n_features": 8, "kernels": (3, 3), "repeat": 1},
        {"name": "conv_1", "n_features": 16, "kernel_size": 1},
        {"name": "conv_2", "kernel_size": 1},
    )
    return mn.HighResNet(3, 1, 2, layer_params=layers)


def _tv_video(conv: str, stem: str) -> Callable[[], nn.Module]:
    """torchvision's VideoResNet (r3d_18, mc3_18, r2plus1d_18's code) with one BasicBlock per
    stage instead of two: ``conv`` names the stages' convolution makers (``Conv3DSimple``, or
    ``Conv3DNoTemporal`` after the first stage for MC3, ``Conv2Plus1D``), ``stem`` the stem."""

    def build() -> nn.Module:
        import torchvision.models.video.resnet as tvr

        makers = {
            "r3d": [tvr.Conv3DSimple] * 4,
            "mc3": [tvr.Conv3DSimple] + [tvr.Conv3DNoTemporal] * 3,
            "r2plus1d": [tvr.Conv2Plus1D] * 4,
        }[conv]
        stem_cls = getattr(tvr, stem)
        return tvr.VideoResNet(tvr.BasicBlock, makers, [1, 1, 1, 1], stem_cls, num_classes=4)

    return build


ARCHS: dict[str, Arch] = {
    # ---------------------------------------------------------------- torchvision classifiers
    "tv resnet18": Arch("torchvision", _tv("resnet18", num_classes=5), what="basic blocks"),
    "tv resnet50": Arch(
        "torchvision", lambda: no_randomness(_tv_resnet50_backbone(num_classes=5)),
        what="bottlenecks (width_per_group=16)",
    ),
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
    "tv convnext": Arch(
        "torchvision", _tv_convnext,
        what="LayerNorm2d, layer scale parameter, 7x7 depthwise (convnext_tiny's blocks, small)",
    ),
    "tv densenet": Arch(
        "torchvision", _tv_densenet,
        what="concatenation, F.relu + pool (densenet121's layers, small)",
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
    "tv vgg_bn": Arch(
        "torchvision", _vgg_bn, (3, 32, 32), what="AdaptiveAvgPool2d((7, 7)), flatten (narrow)"
    ),
    "tv mnasnet0_5": Arch("torchvision", _tv("mnasnet0_5", num_classes=5), what="x.mean([2, 3])"),
    # ---------------------------------------------------------------- torchvision segmentation
    "tv fcn_resnet50": Arch(
        "torchvision", lambda: no_randomness(_tv_fcn_resnet50()),
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
    "smp PAN resnet18": Arch(
        "smp", _smp("PAN", decoder_channels=16), (3, 256, 256),
        what="feature pyramid attention: interpolations to sizes computed from x.shape, a "
        "global pool branch (256 x 256: its pyramid pools the 1/32 map three times)",
    ),
    "smp UnetPlusPlus resnet18": Arch(
        "smp", _smp("UnetPlusPlus", encoder_depth=3, decoder_channels=(16, 8, 8)),
        what="nested dense skip connections: every node concatenates interpolated maps",
    ),
    "smp DeepLabV3Plus resnet18": Arch(
        "smp", _smp("DeepLabV3Plus", decoder_channels=16),
        what="ASPP, then the low-level skip: upsampling by 4 and concatenation",
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
    # ---------------------------------------------------------------- added 2026-11
    # Hybrids first: attention over windows, grids or every position, and patch reshapes.
    # Under rows and cols most are refused today (attention over a whole map cannot run on
    # blocks); under fallback="gather" each must be exact (test_exact_under_gather).
    "tv swin": Arch(
        "torchvision", _tv_swin, what="shifted-window attention: windows folded into the "
        "batch, a cyclic roll, the attention mask, strided patch merging",
    ),
    "tv swin 40": Arch(
        "torchvision", _tv_swin, (3, 40, 40),
        what="the same at 40 x 40: 10 rows padded to 12, 3 windows of 4 on blocks of 6 (rows "
        "move to 8 + 4 and back), patch merging's 1::2 on blocks of 5 (rows fetched first)",
    ),
    "tv maxvit": Arch(
        "torchvision", _tv_maxvit,
        what="hybrid: window and grid attention (partition reshapes), relative position bias",
    ),
    "timm maxvit": Arch(
        "timm", _timm_maxvit,
        what="hybrid: timm's own window/grid partition of NHWC maps, MBConv with SE",
    ),
    "timm coatnet": Arch(
        "timm", _timm_coatnet,
        what="hybrid: global attention over every position of the last map (flatten to tokens)",
    ),
    "timm mobilevit_xxs": Arch(
        "timm", _timm("mobilevit_xxs"),
        what="hybrid: MobileViT unfold of 2 x 2 patches into tokens, transformer, fold back",
    ),
    "timm mobilevitv2_050": Arch(
        "timm", _timm("mobilevitv2_050"),
        what="hybrid: separable linear attention (softmax over all patches), F.unfold/F.fold",
    ),
    "timm edgenext_xx_small": Arch(
        "timm", _timm("edgenext_xx_small"),
        what="hybrid: transposed (channel) attention over all positions, Fourier positional "
        "encoding built from the map's size, split of channels into depthwise branches",
    ),
    "timm efficientformerv2_s0": Arch(
        "timm", _timm("efficientformerv2_s0", img_size=64, depths=(1, 1, 3, 2)),
        what="hybrid: 4-D attention with a bias table sized for the whole map, strided "
        "attention downsampling; depths cut from (2, 2, 6, 4), the attention blocks kept",
    ),
    "timm vit_tiny gap": Arch(
        "timm", _timm("vit_tiny_patch16_224", img_size=64, patch_size=8, class_token=False,
                      global_pool="avg"),
        what="a plain ViT: patch embedding, a whole (L, C) position embedding cut to the "
        "block, global self-attention over 64 tokens, mean over x[:, 0:] (no class token)",
    ),
    "timm vit_tiny": Arch(
        "timm", _timm("vit_tiny_patch16_224", img_size=64, patch_size=8),
        what="a plain ViT with its class token: the token concatenated before the patch "
        "tokens, a (1 + L, C) position embedding, the class token's output classified",
    ),
    "timm deit_tiny distilled": Arch(
        "timm", _timm("deit_tiny_distilled_patch16_224", img_size=64, patch_size=8, depth=2),
        what="DeiT: a class and a distillation token before the patch tokens, two heads",
    ),
    "timm cait_xxs24": Arch(
        "timm", _timm("cait_xxs24_224", img_size=64, patch_size=8, depth=2),
        what="CaiT: talking-heads attention, then class attention: the class token's query "
        "over its own and every patch token's keys",
    ),
    "timm coat_lite_tiny": Arch(
        "timm", _timm("coat_lite_tiny", img_size=64),
        what="CoaT-Lite: factorized attention, convolutional position encodings on the "
        "tokens without the class token",
    ),
    "tv vit": Arch(
        "torchvision", _tv_vit,
        what="torchvision's ViT: nn.MultiheadAttention over the class token and patch tokens",
    ),
    "timm xcit_nano_12_p8": Arch(
        "timm", _timm("xcit_nano_12_p8_224", img_size=64, depth=2),
        what="XCiT: cross-covariance attention, BatchNorm in the patch embedding, then "
        "class-attention layers with the class token joined late; depth cut from 12",
    ),
    "timm beit": Arch(
        "timm", _timm("beit_base_patch16_224", img_size=64, patch_size=8, depth=2, embed_dim=32,
                      num_heads=2),
        what="BEiT: a relative-position bias over the class token and every patch token "
        "(a whole (h, 1 + L, 1 + L) mask), layer scales; narrowed from the base model",
    ),
    "timm vit_tiny reg4": Arch(
        "timm", _timm("vit_tiny_patch16_224", img_size=64, patch_size=8, depth=2, reg_tokens=4),
        what="a ViT with four register tokens beside its class token: a prefix of five",
    ),
    "timm pit_ti": Arch(
        "timm", _timm("pit_ti_224", img_size=64),
        what="PiT: the tokens after the class token read back as a map and pooled by a "
        "strided depthwise convolution, the class token by a Linear, joined again",
    ),
    "timm tnt": Arch(
        "timm", _timm("tnt_s_patch16_224", img_size=40, patch_size=8, embed_dim=32,
                      inner_dim=8, depth=2, num_heads_outer=2, num_heads_inner=2),
        (3, 40, 40),
        what="Transformer in Transformer: 5 x 5 patches of 8 x 8 pixels folded into the batch "
        "(F.unfold fetches each rank's whole patches), a convolution inside each patch, "
        "attention over each patch's pixels and over the patches with a class token",
    ),
    "timm botnet26t": Arch(
        "timm", _timm("botnet26t_256", img_size=128), (3, 128, 128),
        what="BotNet: attention over every token of 8 x 8 and 4 x 4 maps, relative position "
        "logits skewed to absolute positions (a pad, flatten and reshape across rows) along "
        "the split dimension, then expanded",
    ),
    "timm convit_tiny": Arch(
        "timm", _timm("convit_tiny", img_size=64, patch_size=8, depth=2, local_up_to_layer=1),
        what="ConViT: gated positional self-attention with whole (L, L, 3) relative "
        "indices, then the class token joined for plain attention",
    ),
    "timm eva02_tiny": Arch(
        "timm", _timm("eva02_tiny_patch14_224", img_size=64, patch_size=8, depth=2),
        what="EVA-02: rotary position embeddings applied to the tokens after the class token, "
        "SwiGLU",
    ),
    "timm shvit_s1": Arch(
        "timm", _timm("shvit_s1"), steps=1,
        what="SHViT: single-head attention on part of the channels, written channels first "
        "(v @ attn^T); one step (its BatchNorms over few values make the dense model's own "
        "second step chaotic: 3e1 under a 1e-13 weight change, tests/zoo/sensitivity.py)",
    ),
    "timm levit_128s": Arch(
        "timm", _timm("levit_128s", img_size=128), (3, 128, 128),
        what="LeViT: attention with a learned bias per offset, queries from every second "
        "token (x[:, ::2, ::2]), BatchNorm1d over (N * L, C); at 128 x 128, whose last stage "
        "is 2 x 2 tokens (at 64 x 64 one row of them would be split over two ranks)",
    ),
    "timm volo_d1": Arch(
        "timm", _timm_volo,
        what="VOLO: outlook attention (F.unfold, attention per window, F.fold), attention, "
        "class attention, and the token-labelling head's maximum over the tokens after the "
        "class token; depths cut from (4, 4, 8, 2), widths narrowed",
    ),
    "timm mvitv2_tiny": Arch(
        "timm", _timm("mvitv2_tiny", img_size=64),
        what="MViTv2: pooling attention (queries, keys and values pooled by strided "
        "convolutions on the tokens read as maps), relative positions by row and column "
        "(einsum with whole (H, K, C) tables), written into the attention map by setitem",
    ),
    "timm mvitv2 cls": Arch(
        "timm", _timm_mvitv2_cls,
        what="MViTv2 with its class token: split off before each pooling and joined after, "
        "the relative positions added to the map's tokens after it; depths (1, 1, 1, 1), "
        "widths narrowed",
    ),
    "smp Segformer mit_b0": Arch(
        "smp", _smp("Segformer", encoder="mit_b0", decoder_segmentation_channels=32),
        what="hybrid: Mix Transformer encoder (overlapping patch embeddings, attention with a "
        "spatially reduced key/value, tokens reshaped for a depthwise conv), MLP decoder",
    ),
    "smp MAnet mobilenetv3": Arch(
        "smp",
        _smp(
            "MAnet",
            encoder="tu-mobilenetv3_small_050",
            decoder_channels=(32, 16, 16, 8, 8),
            decoder_pab_channels=16,
        ),
        what="position attention block (softmax over every pair of positions), multi-scale "
        "fusion attention; a timm encoder through smp's tu- adapter",
    ),
    "timm tresnet": Arch(
        "timm", _timm_tresnet,
        what="patch reshape: space-to-depth stem (4 x 4 patches into channels), anti-aliasing",
    ),
    "timm eca_resnet33ts": Arch(
        "timm", _timm("eca_resnet33ts"),
        what="ECA gates: a 1-D convolution over the pooled channels, expand_as to the block",
    ),
    "monai FlexibleUNet": Arch(
        "monai",
        _monai("FlexibleUNet", 3, 2, backbone="efficientnet-b0", pretrained=False,
               spatial_dims=2, decoder_channels=(16, 8, 8, 4, 4)),
        what="MONAI's U-Net on an EfficientNet encoder: skip sizes compared, pads computed "
        "from them (UpCat)",
    ),
    "monai BasicUNet pixelshuffle": Arch(
        "monai",
        _monai("BasicUNet", 2, 3, 2, features=(4, 4, 8, 8, 16, 4), upsample="pixelshuffle"),
        what="sub-pixel upsampling (MONAI's pixelshuffle: a view that splits the channels, a "
        "permute and a reshape merging each spatial dimension with its factor)",
    ),
    "timm cs3darknet_focus_s": Arch(
        "timm", _timm("cs3darknet_focus_s"),
        what="patch reshape: Focus stem (x[..., ::2, ::2] and its 3 shifts concatenated), "
        "cross-stage partial blocks (channel split and concatenation)",
    ),
    # Convolutional networks with forward code the others do not have.
    "tv efficientnet_v2": Arch(
        "torchvision", _tv_efficientnet_v2, what="FusedMBConv, MBConv with SE (built small)"
    ),
    "timm convnextv2_atto": Arch(
        "timm", _timm("convnextv2_atto"),
        what="GRN: a norm over H and W of channels-last blocks (torch.norm)",
    ),
    "timm ghostnet_050": Arch(
        "timm", _timm("ghostnet_050"),
        what="ghost modules: cheap features concatenated, then x[:, :n, :, :]",
    ),
    "timm poolformerv2": Arch(
        "timm", _timm_poolformerv2,
        what="GroupNorm(1) over C, H and W; x - avg_pool(x) token mixer; scale parameters",
    ),
    "timm inception_next_atto": Arch(
        "timm", _timm("inception_next_atto"),
        what="torch.split of channels into square, 1 x k and k x 1 depthwise branches",
    ),
    "timm mobilenetv4_conv_small_050": Arch(
        "timm", _timm("mobilenetv4_conv_small_050"),
        what="universal inverted bottlenecks (optional depthwise before and after)",
        # Its BatchNorms normalize a few values on 2 x 2 maps: weights perturbed by 1e-13 move
        # the dense model's second-step gradients by 2e-5 of their scale (measured), so only
        # the first step can be compared (as inception_v3).
        steps=1,
    ),
    "smp Unet resnet10t scse": Arch(
        "smp",
        _smp(
            "Unet",
            encoder="tu-resnet10t",
            decoder_channels=(32, 32, 16, 16, 16),
            decoder_attention_type="scse",
        ),
        # Its last decoder block has no skip, so its attention1 is never used: refused under
        # data (DataParallel finds parameters without gradient), as PSPNet's unused stages.
        what="SCSE attention: a channel gate (global pool) and a spatial gate (1 x 1 conv)",
    ),
    "smp UPerNet mobilenet_v2": Arch(
        "smp", _smp("UPerNet", encoder="mobilenet_v2", decoder_channels=32),
        what="pyramid pooling module (pools to 1, 2, 3, 6) and FPN fusion by interpolation",
    ),
    # ---------------------------------------------------------------- volumes
    # (C, D, H, W) inputs, under VOLUME_STRATEGIES. 16^3 unless a network's depth of
    # downsampling needs more. Where the last maps have 1 plane along a split dimension (the
    # video ResNets' last stage over depth, MC3's over rows, UNETR's one patch), one rank's
    # block is empty there: that path is tested too. The video ResNets have 14M, 5M and 12M
    # weights whatever the input (64-512 channels are fixed): MC3 takes 16 x 16 frames, R3D
    # and R(2+1)D 32 x 32 (at 16 x 16 R(2+1)D's BatchNorms on 1^3 maps make the dense model
    # itself chaotic by its second step).
    "monai UNet": Arch(
        "monai",
        _monai("UNet", 3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1),
        (1, 16, 16, 16),
        what="residual units, InstanceNorm3d (no affine), PReLU, strided and transposed convs",
    ),
    "monai SwinUNETR 2-D": Arch(
        "monai", _monai("SwinUNETR", in_channels=1, out_channels=2, feature_size=12,
                        window_size=2, spatial_dims=2), (1, 64, 64),
        what="MONAI's Swin U-Net: window attention on channels-last maps folded by "
        "window_partition, the mask made of every window, strided patch merging",
    ),
    "monai SwinUNETR": Arch(
        "monai", _monai("SwinUNETR", in_channels=1, out_channels=2, feature_size=12,
                        window_size=2, spatial_dims=3), (1, 64, 64, 64),
        what="the same in 3-D: windows of 2 x 2 x 2 down to a 4^3 map, split in two",
    ),
    "tv swin3d": Arch(
        "torchvision", _tv_swin3d, (3, 16, 32, 32),
        what="video Swin: 3-D shifted windows folded into the batch, the 3-D attention mask",
    ),
    "tv swin_t": Arch(
        "torchvision", _tv("swin_t", num_classes=5), (3, 448, 224),
        what="swin_t itself: windows of 7 down to a 14 x 7 map, two blocks of 7 rows",
    ),
    "tv swin3d_t": Arch(
        "torchvision", _tv("swin3d_t", num_classes=4), (3, 32, 64, 64),
        what="swin3d_t itself: 8 x 7 x 7 windows over 16 frames, two blocks of 8",
    ),
    "monai BasicUNet": Arch(
        "monai", _monai("BasicUNet", 3, 1, 2, features=(4, 4, 8, 8, 16, 4)), (1, 32, 32, 32),
        what="four max-pool levels, affine InstanceNorm3d, LeakyReLU, skip concatenation",
    ),
    # Kept out of the test tier for their cost (SLOW): survey.py --arch runs them.
    "monai VNet": Arch(
        "monai", _monai("VNet", spatial_dims=3, in_channels=1, out_channels=2), (1, 16, 16, 16),
        what="InputTransition's channel repeat, 5 x 5 x 5 convolutions, PReLU (45M weights)",
    ),
    "monai BasicUNetPlusPlus": Arch(
        "monai", _monai("BasicUNetPlusPlus", 3, 1, 2, features=(4, 4, 8, 8, 16, 4)),
        (1, 32, 32, 32),
        what="nested dense skip connections: UpCat's pad from compared skip sizes at every node",
    ),
    "monai AttentionUnet": Arch(
        "monai", _monai("AttentionUnet", 3, 1, 2, channels=(4, 8, 16), strides=(2, 2)),
        (1, 16, 16, 16),
        what="attention gates: a sigmoid map from a 1 x 1 x 1 conv multiplies the skip (x * psi)",
    ),
    "monai SegResNet": Arch(
        "monai",
        _monai("SegResNet", 3, init_filters=4, in_channels=1, out_channels=2,
               blocks_down=(1, 2, 2), blocks_up=(1, 1), norm=("GROUP", {"num_groups": 2})),
        (1, 16, 16, 16),
        what="GroupNorm over channels, D, H and W; pre-activation residual blocks; "
        "1 x 1 x 1 conv then trilinear upsampling",
    ),
    "monai SegResNetDS": Arch(
        "monai",
        _monai("SegResNetDS", 3, init_filters=4, in_channels=1, out_channels=2,
               blocks_down=(1, 1, 1), dsdepth=2),
        (1, 16, 16, 16),
        what="deep supervision: a list of two heads at two scales in training; BatchNorm3d, "
        "transposed-conv upsampling with output_padding",
    ),
    "monai DynUNet": Arch(
        "monai",
        _monai("DynUNet", 3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
               upsample_kernel_size=[2, 2], filters=[4, 8, 16], res_block=True,
               deep_supervision=True, deep_supr_num=1),
        (1, 16, 16, 16),
        what="nnU-Net's network: residual blocks, affine InstanceNorm3d, LeakyReLU in place; "
        "deep supervision heads interpolated to full size and stacked (torch.stack)",
    ),
    "monai UNETR": Arch(
        "monai",
        _monai("UNETR", 1, 2, img_size=16, feature_size=4, hidden_size=32, mlp_dim=64,
               num_heads=2),
        (1, 16, 16, 16),
        what="transformer hybrid: 16^3 patch embedding, ViT encoder (attention over every "
        "patch), token maps reshaped back to volumes for a convolutional decoder",
    ),
    "monai ViTAutoEnc": Arch(
        "monai",
        _monai("ViTAutoEnc", in_channels=1, img_size=16, patch_size=4, hidden_size=32,
               mlp_dim=64, num_layers=2, num_heads=2, spatial_dims=3),
        (1, 16, 16, 16),
        what="a ViT autoencoder: attention over every 4^3 patch, transposed convolutions back "
        "to the volume, and its hidden tokens returned beside it (an output whose spatial "
        "dimensions are folded into tokens: gathered whole in the whole order)",
    ),
    "monai HighResNet": Arch(
        "monai", _monai_highresnet, (1, 16, 16, 16),
        what="dilated convolutions (1, 2, 4), BatchNorm3d, shortcuts zero-padded in channels",
    ),
    "monai DenseNet": Arch(
        "monai",
        _monai("DenseNet", 3, 1, 3, init_features=8, growth_rate=4, block_config=(2, 2, 2),
               bn_size=2),
        (1, 32, 32, 32),
        what="3-D classifier: dense blocks (concatenation), average-pool transitions, "
        "AdaptiveAvgPool3d(1), flatten",
    ),
    "monai ResNet": Arch(
        "monai",
        _monai("ResNet", "basic", [1, 1, 1, 1], [8, 16, 32, 64], spatial_dims=3,
               n_input_channels=1, num_classes=3),
        (1, 32, 32, 32),
        what="3-D classifier (MedicalNet's ResNet): 7^3 stem, max pool, BatchNorm3d",
    ),
    "monai SEResNet50": Arch(
        "monai",
        _monai("SEResNet50", layers=(1, 1, 1, 1), spatial_dims=3, in_channels=1,
               num_classes=3, pretrained=False),
        (1, 32, 32, 32),
        what="3-D squeeze-and-excitation: AdaptiveAvgPool3d(1) gates multiplying split "
        "features; one bottleneck per stage",
        # Its last BatchNorms normalize 2 values per channel (batch 2, 1^3 maps): the dense
        # model alone, its weights perturbed by 1e-13, moves its second step's gradients by
        # their whole scale (measured), so only the first step can be compared.
        steps=1,
    ),
    "tv r3d_18": Arch(
        "torchvision", _tv_video("r3d", "BasicStem"), (3, 8, 32, 32),
        what="video ResNet: 3 x 7 x 7 stem, full 3-D convolutions (one block per stage)",
    ),
    "tv mc3_18": Arch(
        "torchvision", _tv_video("mc3", "BasicStem"), (3, 8, 16, 16),
        what="mixed convolutions: 3-D in the first stage, 1 x 3 x 3 after it",
    ),
    "tv r2plus1d_18": Arch(
        "torchvision", _tv_video("r2plus1d", "R2Plus1dStem"), (3, 8, 32, 32),
        what="(2+1)-D: each 3 x 3 x 3 conv factored into 1 x 3 x 3 and 3 x 1 x 1 with BN between",
    ),
}
