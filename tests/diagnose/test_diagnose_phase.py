"""Phase from traceback frames, from fixtures and from hand-written frames."""

from __future__ import annotations

import pytest
from diagnose_fixtures import read_fixture

from oomless.diagnose import diagnose_text
from oomless.diagnose.phase import Frame, phase_of


@pytest.mark.parametrize("name, phase", [
    ("seed002_torch2.log", "backward"),
    ("seed002_torch1.log", "backward"),
    ("torch21_capacty_eval_fragmentation.log", "evaluation"),
    ("torch2_other_processes.log", "forward"),
    ("torch2_multirank_ddp_logits.log", "forward"),
    ("deepspeed_zero3_init_cuda_error.log", "zero_init"),
    ("deepspeed_stage3_step_oom.log", "optimizer_step"),
    ("bitsandbytes_load_4bit.log", "model_load"),
    ("seed004_vllm_scoring.log", "generation"),
    ("vllm_free_memory.log", "vllm_startup"),
    ("host_dataloader_killed.log", "data_loading"),
    ("host_cpu_allocator.log", "model_load"),
    ("host_torchrun_sigkill_loading.log", "model_load"),  # no traceback: the progress line before it
])
def test_phase_of_fixture(name, phase):
    events = [f.event for f in diagnose_text(read_fixture(name)).findings]
    assert {e.phase for e in events} == {phase}


def frames(*specs: str) -> list[Frame]:
    out = []
    for spec in specs:
        path, func, *code = spec.split(":")
        out.append(Frame(path, func, code[0] if code else ""))
    return out


@pytest.mark.parametrize("specs, phase", [
    (["train.py:main", "transformers/trainer.py:training_step:loss.backward()",
      "torch/_tensor.py:backward", "torch/autograd/__init__.py:backward"], "backward"),
    (["train.py:main", "transformers/trainer.py:training_step", "transformers/trainer.py:compute_loss",
      "torch/nn/modules/module.py:_call_impl", "model.py:forward"], "forward"),
    (["train.py:main", "transformers/trainer.py:_inner_training_loop:self.optimizer.step()",
      "accelerate/optimizer.py:step", "torch/optim/adamw.py:step"], "optimizer_step"),
    (["train.py:main", "transformers/trainer.py:evaluate", "transformers/trainer.py:prediction_step",
      "transformers/generation/utils.py:generate", "transformers/generation/utils.py:_sample",
      "model.py:forward"], "generation"),
    (["train.py:main", "transformers/trainer.py:evaluate", "transformers/trainer.py:evaluation_loop",
      "model.py:forward"], "evaluation"),
    (["train.py:main", "transformers/modeling_utils.py:from_pretrained",
      "transformers/modeling_utils.py:_load_pretrained_model"], "model_load"),
    (["train.py:main", "transformers/trainer.py:_save_checkpoint", "transformers/trainer.py:save_model",
      "torch/serialization.py:save"], "checkpoint_save"),
    (["train.py:main", "deepspeed/__init__.py:initialize", "deepspeed/runtime/engine.py:__init__",
      "deepspeed/runtime/engine.py:_configure_zero_optimizer", "deepspeed/runtime/zero/stage3.py:__init__"],
     "zero_init"),
    (["serve.py:main", "vllm/v1/engine/core.py:_initialize_kv_caches",
      "vllm/v1/worker/gpu_worker.py:determine_available_memory",
      "vllm/v1/worker/gpu_model_runner.py:profile_run", "vllm/model_executor/models/llama.py:forward"],
     "vllm_profile_run"),
    (["serve.py:main", "vllm/v1/worker/gpu_worker.py:load_model",
      "vllm/model_executor/model_loader/loader.py:load_model"], "vllm_startup"),
    (["serve.py:main"], "unknown"),
])
def test_phase_of_frames(specs, phase):
    assert phase_of(frames(*specs)) == phase


def test_a_traceback_of_another_rank_is_not_used():
    text = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/x/transformers/trainer.py", line 1, in evaluate',
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/x/torch/autograd/__init__.py", line 2, in backward',
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a "
        "total capacity of 79.25 GiB of which 1.00 GiB is free.",
    ])
    e = diagnose_text(text).findings[0].event
    assert (e.rank, e.phase) == (1, "evaluation")


def test_an_earlier_unrelated_traceback_is_not_used():
    text = "\n".join([
        "Traceback (most recent call last):",
        '  File "/x/torch/autograd/__init__.py", line 2, in backward',
        "KeyError: 'labels'",
        "retrying with the next batch",
        "RuntimeError: CUDA error: out of memory",
    ])
    e = diagnose_text(text).findings[0].event
    assert e.phase == "unknown" and e.frames == ()
