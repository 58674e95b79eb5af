"""Today's outcome of every zoo case: (architecture, strategy) -> (outcome, reason), under
``fallback="refuse"`` (EXPECTED) and, for ``zoo_cases.gather_cases()``, under
``fallback="gather"`` (EXPECTED_GATHER). Written by ``python tests/zoo/survey.py
--write-expected``; ``test_zoo.py`` turns it into pytest marks.
"""

# ----------------------------------------------------------------------------- expected
# (architecture, strategy) -> (outcome, reason), under fallback="refuse" (EXPECTED) and, for
# gather_cases(), under fallback="gather" (EXPECTED_GATHER). Written by
# `survey.py --write-expected`; a partial run keeps the cases it did not run.
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
    ('tv convnext', 'data'): (
        'exact',
        '',
    ),
    ('tv densenet', 'data'): (
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
    ('tv vgg_bn', 'data'): (
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
    ('smp UnetPlusPlus resnet18', 'data'): (
        'refused',
        "DataParallel: parameters ['encoder.layer3.0.conv1.weight', 'encoder.laye"
        "r3.0.bn1.weight', 'encoder.l ... er.layer4.1.bn2.bias'] got no gradient "
        'in this backward. Pass find_unused_parameters=True if the model does not'
        ' use every parameter in every step, or reduce_over={name: None} to leave'
        ' a parame...',
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
    ('tv swin', 'data'): (
        'exact',
        '',
    ),
    ('tv swin 40', 'data'): (
        'exact',
        '',
    ),
    ('tv maxvit', 'data'): (
        'exact',
        '',
    ),
    ('timm maxvit', 'data'): (
        'exact',
        '',
    ),
    ('timm coatnet', 'data'): (
        'exact',
        '',
    ),
    ('timm mobilevit_xxs', 'data'): (
        'exact',
        '',
    ),
    ('timm mobilevitv2_050', 'data'): (
        'exact',
        '',
    ),
    ('timm edgenext_xx_small', 'data'): (
        'exact',
        '',
    ),
    ('timm efficientformerv2_s0', 'data'): (
        'exact',
        '',
    ),
    ('timm vit_tiny gap', 'data'): (
        'exact',
        '',
    ),
    ('timm vit_tiny', 'data'): (
        'exact',
        '',
    ),
    ('timm deit_tiny distilled', 'data'): (
        'exact',
        '',
    ),
    ('timm cait_xxs24', 'data'): (
        'exact',
        '',
    ),
    ('timm coat_lite_tiny', 'data'): (
        'exact',
        '',
    ),
    ('tv vit', 'data'): (
        'exact',
        '',
    ),
    ('timm xcit_nano_12_p8', 'data'): (
        'exact',
        '',
    ),
    ('timm beit', 'data'): (
        'exact',
        '',
    ),
    ('timm vit_tiny reg4', 'data'): (
        'exact',
        '',
    ),
    ('timm pit_ti', 'data'): (
        'exact',
        '',
    ),
    ('timm tnt', 'data'): (
        'exact',
        '',
    ),
    ('timm botnet26t', 'data'): (
        'exact',
        '',
    ),
    ('timm convit_tiny', 'data'): (
        'exact',
        '',
    ),
    ('timm eva02_tiny', 'data'): (
        'exact',
        '',
    ),
    ('timm shvit_s1', 'data'): (
        'exact',
        '',
    ),
    ('timm levit_128s', 'data'): (
        'exact',
        '',
    ),
    ('timm volo_d1', 'data'): (
        'exact',
        '',
    ),
    ('timm mvitv2_tiny', 'data'): (
        'exact',
        '',
    ),
    ('timm mvitv2 cls', 'data'): (
        'exact',
        '',
    ),
    ('smp Segformer mit_b0', 'data'): (
        'exact',
        '',
    ),
    ('smp MAnet mobilenetv3', 'data'): (
        'exact',
        '',
    ),
    ('timm tresnet', 'data'): (
        'exact',
        '',
    ),
    ('timm eca_resnet33ts', 'data'): (
        'exact',
        '',
    ),
    ('monai FlexibleUNet', 'data'): (
        'refused',
        "DataParallel: parameters ['encoder._conv_head.weight', 'encoder._bn1.wei"
        "ght', 'encoder._bn1.bias', ' ... ', 'encoder._fc.bias'] got no gradient "
        'in this backward. Pass find_unused_parameters=True if the model does not'
        ' use every parameter in every step, or reduce_over={name: None} to leave'
        ' a parame...',
    ),
    ('monai BasicUNet pixelshuffle', 'data'): (
        'exact',
        '',
    ),
    ('timm cs3darknet_focus_s', 'data'): (
        'exact',
        '',
    ),
    ('tv efficientnet_v2', 'data'): (
        'exact',
        '',
    ),
    ('timm convnextv2_atto', 'data'): (
        'exact',
        '',
    ),
    ('timm ghostnet_050', 'data'): (
        'exact',
        '',
    ),
    ('timm poolformerv2', 'data'): (
        'exact',
        '',
    ),
    ('timm inception_next_atto', 'data'): (
        'exact',
        '',
    ),
    ('timm mobilenetv4_conv_small_050', 'data'): (
        'exact',
        '',
    ),
    ('smp Unet resnet10t scse', 'data'): (
        'refused',
        "DataParallel: parameters ['decoder.blocks.4.attention1.attention.cSE.1.w"
        "eight', 'decoder.blocks.4.at ... attention.sSE.0.bias'] got no gradient "
        'in this backward. Pass find_unused_parameters=True if the model does not'
        ' use every parameter in every step, or reduce_over={name: None} to leave'
        ' a parame...',
    ),
    ('smp UPerNet mobilenet_v2', 'data'): (
        'exact',
        '',
    ),
    ('monai UNet', 'data'): (
        'exact',
        '',
    ),
    ('monai SwinUNETR 2-D', 'data'): (
        'exact',
        '',
    ),
    ('tv swin3d', 'data'): (
        'exact',
        '',
    ),
    ('monai BasicUNet', 'data'): (
        'exact',
        '',
    ),
    ('monai AttentionUnet', 'data'): (
        'exact',
        '',
    ),
    ('monai SegResNet', 'data'): (
        'exact',
        '',
    ),
    ('monai SegResNetDS', 'data'): (
        'exact',
        '',
    ),
    ('monai DynUNet', 'data'): (
        'exact',
        '',
    ),
    ('monai UNETR', 'data'): (
        'refused',
        "DataParallel: parameters ['vit.blocks.0.norm_cross_attn.weight', 'vit.bl"
        "ocks.0.norm_cross_attn.bias' ... norm_cross_attn.bias'] got no gradient "
        'in this backward. Pass find_unused_parameters=True if the model does not'
        ' use every parameter in every step, or reduce_over={name: None} to leave'
        ' a parame...',
    ),
    ('monai ViTAutoEnc', 'data'): (
        'refused',
        "DataParallel: parameters ['blocks.0.norm_cross_attn.weight', 'blocks.0.n"
        "orm_cross_attn.bias', 'block ... norm_cross_attn.bias'] got no gradient "
        'in this backward. Pass find_unused_parameters=True if the model does not'
        ' use every parameter in every step, or reduce_over={name: None} to leave'
        ' a parame...',
    ),
    ('monai HighResNet', 'data'): (
        'exact',
        '',
    ),
    ('monai DenseNet', 'data'): (
        'exact',
        '',
    ),
    ('monai ResNet', 'data'): (
        'exact',
        '',
    ),
    ('monai SEResNet50', 'data'): (
        'exact',
        '',
    ),
    ('tv r3d_18', 'data'): (
        'exact',
        '',
    ),
    ('tv mc3_18', 'data'): (
        'exact',
        '',
    ),
    ('tv r2plus1d_18', 'data'): (
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
    ('tv convnext', 'rows'): (
        'exact',
        '',
    ),
    ('tv densenet', 'rows'): (
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
    ('tv vgg_bn', 'rows'): (
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
    ('smp UnetPlusPlus resnet18', 'rows'): (
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
    ('tv swin', 'rows'): (
        'exact',
        '',
    ),
    ('tv swin 40', 'rows'): (
        'exact',
        '',
    ),
    ('tv maxvit', 'rows'): (
        'exact',
        '',
    ),
    ('timm maxvit', 'rows'): (
        'exact',
        '',
    ),
    ('timm coatnet', 'rows'): (
        'exact',
        '',
    ),
    ('timm mobilevit_xxs', 'rows'): (
        'exact',
        '',
    ),
    ('timm mobilevitv2_050', 'rows'): (
        'exact',
        '',
    ),
    ('timm edgenext_xx_small', 'rows'): (
        'exact',
        '',
    ),
    ('timm efficientformerv2_s0', 'rows'): (
        'exact',
        '',
    ),
    ('timm vit_tiny gap', 'rows'): (
        'exact',
        '',
    ),
    ('timm vit_tiny', 'rows'): (
        'exact',
        '',
    ),
    ('timm deit_tiny distilled', 'rows'): (
        'exact',
        '',
    ),
    ('timm cait_xxs24', 'rows'): (
        'exact',
        '',
    ),
    ('timm coat_lite_tiny', 'rows'): (
        'exact',
        '',
    ),
    ('tv vit', 'rows'): (
        'exact',
        '',
    ),
    ('timm xcit_nano_12_p8', 'rows'): (
        'exact',
        '',
    ),
    ('timm beit', 'rows'): (
        'exact',
        '',
    ),
    ('timm vit_tiny reg4', 'rows'): (
        'exact',
        '',
    ),
    ('timm pit_ti', 'rows'): (
        'exact',
        '',
    ),
    ('timm tnt', 'rows'): (
        'exact',
        '',
    ),
    ('timm botnet26t', 'rows'): (
        'exact',
        '',
    ),
    ('timm convit_tiny', 'rows'): (
        'exact',
        '',
    ),
    ('timm eva02_tiny', 'rows'): (
        'exact',
        '',
    ),
    ('timm shvit_s1', 'rows'): (
        'exact',
        '',
    ),
    ('timm levit_128s', 'rows'): (
        'exact',
        '',
    ),
    ('timm volo_d1', 'rows'): (
        'exact',
        '',
    ),
    ('timm mvitv2_tiny', 'rows'): (
        'exact',
        '',
    ),
    ('timm mvitv2 cls', 'rows'): (
        'exact',
        '',
    ),
    ('smp Segformer mit_b0', 'rows'): (
        'exact',
        '',
    ),
    ('smp MAnet mobilenetv3', 'rows'): (
        'exact',
        '',
    ),
    ('timm tresnet', 'rows'): (
        'exact',
        '',
    ),
    ('timm eca_resnet33ts', 'rows'): (
        'exact',
        '',
    ),
    ('monai FlexibleUNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai BasicUNet pixelshuffle', 'rows'): (
        'exact',
        '',
    ),
    ('timm cs3darknet_focus_s', 'rows'): (
        'exact',
        '',
    ),
    ('tv efficientnet_v2', 'rows'): (
        'exact',
        '',
    ),
    ('timm convnextv2_atto', 'rows'): (
        'exact',
        '',
    ),
    ('timm ghostnet_050', 'rows'): (
        'exact',
        '',
    ),
    ('timm poolformerv2', 'rows'): (
        'exact',
        '',
    ),
    ('timm inception_next_atto', 'rows'): (
        'exact',
        '',
    ),
    ('timm mobilenetv4_conv_small_050', 'rows'): (
        'exact',
        '',
    ),
    ('smp Unet resnet10t scse', 'rows'): (
        'exact',
        '',
    ),
    ('smp UPerNet mobilenet_v2', 'rows'): (
        'exact',
        '',
    ),
    ('monai UNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai SwinUNETR 2-D', 'rows'): (
        'exact',
        '',
    ),
    ('tv swin3d', 'rows'): (
        'exact',
        '',
    ),
    ('monai BasicUNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai AttentionUnet', 'rows'): (
        'exact',
        '',
    ),
    ('monai SegResNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai SegResNetDS', 'rows'): (
        'exact',
        '',
    ),
    ('monai DynUNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai UNETR', 'rows'): (
        'exact',
        '',
    ),
    ('monai ViTAutoEnc', 'rows'): (
        'exact',
        '',
    ),
    ('monai HighResNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai DenseNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai ResNet', 'rows'): (
        'exact',
        '',
    ),
    ('monai SEResNet50', 'rows'): (
        'exact',
        '',
    ),
    ('tv r3d_18', 'rows'): (
        'exact',
        '',
    ),
    ('tv mc3_18', 'rows'): (
        'exact',
        '',
    ),
    ('tv r2plus1d_18', 'rows'): (
        'exact',
        '',
    ),
    ('tv convnext', 'cols'): (
        'exact',
        '',
    ),
    ('tv shufflenet_v2_x0_5', 'cols'): (
        'exact',
        '',
    ),
    ('tv vgg_bn', 'cols'): (
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
    ('smp PSPNet resnet18', 'cols'): (
        'exact',
        '',
    ),
    ('tv swin', 'cols'): (
        'exact',
        '',
    ),
    ('tv swin 40', 'cols'): (
        'exact',
        '',
    ),
    ('tv maxvit', 'cols'): (
        'exact',
        '',
    ),
    ('timm maxvit', 'cols'): (
        'exact',
        '',
    ),
    ('timm coatnet', 'cols'): (
        'exact',
        '',
    ),
    ('timm mobilevit_xxs', 'cols'): (
        'exact',
        '',
    ),
    ('timm mobilevitv2_050', 'cols'): (
        'exact',
        '',
    ),
    ('timm edgenext_xx_small', 'cols'): (
        'exact',
        '',
    ),
    ('timm efficientformerv2_s0', 'cols'): (
        'exact',
        '',
    ),
    ('timm vit_tiny gap', 'cols'): (
        'exact',
        '',
    ),
    ('timm vit_tiny', 'cols'): (
        'exact',
        '',
    ),
    ('timm deit_tiny distilled', 'cols'): (
        'exact',
        '',
    ),
    ('timm tnt', 'cols'): (
        'exact',
        '',
    ),
    ('timm botnet26t', 'cols'): (
        'exact',
        '',
    ),
    ('timm eva02_tiny', 'cols'): (
        'exact',
        '',
    ),
    ('timm volo_d1', 'cols'): (
        'exact',
        '',
    ),
    ('timm mvitv2_tiny', 'cols'): (
        'exact',
        '',
    ),
    ('timm mvitv2 cls', 'cols'): (
        'exact',
        '',
    ),
    ('smp Segformer mit_b0', 'cols'): (
        'exact',
        '',
    ),
    ('smp MAnet mobilenetv3', 'cols'): (
        'exact',
        '',
    ),
    ('timm tresnet', 'cols'): (
        'exact',
        '',
    ),
    ('monai BasicUNet pixelshuffle', 'cols'): (
        'exact',
        '',
    ),
    ('timm cs3darknet_focus_s', 'cols'): (
        'exact',
        '',
    ),
    ('timm convnextv2_atto', 'cols'): (
        'exact',
        '',
    ),
    ('timm ghostnet_050', 'cols'): (
        'exact',
        '',
    ),
    ('timm inception_next_atto', 'cols'): (
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
    ('tv convnext', 'channel'): (
        'exact',
        '',
    ),
    ('tv densenet', 'channel'): (
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
    ('tv vgg_bn', 'channel'): (
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
    ('smp UnetPlusPlus resnet18', 'channel'): (
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
    ('tv swin', 'channel'): (
        'exact',
        '',
    ),
    ('tv swin 40', 'channel'): (
        'exact',
        '',
    ),
    ('tv maxvit', 'channel'): (
        'exact',
        '',
    ),
    ('timm maxvit', 'channel'): (
        'exact',
        '',
    ),
    ('timm coatnet', 'channel'): (
        'exact',
        '',
    ),
    ('timm mobilevit_xxs', 'channel'): (
        'exact',
        '',
    ),
    ('timm mobilevitv2_050', 'channel'): (
        'exact',
        '',
    ),
    ('timm edgenext_xx_small', 'channel'): (
        'exact',
        '',
    ),
    ('timm efficientformerv2_s0', 'channel'): (
        'exact',
        '',
    ),
    ('timm vit_tiny gap', 'channel'): (
        'exact',
        '',
    ),
    ('timm vit_tiny', 'channel'): (
        'exact',
        '',
    ),
    ('timm deit_tiny distilled', 'channel'): (
        'exact',
        '',
    ),
    ('timm cait_xxs24', 'channel'): (
        'exact',
        '',
    ),
    ('timm coat_lite_tiny', 'channel'): (
        'exact',
        '',
    ),
    ('tv vit', 'channel'): (
        'exact',
        '',
    ),
    ('timm xcit_nano_12_p8', 'channel'): (
        'exact',
        '',
    ),
    ('timm beit', 'channel'): (
        'exact',
        '',
    ),
    ('timm vit_tiny reg4', 'channel'): (
        'exact',
        '',
    ),
    ('timm pit_ti', 'channel'): (
        'exact',
        '',
    ),
    ('timm tnt', 'channel'): (
        'exact',
        '',
    ),
    ('timm botnet26t', 'channel'): (
        'exact',
        '',
    ),
    ('timm convit_tiny', 'channel'): (
        'exact',
        '',
    ),
    ('timm eva02_tiny', 'channel'): (
        'exact',
        '',
    ),
    ('timm shvit_s1', 'channel'): (
        'exact',
        '',
    ),
    ('timm levit_128s', 'channel'): (
        'exact',
        '',
    ),
    ('timm volo_d1', 'channel'): (
        'exact',
        '',
    ),
    ('timm mvitv2_tiny', 'channel'): (
        'exact',
        '',
    ),
    ('timm mvitv2 cls', 'channel'): (
        'exact',
        '',
    ),
    ('smp Segformer mit_b0', 'channel'): (
        'exact',
        '',
    ),
    ('smp MAnet mobilenetv3', 'channel'): (
        'exact',
        '',
    ),
    ('timm tresnet', 'channel'): (
        'exact',
        '',
    ),
    ('timm eca_resnet33ts', 'channel'): (
        'exact',
        '',
    ),
    ('monai FlexibleUNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai BasicUNet pixelshuffle', 'channel'): (
        'exact',
        '',
    ),
    ('timm cs3darknet_focus_s', 'channel'): (
        'exact',
        '',
    ),
    ('tv efficientnet_v2', 'channel'): (
        'exact',
        '',
    ),
    ('timm convnextv2_atto', 'channel'): (
        'exact',
        '',
    ),
    ('timm ghostnet_050', 'channel'): (
        'exact',
        '',
    ),
    ('timm poolformerv2', 'channel'): (
        'exact',
        '',
    ),
    ('timm inception_next_atto', 'channel'): (
        'exact',
        '',
    ),
    ('timm mobilenetv4_conv_small_050', 'channel'): (
        'exact',
        '',
    ),
    ('smp Unet resnet10t scse', 'channel'): (
        'exact',
        '',
    ),
    ('smp UPerNet mobilenet_v2', 'channel'): (
        'exact',
        '',
    ),
    ('monai UNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai SwinUNETR 2-D', 'channel'): (
        'exact',
        '',
    ),
    ('tv swin3d', 'channel'): (
        'exact',
        '',
    ),
    ('monai BasicUNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai AttentionUnet', 'channel'): (
        'exact',
        '',
    ),
    ('monai SegResNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai SegResNetDS', 'channel'): (
        'exact',
        '',
    ),
    ('monai DynUNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai UNETR', 'channel'): (
        'exact',
        '',
    ),
    ('monai ViTAutoEnc', 'channel'): (
        'exact',
        '',
    ),
    ('monai HighResNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai DenseNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai ResNet', 'channel'): (
        'exact',
        '',
    ),
    ('monai SEResNet50', 'channel'): (
        'exact',
        '',
    ),
    ('tv r3d_18', 'channel'): (
        'exact',
        '',
    ),
    ('tv mc3_18', 'channel'): (
        'exact',
        '',
    ),
    ('tv r2plus1d_18', 'channel'): (
        'exact',
        '',
    ),
    ('timm resnet18 BatchNormAct2d', 'data x rows'): (
        'exact',
        '',
    ),
    ('smp FPN resnet18', 'data x rows'): (
        'exact',
        '',
    ),
    ('timm mobilevit_xxs', 'data x rows'): (
        'exact',
        '',
    ),
    ('monai UNet', 'depth'): (
        'exact',
        '',
    ),
    ('tv swin3d', 'depth'): (
        'exact',
        '',
    ),
    ('monai BasicUNet', 'depth'): (
        'exact',
        '',
    ),
    ('monai AttentionUnet', 'depth'): (
        'exact',
        '',
    ),
    ('monai SegResNet', 'depth'): (
        'exact',
        '',
    ),
    ('monai SegResNetDS', 'depth'): (
        'exact',
        '',
    ),
    ('monai DynUNet', 'depth'): (
        'exact',
        '',
    ),
    ('monai UNETR', 'depth'): (
        'exact',
        '',
    ),
    ('monai ViTAutoEnc', 'depth'): (
        'exact',
        '',
    ),
    ('monai HighResNet', 'depth'): (
        'exact',
        '',
    ),
    ('monai DenseNet', 'depth'): (
        'exact',
        '',
    ),
    ('monai ResNet', 'depth'): (
        'exact',
        '',
    ),
    ('monai SEResNet50', 'depth'): (
        'exact',
        '',
    ),
    ('tv r3d_18', 'depth'): (
        'exact',
        '',
    ),
    ('tv mc3_18', 'depth'): (
        'exact',
        '',
    ),
    ('tv r2plus1d_18', 'depth'): (
        'exact',
        '',
    ),
    ('monai UNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('tv swin3d', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai BasicUNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai AttentionUnet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai SegResNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai SegResNetDS', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai DynUNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai UNETR', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai ViTAutoEnc', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai HighResNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai DenseNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai ResNet', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai SEResNet50', 'depth x cols'): (
        'exact',
        '',
    ),
    ('tv r3d_18', 'depth x cols'): (
        'exact',
        '',
    ),
    ('tv mc3_18', 'depth x cols'): (
        'exact',
        '',
    ),
    ('tv r2plus1d_18', 'depth x cols'): (
        'exact',
        '',
    ),
    ('monai AttentionUnet', 'data x depth'): (
        'exact',
        '',
    ),
    ('monai SegResNetDS', 'data x depth'): (
        'exact',
        '',
    ),
    ('tv r2plus1d_18', 'data x depth'): (
        'exact',
        '',
    ),
}
# END EXPECTED
# BEGIN EXPECTED GATHER
EXPECTED_GATHER: dict[tuple[str, str], tuple[str, str]] = {
}
# END EXPECTED GATHER
