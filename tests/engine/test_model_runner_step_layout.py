"""The model runner checks a step's tensors once where it prepares them
(model_runner.check_step_layout), so the attention backends and the C decode stack read them
without checking again: what `_prepare` builds passes, and a tensor of another dtype, shape or
stride is refused with a ValueError that names it."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.worker.model_runner import check_step_layout


def _step(**change):
    """Two decodes and a 3-token prefill: input_ids, positions and the metadata, with `change`d tensors."""
    t = {"input_ids": torch.tensor([5, 6, 7, 8, 9]), "positions": torch.tensor([4, 9, 0, 1, 2]),
         "slot_mapping": torch.tensor([4, 25, 32, 33, 34]),
         "query_start_loc": torch.tensor([0, 1, 2, 5], dtype=torch.int32),
         "seq_lens": torch.tensor([5, 10, 3], dtype=torch.int32),
         "block_tables": torch.tensor([[0, 0], [1, 0], [2, 0]], dtype=torch.int32)} | change
    meta = AttentionMetadata(t["slot_mapping"], t["query_start_loc"], t["seq_lens"], t["block_tables"], 2,
                             [0, 1, 2, 5], [1, 1, 3], [5, 10, 3])
    return t["input_ids"], t["positions"], meta


def test_a_step_in_the_runners_layout_passes():
    check_step_layout(*_step())


@pytest.mark.parametrize("change, message", [
    ({"positions": torch.tensor([4, 9, 0, 1, 2], dtype=torch.int32)},
     "step input positions: int32 (5,), want contiguous int64 (5,)"),
    ({"slot_mapping": torch.arange(10)[::2]}, "step input slot_mapping: int64 (5,) strided, want contiguous int64 (5,)"),
    ({"block_tables": torch.zeros(3, 2, dtype=torch.int64)}, "step input block_tables: int64 (3, 2)"),
    ({"seq_lens": torch.tensor([5, 10], dtype=torch.int32)}, "step input seq_lens: int32 (2,), want contiguous int32 (3,)"),
    ({"block_tables": torch.zeros(3, dtype=torch.int32)}, "step input block_tables: int32 (3,), want"),
])
def test_a_tensor_out_of_layout_is_refused_where_the_step_is_prepared(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_step_layout(*_step(**change))
