"""parallelkit.models on one process: ResNet-18/34/50 and DCGAN layouts, parameter counts,
output shapes, injected layer types, argument checks and the registry.

Full-size models are built on the meta device (shapes without memory or initialization), so
the torchvision parameter counts and the 1024x1024 DCGAN layout cost nothing; forward passes
use narrow models and small images.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallelkit as pk
from parallelkit.comm.local import LocalCommunicator
from parallelkit.models import (
    BasicBlock,
    Bottleneck,
    Discriminator,
    Generator,
    ResNet,
    UNet,
    create,
    list_models,
    register,
    registry,
    resnet18,
    resnet34,
    resnet50,
)

RESNETS = {"resnet18": resnet18, "resnet34": resnet34, "resnet50": resnet50}
SMALL = dict(widths=(4, 8, 8, 16), num_classes=7)  # narrow enough for quick forward passes


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def convs(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d | nn.ConvTranspose2d)]


# --------------------------------------------------------------------------- ResNet
@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet50", 25_557_032)],
)
def test_parameter_counts_equal_torchvisions(name, expected):
    with torch.device("meta"):
        assert count(RESNETS[name]()) == expected  # ImageNet stem, 1000 classes
        assert count(create(name)) == expected


@pytest.mark.parametrize("stem", ["imagenet", "cifar"])
@pytest.mark.parametrize("name", list(RESNETS))
def test_resnet_output_and_feature_shapes(name, stem):
    torch.manual_seed(0)
    model = RESNETS[name](stem=stem, **SMALL)
    features = {}
    model.layer4.register_forward_hook(lambda m, i, out: features.update(out=out))
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)
    expansion = 4 if name == "resnet50" else 1
    side = 1 if stem == "imagenet" else 4  # the ImageNet stem reduces by 32, CIFAR's by 8
    assert features["out"].shape == (2, 16 * expansion, side, side)
    assert model.fc.in_features == 16 * expansion


def test_bottleneck_strides_its_3x3_and_expands_by_4():
    block = Bottleneck(64, 32, stride=2)
    layout = [(c.kernel_size, c.stride, c.in_channels, c.out_channels) for c in convs(block)]
    assert layout == [
        ((1, 1), (1, 1), 64, 32),
        ((3, 3), (2, 2), 32, 32),  # "v1.5": the stride on the 3x3
        ((1, 1), (1, 1), 32, 128),
        ((1, 1), (2, 2), 64, 128),  # projection shortcut
    ]
    assert block(torch.randn(1, 64, 8, 8)).shape == (1, 128, 4, 4)
    assert Bottleneck(128, 32).downsample is None  # same shape: identity shortcut


def test_resnet50_stages_and_names_follow_torchvision():
    with torch.device("meta"):
        model = resnet50()
    outs = [getattr(model, f"layer{i}")[-1].conv3.out_channels for i in (1, 2, 3, 4)]
    assert outs == [256, 512, 1024, 2048]
    assert [len(getattr(model, f"layer{i}")) for i in (1, 2, 3, 4)] == [3, 4, 6, 3]
    assert [k for k in model.state_dict() if k.startswith("layer2.0.")] == [
        f"layer2.0.{m}.{leaf}"
        for m in ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "downsample.0", "downsample.1")
        for leaf in (
            ("weight",)
            if "conv" in m or m.endswith(".0")
            else ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
        )
    ]


# Recorded from the code before Bottleneck was added: module names in state_dict order.
RESNET18_MODULES = (
    "conv1 bn1 "
    + " ".join(
        f"layer{s}.{b}.{m}"
        for s in (1, 2, 3, 4)
        for b in (0, 1)
        for m in ("conv1", "bn1", "conv2", "bn2")
        + (("downsample.0", "downsample.1") if s > 1 and b == 0 else ())
    )
    + " fc"
).split()
_BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


@pytest.mark.parametrize("stem", ["imagenet", "cifar"])
def test_resnet18_state_dict_keys_are_unchanged(stem):
    expected = []
    for m in RESNET18_MODULES:
        is_norm = m.rpartition(".")[2].startswith("bn") or m.endswith("downsample.1")
        leaves = _BN if is_norm else ("weight", "bias") if m == "fc" else ("weight",)
        expected += [f"{m}.{leaf}" for leaf in leaves]
    assert len(expected) == 122
    with torch.device("meta"):
        assert list(resnet18(stem=stem).state_dict()) == expected
        assert list(ResNet().state_dict()) == expected  # the defaults are still ResNet-18


def test_any_number_of_stages():
    model = ResNet((1, 2), widths=(4, 6), num_classes=3, stem="cifar", block=Bottleneck)
    assert model.stage_names == ("layer1", "layer2")
    assert not hasattr(model, "layer3")
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3)
    assert model.fc.in_features == 24


def test_a_replaced_stage_is_the_one_run():
    """forward looks stages up by name, so parallelize(keep_dense=["layer2"]) takes effect."""
    model = ResNet((1, 1), widths=(4, 4), num_classes=3, stem="cifar").eval()
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    parallel = pk.parallelize(model, LocalCommunicator(), "spatial", keep_dense=["layer2"])
    calls = []
    model.layer2.register_forward_hook(lambda *_: calls.append("wrapper"))
    torch.testing.assert_close(parallel(x), expected)
    assert calls == ["wrapper"]  # a list of stages cached at construction would miss it


@pytest.mark.parametrize("block", [BasicBlock, Bottleneck])
def test_zero_init_residual_zeroes_each_blocks_last_norm(block):
    last = "bn3" if block is Bottleneck else "bn2"
    for zero in (False, True):
        model = ResNet((1, 2), widths=(4, 8), block=block, zero_init_residual=zero)
        blocks = [m for m in model.modules() if isinstance(m, block)]
        assert len(blocks) == 3
        for b in blocks:
            assert bool((getattr(b, last).weight == 0).all()) is zero
            assert bool((b.bn1.weight == 1).all())  # the others keep torch's default


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(stem="tiny"), "stem must be 'imagenet' or 'cifar'"),
        (dict(depths=(2, 2), widths=(4, 8, 16)), "one entry per stage"),
        (dict(depths=(), widths=()), "one entry per stage"),
        (dict(depths=(2, 0)), r"depths must be positive integers, got \(2, 0\)"),
        (dict(num_classes=0), "num_classes must be a positive integer, got 0"),
        (dict(block=nn.Identity), "needs an integer class attribute 'expansion'"),
    ],
)
def test_resnet_rejects_bad_arguments(kwargs, message):
    kwargs = {"depths": (1, 1), "widths": (4, 8), **kwargs}
    with pytest.raises(ValueError, match=message):
        ResNet(**kwargs)


# --------------------------------------------------------------------------- layer injection
class MarkedConv(nn.Conv2d):
    pass


class MarkedConvTranspose(nn.ConvTranspose2d):
    pass


class MarkedNorm(nn.BatchNorm2d):
    pass


class MarkedAct(nn.ReLU):
    pass


def _kinds(model: nn.Module) -> dict[type, int]:
    found: dict[type, int] = {}
    for m in model.modules():
        found[type(m)] = found.get(type(m), 0) + 1
    return found


INJECTED = {
    "resnet18": (lambda **kw: resnet18(**SMALL, **kw), "conv_layer", MarkedConv, (2, 3, 16, 16)),
    "resnet50": (lambda **kw: resnet50(**SMALL, **kw), "conv_layer", MarkedConv, (2, 3, 16, 16)),
    "generator": (
        lambda **kw: Generator(nz=4, ngf=2, image_size=16, **kw),
        "conv_transpose_layer",
        MarkedConvTranspose,
        (2, 4, 1, 1),
    ),
    "discriminator": (
        lambda **kw: Discriminator(ndf=2, image_size=16, **kw),
        "conv_layer",
        MarkedConv,
        (2, 3, 16, 16),
    ),
}


@pytest.mark.parametrize("name", list(INJECTED))
def test_injected_layer_types_are_the_ones_used(name):
    build, conv_arg, marked_conv, shape = INJECTED[name]
    default = build()
    marked = build(**{conv_arg: marked_conv, "norm_layer": MarkedNorm, "act_layer": MarkedAct})
    plain_conv = nn.ConvTranspose2d if name == "generator" else nn.Conv2d
    plain_act = nn.LeakyReLU if name == "discriminator" else nn.ReLU
    # Negative control: the default model holds plain torch layers and no marked ones ...
    kinds = _kinds(default)
    assert kinds[plain_conv] == len(convs(default)) > 0
    assert kinds[nn.BatchNorm2d] > 0 and kinds[plain_act] > 0
    assert not {marked_conv, MarkedNorm, MarkedAct} & set(kinds)
    # ... and the injected one holds exactly as many marked layers where those were.
    marked_kinds = _kinds(marked)
    assert marked_kinds[marked_conv] == kinds[plain_conv]
    assert marked_kinds[MarkedNorm] == kinds[nn.BatchNorm2d]
    assert marked_kinds[MarkedAct] == kinds[plain_act]
    assert not {plain_conv, nn.BatchNorm2d, plain_act} & set(marked_kinds)
    assert list(marked.state_dict()) == list(default.state_dict())
    marked(torch.randn(shape))  # and it runs


# --------------------------------------------------------------------------- DCGAN
def test_dcgan_64_is_the_papers_layout():
    g, d = Generator(), Discriminator()  # nz=100, ngf=ndf=64, 64x64 RGB
    assert [(c.in_channels, c.out_channels) for c in convs(g)] == [
        (100, 512), (512, 256), (256, 128), (128, 64), (64, 3)
    ]  # fmt: skip
    assert [(c.kernel_size, c.stride, c.padding) for c in convs(g)] == [
        ((4, 4), (1, 1), (0, 0))
    ] + [((4, 4), (2, 2), (1, 1))] * 4
    assert [(c.in_channels, c.out_channels) for c in convs(d)] == [
        (3, 64), (64, 128), (128, 256), (256, 512), (512, 1)
    ]  # fmt: skip
    # Counts and state_dict layout recorded from the code before max_channels was added.
    assert (count(g), count(d)) == (3_576_704, 2_765_568)
    g_weights = [k for k, v in g.state_dict().items() if v.dim() == 4]
    assert g_weights == ["main.0.weight", "main.3.weight", "main.6.weight", "main.9.weight",
                         "main.12.weight"]  # fmt: skip
    assert len(g.state_dict()) == 25 and len(d.state_dict()) == 20
    assert [k for k, v in d.state_dict().items() if v.dim() == 4] == [
        "features.0.weight", "features.2.weight", "features.5.weight", "features.8.weight",
        "head.weight",
    ]  # fmt: skip
    assert isinstance(d.features[1], nn.LeakyReLU) and d.features[1].negative_slope == 0.2
    assert isinstance(g.main[-1], nn.Tanh)


@pytest.mark.parametrize("size", [8, 16, 32, 64, 128, 256, 512, 1024])
def test_dcgan_shapes_for_every_size(size):
    torch.manual_seed(0)
    g = Generator(nz=4, ngf=2, nc=3, image_size=size)
    d = Discriminator(ndf=2, nc=3, image_size=size)
    image = g(torch.randn(1, 4, 1, 1))
    assert image.shape == (1, 3, size, size)
    assert d(image).shape == (1,)
    stages = size.bit_length() - 3
    assert len(convs(g)) == len(convs(d)) == stages + 1


def test_dcgan_1024_widths_stop_at_8_ngf():
    with torch.device("meta"):
        g, d = Generator(image_size=1024), Discriminator(image_size=1024)
        wide = Generator(image_size=128, max_channels=1 << 20)
    assert [c.out_channels for c in convs(g)] == [512] * 5 + [256, 128, 64, 3]
    assert [c.out_channels for c in convs(d)] == [64, 128, 256] + [512] * 5 + [1]
    assert count(g) == 20_358_016 and count(d) == 19_546_880  # uncapped: 729 M and 716 M
    assert convs(wide)[0].out_channels == 1024  # a large cap doubles on, as before the cap


def test_dcgan_max_channels_caps_both_networks():
    g = Generator(ngf=8, image_size=64, max_channels=16)
    d = Discriminator(ndf=8, image_size=64, max_channels=16)
    assert [c.out_channels for c in convs(g)] == [16, 16, 16, 8, 3]
    assert [c.out_channels for c in convs(d)] == [8, 16, 16, 16, 1]


@pytest.mark.parametrize("size", [4, 7, 12, 48, 100, 1000])
def test_dcgan_rejects_image_sizes_that_are_not_powers_of_two(size):
    for build in (Generator, Discriminator):
        with pytest.raises(ValueError, match=rf"image_size must be a power of two >= 8.*{size}"):
            build(image_size=size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(image_size=64.0), "image_size must be a positive integer, got 64.0"),
        (dict(image_size=0), "image_size must be a positive integer, got 0"),
        (dict(ngf=0), "ngf must be a positive integer, got 0"),
        (dict(nz=-1), "nz must be a positive integer"),
        (dict(ngf=16, max_channels=8), "max_channels=8 is below ngf=16"),
    ],
)
def test_dcgan_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Generator(**kwargs)


# --------------------------------------------------------------------------- U-Net
@pytest.mark.parametrize("widths", [(4, 8), (4, 8, 16, 32)])
def test_unet_returns_logits_at_the_input_resolution(widths):
    model = UNet(num_classes=5, in_channels=1, widths=widths)
    x = torch.randn(2, 1, 24, 16, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 5, 24, 16)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # every stage is used


@pytest.mark.parametrize(
    ("spatial_dims", "size", "conv", "norm"),
    [(1, (24,), nn.Conv1d, nn.BatchNorm1d), (3, (8, 16, 12), nn.Conv3d, nn.BatchNorm3d)],
)
def test_unet_of_signals_and_volumes_returns_logits_at_the_input_size(
    spatial_dims, size, conv, norm
):
    model = create("unet", num_classes=5, in_channels=1, widths=(4, 8), spatial_dims=spatial_dims)
    kinds = {type(m) for m in model.modules()}
    assert {conv, norm} <= kinds and not kinds & {nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d}
    x = torch.randn(2, 1, *size, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 5, *size)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # every stage is used


def test_unet_of_2_spatial_dims_is_the_default_and_its_layers_are_arguments():
    torch.manual_seed(0)
    default = UNet(num_classes=3, in_channels=1, widths=(4, 8))
    torch.manual_seed(0)
    explicit = UNet(3, 1, (4, 8), nn.BatchNorm2d, nn.ReLU, spatial_dims=2)
    assert str(default) == str(explicit)
    for a, b in zip(default.state_dict().values(), explicit.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    grouped = UNet(widths=(4, 8), norm_layer=lambda c: nn.GroupNorm(2, c), spatial_dims=3)
    assert any(isinstance(m, nn.GroupNorm) for m in grouped.modules())
    with pytest.raises(ValueError, match="spatial_dims=4; a U-Net here is 1-, 2- or 3-D"):
        UNet(spatial_dims=4)


# --------------------------------------------------------------------------- registry
def test_registry_lists_and_creates_the_models():
    assert list_models() == [
        "dcgan_discriminator", "dcgan_generator", "resnet18", "resnet34", "resnet50", "unet"
    ]  # fmt: skip
    assert isinstance(create("resnet50", num_classes=10, stem="cifar"), ResNet)
    assert isinstance(create("unet", num_classes=3, widths=(4, 8)), UNet)
    assert isinstance(create("dcgan_generator", image_size=32), Generator)
    assert isinstance(create("dcgan_discriminator", image_size=32), Discriminator)


def test_create_rejects_an_unknown_name_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'resnet51'; known models: \[.*resnet50"):
        create("resnet51")


@pytest.mark.parametrize(
    ("name", "kwargs", "bad"),
    [("resnet18", dict(num_clases=10), "num_clases"), ("dcgan_generator", dict(ndf=8), "ndf")],
)
def test_create_rejects_an_unknown_argument_naming_it(name, kwargs, bad):
    message = rf"create\('{name}'\): unexpected keyword arguments \['{bad}'\]; {name} takes \["
    with pytest.raises(TypeError, match=message):
        create(name, **kwargs)


def test_create_passes_bad_values_through_as_the_model_reports_them():
    with pytest.raises(ValueError, match="stem must be 'imagenet' or 'cifar'"):
        create("resnet34", stem="imagenet64")


def test_register_adds_a_constructor(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register("tiny")
    def tiny(width: int = 2) -> nn.Module:
        return nn.Conv2d(3, width, 1)

    assert "tiny" in list_models()
    assert create("tiny", width=5).out_channels == 5
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['depth'\]"):
        create("tiny", depth=5)
    with pytest.raises(ValueError, match="'tiny' is already registered"):
        register("tiny")(lambda: nn.Identity())
    assert register("tiny")(tiny) is tiny  # registering the same function again is harmless
