"""Global token mixing on split samples (parallelkit/spatial/rules/tokens.py): attention,
sums over tokens and linear maps over the token axis, exact on 2-4 ranks against the dense
network (outputs, the input's gradient, every parameter's gradient; float64, uneven blocks),
each with a negative control that shows the comparison can fail: the same network whose
collectives bring only this rank's own tokens must not match.

The token index geometry, the head all-to-all and the relayout (blocks of one tensor moved
between two layouts) are checked on their own: every rank's tokens are its block of the whole
index map, the all-to-all pair passes the dot-product test (each the other's adjoint), and so
does the relayout with autograd's backward as its adjoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokens_cases import (
    all_to_all_adjoint,
    dropout_refused,
    orders_match_blocks,
    pool_indices_parity,
    relayout_adjoint,
    token_parity,
    winners_parity,
)
from torch import nn

from parallelkit.comm.local import LocalCommunicator
from parallelkit.spatial.guard import SpatialGuard

from cases import assert_results, assert_triples, mismatches

KINDS = [
    "sdpa",  # the head all-to-all where the heads divide among the ranks, else the ring
    "sdpa bias",  # a whole relative-position bias (h, L, L) as a float mask: the ring
    "sdpa causal",  # the ring, with query blocks whose keys in a block are all masked
    "decomposed relative positions",  # SAM: a mask made from the query block, rows its own
    "explicit",  # q @ k^T * scale + bias, softmax, @ v; v^T @ attn^T (channels first)
    "map softmax",  # one softmax over the whole flattened (h, L, L) map: all-reduced
    "talking heads",  # 1x1 convolutions over the heads of the (h, L, L) map: local
    "tensor unfold",  # Tensor.unfold along H and W: windows with a halo from the neighbours
    "F.unfold",  # im2col: a convolution's halo, the positions a token dimension
    "F.fold",  # col2im: a one-hot transposed convolution, the halo rows' sums sent back
    "einsum",
    "linear attention",  # k^T v over tokens: an all-reduce of a (d x d) matrix
    "relu linear attention",  # EfficientViT: v padded by a 1 along its features, then k^T v
    "pooling queries",  # whole learned queries attending to every token
    "token mlp",  # MLP-Mixer: Linear over the token axis
    "flatten linear",  # a classifier head over flattened (C * H * W) features
    "mha",  # nn.MultiheadAttention with its weights and a boolean mask: written out
    "mha sdpa",  # the same without weights: scaled_dot_product_attention
    "token pool",  # mean, sum, amax, logsumexp, var, std, max with indices over x.flatten(2)
    "gc context",  # GCNet: a softmax over the tokens (all-reduced logsumexp), a sum over them
    "xca",  # XCiT: F.normalize over the tokens, q^T k, softmax, attn @ v
    "token batchnorm",  # LeViT: BatchNorm1d over (N * L, C), the batch folded with the tokens
    "class token",  # DeiT, CaiT, CoaT: two tokens before the patch tokens, the first rank's
    "class token output",  # a ViT's hidden states returned: whole, the class tokens first
    "token selection",  # MAE: x[arange(N)[:, None], ids], whole tokens from their ranks
]
IMAGE = (3, 5, 7)  # (C, H, W): uneven blocks on 2, 3 and 4 ranks


@pytest.mark.parametrize("kind", KINDS)
def test_token_mixing_matches_dense_on_two_ranks(ranks, kind):
    for triples in ranks(2).run(token_parity, kind, dict(rows=2), IMAGE, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize("kind", KINDS)
def test_token_mixing_matches_dense_on_a_two_by_two_grid(ranks, kind):
    """Rows and columns split: the ranks' tokens interleave, and gathered keys are put back
    in the whole order."""
    for triples in ranks(4).run(token_parity, kind, dict(rows=2, cols=2), IMAGE, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize(
    ("size", "grid", "shape", "heads"),
    [
        (4, dict(rows=4), (3, 9, 4), 4),  # the head all-to-all, uneven token blocks
        (3, dict(rows=3), (3, 7, 4), 2),  # heads that do not divide: the ring
        (2, dict(depth=2), (3, 3, 3, 2), 2),  # a volume's D * H * W tokens
        (2, dict(rows=2), (3, 9), 2),  # a signal's L
    ],
)
@pytest.mark.parametrize("kind", ["sdpa", "explicit", "gc context"])
def test_attention_on_other_grids_and_dimensions(ranks, size, grid, shape, heads, kind):
    for triples in ranks(size).run(token_parity, kind, grid, shape, heads, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize(
    ("size", "grid", "shape"),
    [(2, dict(rows=2), (3, 8, 6)), (3, dict(rows=3), (3, 12, 4)), (2, dict(cols=2), (3, 4, 7)),
     (4, dict(rows=2, cols=2), (3, 8, 8))],
)  # fmt: skip
def test_max_unpool_to_the_indices_of_whole_windows(ranks, size, grid, shape):
    """max_pool's indices numbered in the whole plane, and MaxUnpool back to this rank's
    block, where every block is whole 2 x 2 windows (the last may keep a remainder row)."""
    for triples in ranks(size).run(token_parity, "unpool", grid, shape, timeout=120):
        assert_triples(triples)


def test_negative_control_indices_numbered_in_the_block_do_not_match(ranks):
    results = ranks(2).run(token_parity, "unpool", dict(rows=2), (3, 8, 6), 2, True, timeout=120)
    assert "output" in mismatches([(label, got, want, {}) for label, got, want in results[1]])


@pytest.mark.parametrize(
    ("size", "grid", "shape", "kind"),
    [(2, dict(rows=2), (3, 10, 6), "unpool"),  # blocks 5 + 5: a window across them
     (3, dict(rows=3), (3, 11, 4), "unpool"),
     (4, dict(rows=2, cols=2), (3, 11, 7), "unpool"),
     (2, dict(rows=2), (3, 10, 6), "unpool overlapping"),  # kernel 3, stride 2, padding 1
     (2, dict(cols=2), (3, 5, 9), "unpool overlapping"),
     (3, dict(rows=3), (3, 12, 4), "unpool overlapping"),
     (4, dict(rows=2, cols=2), (3, 11, 7), "unpool overlapping"),
     (2, dict(rows=2), (3, 11), "unpool overlapping"),  # a signal
     (2, dict(depth=2), (3, 5, 6, 4), "unpool overlapping")],  # a volume
)  # fmt: skip
def test_max_unpool_of_windows_across_blocks_matches_dense(ranks, size, grid, shape, kind):
    """max_pool's indices and MaxUnpool where windows cross blocks or overlap: each output
    block fetches the rows (the pooled rows) its windows read (are reached from)."""
    for triples in ranks(size).run(token_parity, kind, grid, shape, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_pooling_indices_and_unpooling_on_blocks_are_torchs_exactly(ranks, size):
    """On inputs full of ties, NaNs and windows of -inf, with dilation and ceil_mode: the
    values, the indices and the gradients of each rank's block are torch's on the whole."""
    for results in ranks(size).run(pool_indices_parity, size, timeout=120):
        assert_results(results)


@pytest.mark.parametrize(
    ("fault", "label"), [("padding named", "indices"), ("own pooled rows", "unpooled")]
)
def test_negative_control_pooling_indices_and_unpooling_can_fail(ranks, fault, label):
    """Windows of -inf that keep the padding row the fetched block's pooling names, and
    unpooling without the neighbours' pooled rows, must not match."""
    results = ranks(2).run(pool_indices_parity, 2, fault, timeout=120)
    bad = mismatches([r for rank in results for r in rank])
    assert any(b.endswith(f": {label}") for b in bad), bad


def test_negative_control_unpooling_without_the_neighbours_rows_does_not_match(ranks):
    results = ranks(2).run(token_parity, "unpool overlapping", dict(rows=2), (3, 10, 6), 2,
                           False, "own pooled rows", timeout=120)  # fmt: skip
    assert "output" in mismatches([(label, got, want, {}) for label, got, want in results[0]])


@pytest.mark.parametrize(
    ("size", "grid", "shape"),
    [(2, dict(rows=2), (3, 8, 6)), (3, dict(rows=3), (3, 12, 4)), (2, dict(cols=2), (3, 4, 8)),
     (4, dict(rows=2, cols=2), (3, 8, 8))],
)  # fmt: skip
def test_patches_folded_after_the_channels(ranks, size, grid, shape):
    """MobileViTv2's linear attention: GroupNorm over (C, P, patches), a 1x1 convolution and
    a softmax over the folded patches, a whole context vector expanded back to the blocks."""
    for triples in ranks(size).run(token_parity, "patch attention", grid, shape, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize("kind", ["sdpa", "einsum", "talking heads", "tensor unfold",
                                  "F.unfold", "F.fold", "linear attention",
                                  "pooling queries",
                                  "token mlp", "flatten linear", "token pool", "gc context",
                                  "xca", "token batchnorm", "relu linear attention",
                                  "class token", "class token output",
                                  "token selection"])  # fmt: skip
def test_negative_control_own_tokens_only_do_not_match(ranks, kind):
    results = ranks(4).run(token_parity, kind, dict(rows=2, cols=2), IMAGE, 2, True, timeout=120)
    bad = mismatches([(label, got, want, {}) for label, got, want in results[0]])
    assert "output" in bad


@pytest.mark.parametrize(("size", "grid"), [(2, dict(rows=2)), (4, dict(rows=2, cols=2))])
def test_extremes_over_tokens_with_ties_and_a_nan_are_torchs(ranks, size, grid):
    """``max(1)`` and ``min(1)`` over the tokens, ties across blocks and a NaN: torch's first
    winner, its whole index, and the gradient to it alone."""
    for triples in ranks(size).run(winners_parity, grid, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize(("fault", "kind"), [("no shift", "sdpa"), ("no rescale", "sdpa bias"),
                                           ("no rescale", "decomposed relative positions")])
def test_negative_control_the_ring_needs_its_shifts_and_its_rescaling(ranks, fault, kind):
    """The ring attention (2 heads on 3 ranks) with its key/value blocks never passed on, or
    its partial results added without their log-sum-exp weights, must not match."""
    results = ranks(3).run(token_parity, kind, dict(rows=3), IMAGE, 2, False, fault,
                           timeout=120)  # fmt: skip
    bad = mismatches([(label, got, want, {}) for label, got, want in results[0]])
    assert "output" in bad


SCRAMBLED = [
    (3, 5, 7),  # (N, 35, 8) -> (N, 8, 5, 7) regroups across H and W: the reshape moves it
    (3, 8, 8),  # (N, 64, 8) -> (N, 8, 8, 8) regroups into H and W elsewhere: the add moves it
]


@pytest.mark.parametrize("shape", SCRAMBLED)
@pytest.mark.parametrize(("size", "grid"), [(2, dict(rows=2)), (4, dict(rows=2, cols=2))])
@pytest.mark.parametrize("kind", ["scrambled reshape", "scrambled reshape in place"])
def test_blocks_of_two_layouts_meet_by_an_all_to_all(ranks, kind, size, grid, shape):
    """MAnet's position attention: (N, L, C) reshaped to (N, C, H, W) without a transpose,
    then added to the map (in place too: the block written into keeps its layout)."""
    for triples in ranks(size).run(token_parity, kind, grid, shape, timeout=120):
        assert_triples(triples)


@pytest.mark.parametrize("shape", SCRAMBLED)
@pytest.mark.parametrize(("size", "grid"), [(2, dict(rows=2)), (4, dict(rows=2, cols=2))])
def test_negative_control_a_scrambled_reshape_needs_its_all_to_all(ranks, size, grid, shape):
    """Each rank's elements read in the other layout where they are, without the all-to-all
    that takes them to their rank, must not match."""
    results = ranks(size).run(token_parity, "scrambled reshape", grid, shape, 2, False,
                              "no relayout", timeout=120)  # fmt: skip
    assert "output" in mismatches([(label, got, want, {}) for label, got, want in results[0]])


def test_negative_control_the_head_all_to_all_needs_its_exchange(ranks):
    results = ranks(2).run(token_parity, "sdpa", dict(rows=2), IMAGE, 2, True, timeout=120)
    assert "output" in mismatches([(label, got, want, {}) for label, got, want in results[0]])


@pytest.mark.parametrize(("grid", "size"), [(dict(rows=2, cols=2), (5, 7)),
                                            (dict(depth=2, rows=2), (3, 5, 2))])  # fmt: skip
def test_token_orders_are_the_blocks_of_the_whole_index_map(ranks, grid, size):
    for triples in ranks(4).run(orders_match_blocks, grid, size, timeout=60):
        assert_triples(triples)


@pytest.mark.parametrize("heads", [4, 6])
def test_the_head_all_to_all_and_its_adjoint(ranks, heads):
    for triples in ranks(4).run(all_to_all_adjoint, heads, timeout=60):
        assert_triples(triples)


@pytest.mark.parametrize(("size", "grid", "shape"), [(2, dict(rows=2), (5, 3)),
                                                     (3, dict(rows=3), (7, 2)),
                                                     (4, dict(rows=2, cols=2), (5, 7))])
def test_a_relayout_moves_each_element_to_its_rank_and_passes_the_dot_product_test(
        ranks, size, grid, shape):  # fmt: skip
    for triples in ranks(size).run(relayout_adjoint, grid, shape, timeout=60):
        assert_triples(triples)


def test_attention_with_dropout_is_refused_on_every_rank(ranks):
    for message in ranks(2).run(dropout_refused, timeout=60):
        assert "dropout_p > 0" in message


def test_a_flatten_into_a_linear_map_is_whole_and_dense():
    """One rank: the rule's sums and cuts are the dense map (its collectives are copies)."""
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 120, dtype=torch.float64, requires_grad=True)
    guard.mark(x, size=(5, 6))
    with guard:
        y = F.linear(x.flatten(1), w)
    assert not guard.is_split(y)
    x_dense, w_dense = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = F.linear(x_dense.flatten(1), w_dense)
    torch.testing.assert_close(y, want)
    y.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad)
    torch.testing.assert_close(w.grad, w_dense.grad)


def test_what_stays_refused_over_the_tokens_and_spatial_dimensions():
    """One rank: a scan along the flattened tokens, and softmax, F.normalize and reductions
    over only one of H and W, stay refused."""
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64)
    guard.mark(x, size=(5, 6))
    with guard:
        tokens_ = x.flatten(2)
        unflattened = tokens_.unflatten(2, (5, 6))
        for refused in (lambda: tokens_.cumsum(-1), lambda: x.softmax(2),
                        lambda: F.normalize(x, dim=3), lambda: x.sum(2),
                        lambda: unflattened.mean(-1)):  # fmt: skip
            with pytest.raises(ValueError, match="spatial dimension"):
                refused()


def test_class_tokens_refuse_what_would_need_their_place():
    """One rank: with class tokens before the tokens, a reshape that regroups them, a token
    past the class tokens taken alone, and operations without a rule for such tokens (a scan,
    a flip) are refused, the first and the last naming the class token."""
    guard = SpatialGuard(nn.Identity(), LocalCommunicator())
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64)
    guard.mark(x, size=(5, 6))
    with guard:
        u = torch.cat((torch.zeros(2, 1, 4, dtype=torch.float64), x.flatten(2).transpose(1, 2)), 1)
        assert u.shape == (2, 31, 4) and u[:, 0].shape == (2, 4) and u[:, 1:].shape == (2, 30, 4)
        for refused, why in ((lambda: u.reshape(2, 31 * 4), "class token"),
                             (lambda: u[:, 3], "folded"), (lambda: u.flip(1), "class token"),
                             (lambda: u.cumsum(1), "class token")):  # fmt: skip
            with pytest.raises(ValueError, match=why):
                refused()
