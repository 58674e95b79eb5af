"""A wider sweep of networks, kept out of the zoo tier: networks of the same libraries that the
tier does not hold, each tried under the spatial strategy a user would pick first (rows for
images, depth for volumes), to find what still fails: ``survey.py --arch NAME --strategy rows``.
``zoo_cases.ARCHS`` holds them too, so the survey finds them by name.
"""

from __future__ import annotations

from torch import nn
from zoo_networks import Arch, _monai, _timm, _tv


class _FirstOutput(nn.Module):
    """A network's first output only (MONAI's MAE returns its int mask of the kept tokens
    beside its reconstruction)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.net(x)[0]


SWEEP_ARCHS: dict[str, Arch] = {
    **{f"timm {n}": Arch("timm", _timm(n), what="sweep") for n in (
        "resnest14d", "res2net50_14w_8s", "dla34", "hrnet_w18_small", "nf_resnet26",
        "repvgg_a0", "ese_vovnet19b_dw", "cspresnet50", "mixnet_s", "fbnetv3_b", "lcnet_050",
        "gernet_s", "resnetv2_50", "gcresnet33ts", "skresnet18", "dpn48b", "xception41",
    )},
    # Their BatchNorms normalize 2 x 2 maps (1^3 for the volumes) of 2 samples at these sizes:
    # the dense model alone, its weights moved by 1e-13, moves its second step's gradients by
    # 5e-4 to 1.1 of their scale (measured), so only the first step can be compared.
    **{f"timm {n}": Arch("timm", _timm(n), what="sweep", steps=1)
       for n in ("rexnet_100", "selecsls42b")},
    **{f"tv {n}": Arch("torchvision", _tv(n, num_classes=5), what="sweep") for n in (
        "resnext50_32x4d", "mobilenet_v3_large", "efficientnet_v2_s", "alexnet", "vgg11",
        "regnet_y_800mf",
    )},
    "monai EfficientNetBN 3-D": Arch(
        "monai", _monai("EfficientNetBN", "efficientnet-b0", spatial_dims=3, in_channels=1,
                        num_classes=3, pretrained=False), (1, 32, 32, 32), what="sweep", steps=1,
    ),
    "monai DenseNet121 3-D": Arch(
        "monai", _monai("DenseNet121", spatial_dims=3, in_channels=1, out_channels=3),
        (1, 32, 32, 32), what="sweep", steps=1,
    ),
    "monai SegResNetVAE": Arch(
        "monai", _monai("SegResNetVAE", input_image_size=(32, 32, 32), spatial_dims=3,
                        init_filters=8, in_channels=1, out_channels=2), (1, 32, 32, 32),
        what="sweep",
    ),
    # Window attention the tier holds only small, at sizes of whole windows per block.
    "tv swin_v2_t": Arch("torchvision", _tv("swin_v2_t", num_classes=5), (3, 512, 256),
                         what="sweep"),
    "timm swin_tiny": Arch(
        "timm", _timm("swin_tiny_patch4_window7_224", img_size=(448, 224)), (3, 448, 224),
        what="sweep",
    ),
    **{f"timm {n}": Arch("timm", _timm(n, img_size=(448, 224)), (3, 448, 224), what="sweep")
       for n in ("twins_svt_small", "gcvit_xxtiny")},
    **{f"timm {n}": Arch("timm", _timm(n), (3, 448, 224), what="sweep")
       for n in ("davit_tiny", "focalnet_tiny_srf")},
    "monai SwinUNETR v2 2-D": Arch(
        "monai", _monai("SwinUNETR", in_channels=1, out_channels=2, feature_size=12,
                        window_size=2, spatial_dims=2, use_v2=True), (1, 64, 64), what="sweep",
    ),
    "monai LocalNet": Arch(
        "monai", _monai("LocalNet", spatial_dims=3, in_channels=1, num_channel_initial=4,
                        extract_levels=(0, 1, 2), out_channels=3), (1, 16, 16, 16), what="sweep",
    ),
    # Blocked attention with a halo and relative logits; keys pooled over flattened tokens;
    # position lambdas by a Conv3d over (N, 1, H, W, V).
    "timm halonet26t": Arch("timm", _timm("halonet26t"), (3, 256, 256), what="sweep"),
    "timm nextvit_small": Arch("timm", _timm("nextvit_small"), what="sweep"),
    "timm lambda_resnet26t": Arch("timm", _timm("lambda_resnet26t"), (3, 128, 128),
                                  what="sweep"),
    # A ViT classifier: einsum attention and hidden states with a class token before the
    # tokens, returned; a VAE whose latent is sampled (mu + sigma * randn_like) on blocks.
    "monai ViT classification": Arch(
        "monai", _monai("ViT", in_channels=1, img_size=32, patch_size=8, hidden_size=32,
                        mlp_dim=64, num_layers=2, num_heads=2, classification=True,
                        num_classes=3, spatial_dims=3), (1, 32, 32, 32), what="sweep",
    ),
    "monai AutoencoderKL": Arch(
        "monai", _monai("AutoencoderKL", spatial_dims=2, in_channels=3, out_channels=3,
                        channels=(8, 16), latent_channels=4, num_res_blocks=1,
                        norm_num_groups=4, attention_levels=(False, True)), what="sweep",
    ),
    # A masked autoencoder: a random choice of the tokens kept by an index tensor (whole),
    # encoded, and put back among mask tokens; its reconstruction of tokens, whole.
    "monai MaskedAutoEncoderViT": Arch(
        "monai", lambda: _FirstOutput(_monai(
            "MaskedAutoEncoderViT", 1, 16, 4, hidden_size=36, mlp_dim=64, num_layers=1,
            num_heads=2, decoder_hidden_size=12, decoder_mlp_dim=32, decoder_num_layers=1,
            decoder_num_heads=2, spatial_dims=3)()), (1, 16, 16, 16), what="sweep",
    ),
    # SAM2's Hiera: attention in windows folded into the batch, queries max-pooled inside
    # each window at the stage changes.
    "timm hieradet_small": Arch("timm", _timm("hieradet_small"), what="sweep"),
    # SAM's image encoder, small: window attention, then global attention whose mask is
    # made from the query block (decomposed relative positions). AIMv2: RMSNorm on tokens.
    "timm samvit small": Arch("timm", _timm(
        "samvit_base_patch16", img_size=64, patch_size=8, embed_dim=64, depth=2, num_heads=2,
        window_size=4, global_attn_indexes=(1,)), what="sweep"),
    "timm aimv2 small": Arch("timm", _timm(
        "aimv2_large_patch14_224", img_size=64, patch_size=8, embed_dim=64, depth=2,
        num_heads=2), what="sweep"),
}  # fmt: skip
