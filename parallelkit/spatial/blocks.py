"""How a layer handles blocks of split samples: what the spatial guard and ``pk.parallelize``
read from the layer itself.

Every layer that takes this rank's (N, C, *spatial) block of split samples says so with one
class attribute, ``takes_blocks``:

- ``"split"``: returns its block of the output, in the same layout (spatial convolutions,
  pooling, upsampling); ``out_size(size)`` gives the whole output's spatial size;
- ``"ends"``: returns a whole tensor, the same on every rank (global average pooling, a
  ``keep_dense`` module run on the gathered samples): the spatial region ends there;
- ``"norm"``: normalizes over every pixel of the samples on its communicators (SyncBatchNorm,
  a synchronized BatchNorm subclass). Given a whole tensor, the guard has it normalize over
  the data group instead, through ``communicators()`` and ``use_communicators()``.

The guard runs such a layer as it is (nothing inside it is checked) and refuses it a block
whose spatial dimensions are not (N, C, *spatial), except a pointwise convolution's block with
them anywhere after the channels, a norm's with none in the channels (LeViT's
``BatchNorm1d`` over tokens folded into the batch, (N * L, C)), and, for a layer whose
``windows_in_batch`` says so, a block with all of them folded into the batch (TNT's patches,
SAM2's windows pooled inside): its window then covers each patch's own pixels, as dense. The
output keeps that form.

A spatial layer (:class:`SpatialLayer`) also names the torch classes it stands for
(``stands_for``, by default its ``dense`` class) and builds itself from one (``from_dense``,
where ``covers`` says it does what that module does). Each registers when its class is
defined (importing :mod:`parallelkit.nn` defines them all), so ``pk.parallelize``'s swap
table is read from the layers, and adding a spatial layer touches its own file alone.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from torch import nn

TakesBlocks = Literal["split", "ends", "norm"]

_STANDS_FOR: dict[type, type[SpatialLayer]] = {}  # the torch class -> its spatial layer


class SpatialLayer:
    """Mixed into each spatial layer: declares ``takes_blocks`` and registers the layer for
    the torch classes it stands for."""

    takes_blocks: ClassVar[TakesBlocks] = "split"
    windows_in_batch: ClassVar[bool] = False
    """Given a block whose spatial dimensions are all folded into its batch, it runs as dense
    (a convolution or pooling over each patch's own pixels, which no other rank holds)."""
    dense: Any  # the torch class it stands for (an instance attribute where it varies)
    stands_for: ClassVar[tuple[type, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        dense = own.get("dense")
        for torch_class in own.get("stands_for", (dense,) if isinstance(dense, type) else ()):
            _STANDS_FOR[torch_class] = cls

    @classmethod
    def covers(cls, module: nn.Module) -> bool:
        """Whether this layer does exactly what ``module`` does (else it stays dense, and its
        functional calls meet the guard's rules). By default, unless it pads other than by
        zeros: a convolution's ``padding_mode="reflect"`` runs its forward's ``F.pad`` and
        ``F.conv2d``, whose rules fetch the mirrored rows."""
        return getattr(module, "padding_mode", "zeros") == "zeros"


def takes_blocks(module: nn.Module) -> TakesBlocks | None:
    """How ``module`` handles blocks, or None: a module the guard follows call by call."""
    return getattr(type(module), "takes_blocks", None)


def spatial_layer(module: nn.Module) -> type[SpatialLayer] | None:
    """The spatial layer that stands for ``module`` exactly, if one does."""
    layer = _STANDS_FOR.get(type(module))
    return layer if layer is not None and layer.covers(module) else None
