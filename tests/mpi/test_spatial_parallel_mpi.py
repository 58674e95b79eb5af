"""Spatial layers under mpiexec: a sample of the gloo tier's matrix, rows split and (on 4
ranks) a 2x2 grid."""

from __future__ import annotations

from spatial_cases import conv_configs, conv_transpose_configs, failures, other_failures


def _grid(comm):
    return (2, 2) if comm.size == 4 else None


def _check(ran, bad, at_least):
    assert ran >= at_least and not bad, "\n".join(bad[:20])


def test_conv(comm):
    _check(*failures(comm, "conv", list(conv_configs())[::4], (11, 7), _grid(comm)), 50)


def test_conv_transpose(comm):
    _check(*failures(comm, "convT", list(conv_transpose_configs())[::6], (5, 6), _grid(comm)), 20)


def test_pooling_upsampling(comm):
    _check(*other_failures(comm, (9, 10), _grid(comm)), 13)
