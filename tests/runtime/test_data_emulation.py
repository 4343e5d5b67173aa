"""oomless.runtime.trace.data_emulation.FullBatchMode: fake tensors' values read as for a
full, unpacked batch, where transformers' own code branches on them."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import masking_utils

from oomless.runtime.trace.data_emulation import FullBatchMode


def test_masking_utils_reads_a_fake_batch_as_a_gpu_run_reads_a_real_one():
    original = masking_utils.is_tracing
    with FakeTensorMode():
        position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
        assert masking_utils.is_tracing(position_ids)  # without the mode: no value read
        with FullBatchMode():
            assert not masking_utils.is_tracing(position_ids)
            # one sequence per row, as on the GPU: no packed-sequence mask to build
            assert masking_utils.find_packed_sequence_indices(position_ids) is None
    assert masking_utils.is_tracing is original  # restored on exit
