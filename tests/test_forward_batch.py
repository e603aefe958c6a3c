"""engine.forward_batch.take_rows: a batch's rows without a gather where it can."""

from __future__ import annotations

import torch

from engine.forward_batch import take_rows


def test_take_rows_is_a_view_for_consecutive_rows_and_a_gather_otherwise():
    t = torch.arange(24.0).view(6, 4)
    view = take_rows(t, [2, 3, 4])
    assert torch.equal(view, t[2:5]) and view.data_ptr() == t[2].data_ptr()
    for rows in ([4, 1], [0, 2, 3], [3, 3], [1, 2, 4]):  # not consecutive: a copy of exactly those rows
        got = take_rows(t, rows)
        assert torch.equal(got, t[torch.tensor(rows)])
        assert got.data_ptr() != t.data_ptr()
    assert take_rows(t, []).shape == (0, 4)
