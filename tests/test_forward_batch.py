"""The flat batch's helpers: decode groups built from lists, rows taken without a gather."""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import DecodeGroup, take_rows
from kernels.mla import per_token_tables


@pytest.mark.parametrize("query_len", [1, 2, 3])
def test_a_decode_group_from_lists_is_what_per_token_tables_builds(query_len):
    tables = [[4, 9, 2], [7], [1, 3]]  # ragged: zero-padded to the widest
    lens = [40, 9, 30]
    group = DecodeGroup.of(5, query_len, tables, lens, "cpu")
    assert (group.start, group.num_seqs, group.query_len, group.end) == (5, 3, query_len, 5 + 3 * query_len)
    assert group.block_table.tolist() == [[4, 9, 2], [7, 0, 0], [1, 3, 0]]
    assert group.seq_lens.tolist() == lens
    assert group.block_table.dtype == group.seq_lens.dtype == torch.int32
    want_tables, want_lens = per_token_tables(group.block_table, group.seq_lens, query_len)
    got_tables, got_lens = group.per_token
    assert torch.equal(got_tables, want_tables) and torch.equal(got_lens, want_lens)
    assert got_tables.is_contiguous() and got_lens.is_contiguous()  # the native calls read them in place


def test_take_rows_is_a_view_for_consecutive_rows_and_a_gather_otherwise():
    t = torch.arange(24.0).view(6, 4)
    view = take_rows(t, [2, 3, 4])
    assert torch.equal(view, t[2:5]) and view.data_ptr() == t[2].data_ptr()
    for rows in ([4, 1], [0, 2, 3], [3, 3], [1, 2, 4]):  # not consecutive: a copy of exactly those rows
        got = take_rows(t, rows)
        assert torch.equal(got, t[torch.tensor(rows)])
        assert got.data_ptr() != t.data_ptr()
    assert take_rows(t, []).shape == (0, 4)
