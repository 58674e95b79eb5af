"""Where a sample's pixels lie in the world: the size of a pixel, its offset and unit, per
spatial axis, at the pyramid level read.

    from parallelkit.data.physical import geometry
    g = geometry(SampleReader("slide.svs", level=1))
    g.scale, g.units, g.source        # (0.504, 0.504), ('micrometer', 'micrometer'), 'SVS MPP'

A prediction written without this carries the wrong scale: a level-1 prediction of an
OME-Zarr slide said level 0's pixel size (it then covered a quarter of the tissue in a viewer),
and one of an SVS slide said 1 with no unit. What each format says, and where it is read:

    OME-Zarr    ``multiscales[0]``: its ``axes`` (names, units) and the ``scale`` and
                ``translation`` of the level read (``datasets[level].coordinateTransformations``),
                composed with the multiscale's own ``coordinateTransformations``
    SVS         the baseline's microns per pixel (``MPP = 0.2520`` in the ImageDescription)
    NDPI, TIFF  ``XResolution``/``YResolution`` in pixels per centimetre (or inch)
    OME-TIFF    ``Pixels`` ``PhysicalSizeX/Y/Z`` and their units (micrometre by default)
    NIfTI       the voxel sizes (``pixdim``) and the header's spatial unit
    npy, zarr   nothing: a scale of 1 and no unit (``known`` is False)

A TIFF pyramid states the baseline's pixel size; a level's is the baseline's times the ratio
of the two levels' sizes along each axis (an SVS level is seldom exactly half its baseline).
Units are OME-NGFF's (UDUNITS-2 names): ``micrometer``, ``millimeter``, ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

UNITS = {
    "µm": "micrometer", "um": "micrometer", "micron": "micrometer", "micrometer": "micrometer",
    "mm": "millimeter", "millimeter": "millimeter", "cm": "centimeter", "centimeter": "centimeter",
    "m": "meter", "meter": "meter", "nm": "nanometer", "nanometer": "nanometer",
}  # fmt: skip
"""Units as spelt by the formats, to OME-NGFF's names."""
TO_MICROMETERS = {"micrometer": 1.0, "millimeter": 1e3, "centimeter": 1e4, "meter": 1e6,
                  "nanometer": 1e-3}  # fmt: skip


@dataclass(frozen=True)
class Geometry:
    """Per spatial axis (the sample's spatial order): ``names``, the pixel size ``scale`` and
    the first pixel's position ``translation`` at the level read, and ``units`` (None:
    unknown). ``source``: where they were read ('' where the file says nothing: ``known`` is
    then False). ``downsample``: the level's pixel size over level 0's, per axis."""

    names: tuple[str, ...]
    scale: tuple[float, ...]
    translation: tuple[float, ...]
    units: tuple[str | None, ...]
    source: str = ""
    downsample: tuple[float, ...] = ()

    @property
    def known(self) -> bool:
        return bool(self.source)

    def micrometers(self) -> tuple[float, ...] | None:
        """The pixel size in micrometres, where every axis has a unit that converts."""
        if not self.known or any(u not in TO_MICROMETERS for u in self.units):
            return None
        return tuple(s * TO_MICROMETERS[u] for s, u in zip(self.scale, self.units, strict=True))

    def said(self) -> str:
        """``0.504 x 0.504 micrometer per pixel (SVS MPP)``, or ``unknown``."""
        if not self.known:
            return "unknown"
        unit = self.units[0] if len(set(self.units)) == 1 else "/".join(map(str, self.units))
        return (" x ".join(f"{s:.4g}" for s in self.scale) + f" {unit or '(no unit)'} per "
                f"pixel ({self.source})")


def plain(ndim: int) -> Geometry:
    """Nothing known: ``z, y, x`` (the last ``ndim``), scale 1, no unit."""
    names = ("z", "y", "x")[3 - ndim:] if ndim <= 3 else tuple(f"s{i}" for i in range(ndim))
    return Geometry(names, (1.0,) * ndim, (0.0,) * ndim, (None,) * ndim, "", (1.0,) * ndim)


def geometry(reader: Any) -> Geometry:
    """The geometry of ``reader`` (a :class:`~parallelkit.data.readers.SampleReader`) at its
    level; :func:`plain` where the file says nothing, or says it in a way not understood."""
    from parallelkit.data.arrays import format_of

    ndim = len(reader.size)
    fmt = format_of(reader.path)
    try:
        found = {"zarr": _zarr, "tiff": _tiff, "nifti": _nifti}.get(fmt or "")
        return (found(reader) if found else None) or plain(ndim)
    except (OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError):
        return plain(ndim)


# ----------------------------------------------------------------------------- OME-Zarr
def _zarr(reader: Any) -> Geometry | None:
    import zarr

    node = zarr.open(reader.path, mode="r")
    if not isinstance(node, zarr.Group):
        return None
    attrs = dict(node.attrs)
    multiscale = (attrs.get("ome", {}).get("multiscales") or attrs.get("multiscales"))[0]
    ndim, spatial = len(reader.shape), reader.layout.spatial
    base = plain(len(spatial))
    names, units = list(base.names), [None] * len(spatial)
    given = multiscale.get("axes")
    if isinstance(given, list) and len(given) == ndim:
        for j, i in enumerate(spatial):
            a = given[i] if isinstance(given[i], dict) else {"name": given[i]}
            names[j] = str(a.get("name", names[j]))
            units[j] = UNITS.get(str(a.get("unit", "")).lower(), a.get("unit"))
    datasets = multiscale["datasets"]

    def transforms(entry: dict) -> tuple[list[float], list[float]]:
        scale, shift = [1.0] * ndim, [0.0] * ndim
        for t in entry.get("coordinateTransformations", []) or []:
            if t.get("type") == "scale" and len(t.get("scale", [])) == ndim:
                scale = [float(v) for v in t["scale"]]
            if t.get("type") == "translation" and len(t.get("translation", [])) == ndim:
                shift = [float(v) for v in t["translation"]]
        return scale, shift

    scale, shift = transforms(datasets[reader.level])
    zero, _ = transforms(datasets[0])
    outer_scale, outer_shift = transforms(multiscale)  # applied after the level's own
    said = any("coordinateTransformations" in d for d in (datasets[reader.level], multiscale))
    return Geometry(
        tuple(names),
        tuple(scale[i] * outer_scale[i] for i in spatial),
        tuple(shift[i] * outer_scale[i] + outer_shift[i] for i in spatial),
        tuple(units),
        "OME-Zarr" if said or any(units) else "",
        tuple(scale[i] / zero[i] if zero[i] else 1.0 for i in spatial),
    )


# -------------------------------------------------------------------------------- TIFF
def _tiff(reader: Any) -> Geometry | None:
    import tifffile

    with tifffile.TiffFile(reader.path) as tif:
        series = tif.series[0]
        axes0, shape0 = series.levels[0].axes, series.levels[0].shape
        axes, shape = series.levels[reader.level].axes, series.levels[reader.level].shape
        letters = [axes[i] for i in reader.layout.spatial]
        found = _ome_tiff(tif) if tif.is_ome else None
        if found is None and tif.is_svs:
            mpp = re.search(r"MPP\s*=\s*([0-9.eE+-]+)", tif.pages[0].description or "")
            if mpp:
                found = ({"Y": float(mpp.group(1)), "X": float(mpp.group(1))}, "micrometer",
                         "SVS MPP")  # fmt: skip
        if found is None:
            found = _resolution(tif.pages[0], "NDPI" if tif.is_ndpi else "TIFF")
    if found is None or len(letters) != len(reader.size):
        return None
    sizes, unit, source = found
    ratio = {a: shape0[axes0.index(a)] / shape[axes.index(a)] for a in letters}
    base = plain(len(letters))
    return Geometry(
        tuple(a.lower() for a in letters),
        tuple(sizes.get(a, 1.0) * ratio[a] for a in letters),
        (0.0,) * len(letters),
        tuple(unit if a in sizes else None for a in letters),
        source,
        tuple(ratio[a] for a in letters) or base.downsample,
    )


def _resolution(page: Any, what: str) -> tuple[dict, str, str] | None:
    """Pixel size from ``X/YResolution`` (pixels per ``ResolutionUnit``: 2 inch, 3 cm)."""
    tags = page.tags
    unit = int(tags["ResolutionUnit"].value) if "ResolutionUnit" in tags else 2
    if unit not in (2, 3) or "XResolution" not in tags:
        return None
    per = 25400.0 if unit == 2 else 10000.0  # micrometres per inch or centimetre
    sizes = {}
    for axis, tag in (("X", "XResolution"), ("Y", "YResolution")):
        if tag in tags:
            num, den = tags[tag].value
            if num and den and num / den > 1:  # 1 pixel per inch: a writer's placeholder
                sizes[axis] = per / (num / den)
    return (sizes, "micrometer", f"{what} resolution") if sizes else None


def _ome_tiff(tif: Any) -> tuple[dict, str, str] | None:
    """``PhysicalSizeX/Y/Z`` of the first image's ``Pixels`` in the OME-XML."""
    xml = tif.ome_metadata or ""
    pixels = re.search(r"<(?:\w+:)?Pixels\b([^>]*)>", xml)
    if not pixels:
        return None
    attrs = dict(re.findall(r'(\w+)="([^"]*)"', pixels.group(1)))
    sizes, units = {}, set()
    for axis in "XYZ":
        if f"PhysicalSize{axis}" in attrs:
            sizes[axis] = float(attrs[f"PhysicalSize{axis}"])
            units.add(UNITS.get(attrs.get(f"PhysicalSize{axis}Unit", "µm"), "micrometer"))
    if not sizes or len(units) != 1:
        return None
    unit = units.pop()
    return sizes, unit, "OME-TIFF"


# ------------------------------------------------------------------------------- NIfTI
def _nifti(reader: Any) -> Geometry | None:
    import nibabel as nib

    header = nib.load(str(reader.path)).header
    zooms = [float(z) for z in header.get_zooms()[:3]]
    unit = UNITS.get(header.get_xyzt_units()[0])
    spatial = reader.layout.spatial
    if len(zooms) < len(spatial) or max(spatial) >= 3:
        return None
    base = plain(len(spatial))
    return Geometry(base.names, tuple(zooms[i] for i in spatial), (0.0,) * len(spatial),
                    (unit,) * len(spatial), "NIfTI pixdim", base.downsample)  # fmt: skip


def same_pixel_size(a: Geometry, b: Geometry, tolerance: float = 0.1) -> bool | None:
    """Whether ``a`` and ``b`` have one pixel size (within ``tolerance``, relative); None
    where either is unknown or they do not convert."""
    ma, mb = a.micrometers(), b.micrometers()
    if ma is None or mb is None or len(ma) != len(mb):
        return None
    return all(abs(x - y) <= tolerance * max(x, y) for x, y in zip(ma, mb, strict=True))


__all__ = ["Geometry", "geometry", "plain", "same_pixel_size"]
