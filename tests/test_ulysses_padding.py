"""Which padded batches patchkit serves under DeepSpeed Ulysses (the mask dropped, documents from position_ids alone):
the verdict on a whole gathered batch, without processes (tests/test_sequence_parallel.py runs it on two ranks)."""

from __future__ import annotations

import pytest
import torch

from patchkit.hooks.parallel.ulysses_padding import padding_verdict

CASES = {
    # name: (mask, position_ids, (padding before a real token, some of it unserved))
    "right": ([1, 1, 1, 0, 0], [0, 1, 2, 3, 4], (False, False)),
    "right, positions at 0": ([1, 1, 1, 0, 0], [0, 1, 2, 0, 0], (False, False)),
    "left, arange": ([0, 0, 1, 1, 1], [0, 1, 2, 3, 4], (True, True)),
    "left, generate()'s positions": ([0, 0, 1, 1, 1], [1, 1, 0, 1, 2], (True, False)),
    "left, cumsum - 1 left at -1": ([0, 0, 1, 1, 1], [-1, -1, 0, 1, 2], (True, True)),  # no restart after -1
    "hole, restarting": ([1, 1, 0, 1, 1], [0, 1, 1, 0, 1], (True, False)),
    "hole, continuing": ([1, 1, 0, 1, 1], [0, 1, 2, 3, 4], (True, True)),
    # attention (no mask) would restart after the padding's 9, one process (previous real: 1) would not
    "hole, restart only against padding": ([1, 1, 0, 1, 1], [0, 1, 9, 2, 3], (True, True)),
    "all padding": ([0, 0, 0, 0, 0], [0, 1, 2, 3, 4], (False, False)),
}


@pytest.mark.parametrize("name", CASES)
def test_padding_verdict(name):
    mask, positions, want = CASES[name]
    assert padding_verdict(torch.tensor([mask]), torch.tensor([positions])) == want


def test_one_unserved_row_decides_the_batch():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 3], [1, 0, 1, 2], [0, 1, 2, 3]])
    assert padding_verdict(mask, positions) == (True, True)
    assert padding_verdict(mask[:2], positions[:2]) == (True, False)
