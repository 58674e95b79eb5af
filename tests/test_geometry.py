"""Pure geometry, no processes: splits, window output sizes and input ranges against torch
and against brute force."""

import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F

from parallelkit.geometry import (
    BlockLayout,
    Window,
    blocks,
    conv_padding,
    in_whole_groups,
    received_rows,
    tensor_split_sizes,
    transposed_halo,
    transposed_needs,
)


def test_tensor_split_sizes_match_torch():
    for total in range(0, 12):
        for parts in range(1, 6):
            expected = [len(c) for c in torch.tensor_split(torch.arange(total), parts)]
            assert tensor_split_sizes(total, parts) == expected


def test_blocks_tile_the_rows():
    assert blocks(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert blocks(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_a_block_layout_cuts_what_tensor_split_cuts():
    x = torch.arange(7 * 11 * 9).reshape(7, 11, 9)
    for counts in [(2, 1, 1), (1, 2, 2), (2, 2, 1), (1, 3, 4)]:
        want = [c for a in torch.tensor_split(x, counts[0], 0)
                for b in torch.tensor_split(a, counts[1], 1)
                for c in torch.tensor_split(b, counts[2], 2)]  # fmt: skip
        for got, coords in zip(want, itertools.product(*map(range, counts)), strict=True):
            layout = BlockLayout(counts, coords)
            assert torch.equal(x[layout.slices(7, 11, 9)], got)
            assert layout.shape(7, 11, 9) == tuple(got.shape)
            assert pickle.loads(pickle.dumps(layout)) == layout  # into DataLoader workers
    assert not BlockLayout((1, 1), (0, 0)).split and BlockLayout([2, 1], [1, 0]).split
    with pytest.raises(ValueError, match=r"splits samples of 2 spatial dimensions, not \(4,\)"):
        BlockLayout((2, 1), (0, 0)).slices(4)
    with pytest.raises(ValueError, match=r"coords \(2, 0\) do not name a block"):
        BlockLayout((2, 1), (2, 0))


def test_a_block_layout_of_a_grid_takes_the_axes_a_sample_has():
    grid, at = (2, 3, 4), (1, 2, 3)  # (depth, rows, cols), (z, row, col)
    assert BlockLayout.of_grid(grid, at, 3) == BlockLayout(grid, at)
    assert BlockLayout.of_grid((1, 3, 4), at, 2) == BlockLayout((3, 4), (2, 3))  # H, W
    assert BlockLayout.of_grid((1, 3, 1), at, 1) == BlockLayout((3,), (2,))  # L by rows
    assert BlockLayout.of_grid((6, 1, 1), (5, 0, 0), 2, first=True) == BlockLayout((6, 1), (5, 0))
    with pytest.raises(ValueError, match=r"images .* have no depth"):
        BlockLayout.of_grid(grid, at, 2)
    with pytest.raises(ValueError, match=r"signals .* are split by rows only"):
        BlockLayout.of_grid((1, 3, 4), at, 1)


WINDOWS = [
    Window(k, s, lo, hi, d)
    for k, s, d in itertools.product((1, 2, 3, 4, 7), (1, 2, 3), (1, 2))
    for lo, hi in ((0, 0), (1, 1), (3, 3), (1, 2))
]


@pytest.mark.parametrize("n", [1, 5, 12])
def test_window_out_size_and_needs_by_brute_force(n):
    """Convolve an index image: output row o must read exactly the rows needs() says."""
    for win in WINDOWS:
        m = win.out_size(n)
        if m < 1:
            continue
        x = torch.arange(n, dtype=torch.float64).view(1, 1, n) + 1  # row i holds i + 1
        padded = F.pad(x, (win.pad_lo, win.pad_hi))
        taps = F.unfold(
            padded.unsqueeze(-1), (win.kernel, 1), (win.dilation, 1), 0, (win.stride, 1)
        )
        assert taps.shape[-1] == m, win
        for o0 in range(m):
            for o1 in range(o0 + 1, m + 1):
                lo, hi = win.needs(o0, o1)
                rows = taps[0, :, o0:o1].flatten()  # values are row + 1, zeros are padding
                read = {int(v) - 1 for v in rows if v != 0}
                assert read <= set(range(lo, hi)), (win, o0, o1)
                first, last = o0 * win.stride - win.pad_lo, (o1 - 1) * win.stride - win.pad_lo
                assert (lo, hi) == (first, last + win.dilation * (win.kernel - 1) + 1)


@pytest.mark.parametrize("n", [1, 4, 5, 12])
def test_ceil_mode_out_size_matches_torch_pooling(n):
    """``Window(..., ceil=True)`` gives max_pool1d's ceil_mode output length (torch allows
    padding up to half the kernel)."""
    for k, s, d in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2)):
        for p in range(k // 2 + 1):
            win = Window(k, s, p, p, d, ceil=True)
            x = torch.zeros(1, 1, n)
            try:
                want = F.max_pool1d(x, k, s, p, d, ceil_mode=True).shape[-1]
            except RuntimeError:  # output too small: the window rejects it too
                assert win.out_size(n) < 1, (win, n)
                continue
            assert win.out_size(n) == want, (win, n)


def test_same_padding_puts_the_extra_row_at_the_end():
    assert conv_padding("same", (4, 3), (1, 2)) == [(1, 2), (2, 2)]
    assert conv_padding("valid", (4, 3), (1, 1)) == [(0, 0), (0, 0)]
    assert conv_padding((2, 1), (3, 3), (1, 1)) == [(2, 2), (1, 1)]
    with pytest.raises(ValueError, match="padding must be"):
        conv_padding("full", (3, 3), (1, 1))


@pytest.mark.parametrize(
    ("k", "s", "p", "d"), itertools.product((1, 2, 4, 5), (1, 2, 3), (0, 1, 2), (1, 2))
)
def test_transposed_needs_by_brute_force(k, s, p, d):
    """Every input row whose one-hot input changes an output block is in its range."""
    n = 5
    m = (n - 1) * s - 2 * p + d * (k - 1) + 1
    if m < 1:
        return
    w = torch.ones(1, 1, k, 1, dtype=torch.float64)
    reach = []
    for i in range(n):
        x = torch.zeros(1, 1, n, 1, dtype=torch.float64)
        x[0, 0, i] = 1
        reach.append(F.conv_transpose2d(x, w, None, (s, 1), (p, 0), dilation=(d, 1))[0, 0, :, 0])
    for o0 in range(m):
        for o1 in range(o0 + 1, m + 1):
            used = [i for i in range(n) if reach[i][o0:o1].any()]
            lo, hi = transposed_needs(o0, o1, n, k, s, p, d)
            assert set(used) <= set(range(lo, hi)), (o0, o1, used, lo, hi)
            if used:  # a range: with dilation it may hold a few rows that no tap reaches
                assert min(used) - d <= lo and hi <= max(used) + 1 + d, (o0, o1, used, lo, hi)


@pytest.mark.parametrize(
    ("k", "s", "p", "op", "parts"),
    [c for c in itertools.product((2, 3, 4), (1, 2), (0, 1), (0, 1), (2, 3)) if c[3] < c[1]],
)
def test_transposed_halo_covers_every_rank_by_brute_force(k, s, p, op, parts):
    """The rows before and after its block that some rank's output block receives from (by
    one-hot scatters) are within (lo, hi), and the widest rank needs all of them."""
    n = 9
    m = (n - 1) * s - 2 * p + k + op
    w = torch.ones(1, 1, k, 1, dtype=torch.float64)
    reach = []
    for i in range(n):
        x = torch.zeros(1, 1, n, 1, dtype=torch.float64)
        x[0, 0, i] = 1
        y = F.conv_transpose2d(x, w, None, (s, 1), (p, 0), output_padding=(op, 0))
        reach.append(y[0, 0, :, 0])
    halo = transposed_halo(n, m, parts, k, s, p, 1)
    assert halo is not None
    before = after = 0
    for (a0, a1), (o0, o1) in zip(blocks(n, parts), blocks(m, parts), strict=True):
        used = [i for i in range(n) if reach[i][o0:o1].any()]
        if used:
            before, after = max(before, a0 - min(used)), max(after, max(used) + 1 - a1)
    assert halo == (max(before, 0), max(after, 0)), (halo, before, after)
    assert transposed_halo(3, 6, 4, 2, 2, 0, 1) is None  # a rank without rows


def test_received_rows():
    """Three ranks, 10 rows (4 3 3), a 3x3 window with padding 1: one row from each side."""
    sizes, out_sizes, want = Window(3, 1, 1, 1).plan(10, 3)
    assert (sizes, out_sizes) == ([4, 3, 3], [4, 3, 3])
    assert want == [(-1, 5), (3, 8), (6, 11)]
    assert received_rows(sizes, want) == [1, 2, 1]
    # Blocks thinner than the halo: a 7-tap window reads from two ranks away.
    sizes, _, want = Window(7, 1, 3, 3).plan(4, 4)
    assert received_rows(sizes, want) == [3, 3, 3, 3]


class _TwoRanks:
    """Rank 0 of 2: enough for a SpatialGrid that splits one dimension over every rank (no
    split() call, nothing sent)."""

    rank, size, timeout, device = 0, 2, 1.0, "cpu"


def test_edge_path_only_for_convolutions_of_stride_1_along_every_dimension():
    """The edge path convolves with stride 1 everywhere: a stride along a dimension that is
    not split (a video stem's (1, 2, 2) split over depth) must take the halo fetch."""
    from parallelkit.spatial import edges as spatial_edges
    from parallelkit.spatial.conv import conv_windows
    from parallelkit.spatial.grid import SpatialGrid

    depth = SpatialGrid(_TwoRanks(), (2, 1, 1))
    size = (8, 16, 16)
    same = conv_windows((3, 7, 7), 1, (1, 3, 3), 1)
    assert spatial_edges.plan(depth, same, size) is not None
    for stride in ((1, 2, 2), (1, 1, 2), (2, 1, 1)):
        strided = conv_windows((3, 7, 7), stride, (1, 3, 3), 1)
        assert spatial_edges.plan(depth, strided, size) is None


CONV3D_CASES = [
    # (C_in, D, H, W, kernel, stride, padding, dilation): blocks and edge slabs under torch's
    # slow_conv3d line, even and odd output rows, strides, dilations, no padding
    (8, 8, 16, 12, 3, 1, 1, 1),
    (4, 7, 9, 5, 3, 1, 1, 1),
    (3, 9, 10, 6, (3, 1, 3), (2, 1, 1), (1, 0, 1), 1),
    (6, 11, 8, 8, 3, 1, 2, 2),
    (5, 3, 12, 7, 3, 1, (0, 1, 1), 1),  # an edge slab: one output plane along D
    (2, 6, 6, 6, 2, 2, 0, 1),
]


@pytest.mark.parametrize("case", CONV3D_CASES)
def test_convolve_keeps_blocks_off_the_slow_kernel_with_the_same_sums(case):
    """``spatial_edges.convolve`` (a block convolved as a batch of two, where torch would take
    slow_conv3d): output, input and weight gradients against float64 F.conv3d. The control:
    every case does take that path."""
    from parallelkit.spatial import edges as spatial_edges

    c, d, h, w, k, s, p, dil = case
    torch.manual_seed(0)
    x = torch.randn(1, c, d, h, w, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, c, *((k,) * 3 if isinstance(k, int) else k), dtype=torch.float64,
                         requires_grad=True)  # fmt: skip
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    ref = F.conv3d(x, weight, bias, s, p, dil)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, weight, bias), grad)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, weight, bias))
    assert spatial_edges._on_slow_conv3d(x32, w32, 1)
    y = spatial_edges.convolve(x32, w32, b32, s, p, dil, 1)
    grads = torch.autograd.grad(y, (x32, w32, b32), grad.float())
    assert y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_in_whole_groups_by_brute_force(parts):
    """Regrouping keeps the layout exactly where every rank's rows are whole groups and their
    count is that rank's block of the groups; checked against the rows themselves."""
    for groups in range(1, 13):
        for size in range(1, 6):
            rows = torch.arange(groups * size).tensor_split(parts)
            grouped = torch.arange(groups * size).view(groups, size).tensor_split(parts)
            same = all(torch.equal(r, g.reshape(-1)) for r, g in zip(rows, grouped, strict=True))
            assert in_whole_groups(groups, size, parts) == same, (groups, size, parts)
    assert not in_whole_groups(3, 2, 2)  # blocks of 3 and 3 rows: a group of 2 cut in half
    assert in_whole_groups(4, 2, 2)
