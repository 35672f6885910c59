"""Graph mode's shared parts: which size a decode step pads to, what padded rows hold, and
the default sizes."""

from __future__ import annotations

import pytest
import torch

from kiln.attention.base import BatchLayout, DecodeGraphInputs
from kiln.config import EngineConfig
from kiln.platforms.base import Platform
from kiln.worker.model_runner import pick_graph_size


@pytest.mark.parametrize(("n", "size"), [(1, 2), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_step_pads_to_the_smallest_size_that_holds_it(n, size):
    assert pick_graph_size(n, [2, 4, 8]) == size


def test_padded_rows_write_nothing_and_see_one_slot():
    layout = BatchLayout.build([[3, 5], [7]], [20, 4], [1, 1], 16, "cpu")
    ids, pos = torch.tensor([11, 12]), torch.tensor([20, 4])
    padded = DecodeGraphInputs.pad(ids, pos, layout, size=4, max_blocks=6)
    assert padded.input_ids.tolist() == [11, 12, 0, 0] and padded.positions.tolist() == [20, 4, 0, 0]
    assert padded.slot_mapping.tolist() == [5 * 16 + 4, 7 * 16 + 4, -1, -1]
    assert padded.seq_lens.tolist() == [21, 5, 1, 1]
    assert padded.block_table.tolist() == [[3, 5, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0], [0] * 6, [0] * 6]
    assert padded.block_table.dtype == torch.int32  # the same shapes and dtypes at every step


@pytest.mark.parametrize(
    ("kwargs", "sizes"),
    [
        (dict(max_num_seqs=20), [1, 2, 4, 8, 16, 20]),
        (dict(max_num_seqs=1024), [1, 2, 4] + list(range(8, 513, 8))),
        (dict(max_num_seqs=64, max_num_batched_tokens=12), [1, 2, 4, 8, 12]),
        (dict(max_num_seqs=16, graph_sizes=[32, 8, 3]), [3, 8]),
    ],
)
def test_graph_sizes_default_to_steps_of_8_up_to_max_num_seqs(kwargs, sizes):
    assert Platform.graph_sizes(None, EngineConfig.create(**kwargs)) == sizes


def test_graph_sizes_flag_parses_a_list():
    from kiln.cli import build_parser

    argv = ["serve", "--graph-sizes", "2", "4", "8", "--enforce-eager"]
    ns = build_parser(argv).parse_args(argv)
    assert ns.graph_sizes == [2, 4, 8] and ns.enforce_eager is True
