"""Constants of the memory model, each with its source.

Byte sizes per element or per parameter; MiB-sized overheads of the CUDA
stack. Where a value is a measurement or a default rather than a law, the
comment says so and the estimate lists it under ``assumptions``.
"""

from __future__ import annotations

from ..units import MiB

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}

# bitsandbytes NF4/FP4 and the other quantized storage formats: models/quantization.py.

# Optimizer state bytes per trainable parameter.
# AdamW: exp_avg + exp_avg_sq in the parameter's dtype (torch.optim.AdamW).
# bitsandbytes 8-bit Adam: 2 × uint8 states + fp32 absmax per block of 256
# (bitsandbytes 0.50 optim/optimizer.py Optimizer2State.init_state, block-wise
# quantization); tensors under min_8bit_size=4096 elements keep fp32 states
# (memory/optimizer_states.py applies it tensor by tensor).
ADAM8BIT_BLOCK = 256
ADAM8BIT_BYTES = 2 + 2 * 4 / ADAM8BIT_BLOCK
ADAM8BIT_MIN_SIZE = 4096
# Paged bitsandbytes optimizers page a state only when its tensor has at least 1e5
# elements (optim/optimizer.py Optimizer8bit.get_state_buffer: `p.numel() < 1e5`
# gets torch.zeros_like on the device).
PAGED_MIN_SIZE = 100_000

# Cross-entropy in transformers' ForCausalLMLoss upcasts logits to fp32
# (transformers/loss/loss_utils.py: `logits = logits.float()`), then
# log_softmax keeps its fp32 output for backward.
LOSS_FP32_BYTES = 4

# FlashAttention / memory-efficient SDPA keep the log-sum-exp per (batch, head,
# query) in fp32 (PyTorch aten/src/ATen/native/transformers/attention.cpp,
# _scaled_dot_product_flash_attention returns logsumexp float32).
LSE_BYTES = 4

# --- non-PyTorch memory -----------------------------------------------------
# CUDA context with lazy module loading (CUDA ≥ 11.7, PyTorch default
# CUDA_MODULE_LOADING=LAZY): commonly measured 300–600 MiB on A100/H100 with
# PyTorch 2.x. We take 500 MiB; `oomless measure` reports the real figure.
CUDA_CONTEXT_BYTES = 500 * MiB
# Device memory the CUDA libraries take outside PyTorch's allocator once a training step
# has run: kernel images loaded on first use (lazy loading) and the cuBLAS/cuBLASLt
# handles' own state. Measured as NVML's process memory at the peak minus
# max_memory_reserved minus the context measured before the model existed: 234 MiB on 7
# of 8 training configurations, 218 MiB on the eighth (NVIDIA H200, driver 580, CUDA 13.0,
# PyTorch 2.11; benchmarks/results/gpu_validate.json). One platform: other GPUs and CUDA
# releases load other kernel images.
CUDA_KERNELS_LOADED_BYTES = 234 * MiB
# cuBLAS/cuBLASLt workspaces are allocated through the caching allocator
# (aten/src/ATen/cuda/CublasHandlePool.cpp): default CUBLAS_WORKSPACE_CONFIG
# :4096:8 = 32 MiB on Hopper (sm90), :4096:2:16:8 ≈ 8.1 MiB before it, per
# handle/stream; cuBLASLt adds one of the same size.
CUBLAS_WORKSPACE_HOPPER_BYTES = 32 * MiB  # compute capability exactly 9.0
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
# cuBLASLt: CUBLASLT_WORKSPACE_SIZE default 1024 KiB per handle. The forward
# thread and the autograd engine's device thread each hold one pair.
CUBLASLT_WORKSPACE_BYTES = 1 * MiB
CUBLAS_HANDLES_IN_TRAINING = 2


def cublas_workspace_bytes(compute_capability: str) -> int:
    """Workspaces the caching allocator holds for cuBLAS and cuBLASLt in a training step."""
    ws = CUBLAS_WORKSPACE_HOPPER_BYTES if compute_capability == "9.0" else CUBLAS_WORKSPACE_BYTES
    return CUBLAS_HANDLES_IN_TRAINING * (ws + CUBLASLT_WORKSPACE_BYTES)
# NCCL: NCCL_BUFFSIZE 4 MiB per channel and peer, plus the library's own
# device code; reports range 200–600 MiB per GPU in data-parallel jobs. We take
# 300 MiB per GPU when world size > 1.
NCCL_BYTES = 300 * MiB
# NCCL's NVLink SHARP (NVLS) buffers are not counted: NVIDIA/nccl v2.21.5 (the
# nvidia-nccl-cu12 pinned by torch 2.5.1, vLLM 0.6.5's torch) src/transport/nvls.cc
# ncclNvlsInit leaves NVLS off for communicators of two GPUs or fewer, and with its default
# NCCL_NVLS_ENABLE=2 on only where the device reports multicast support (NVSwitch systems).
NCCL_NVLS_MIN_GPUS = 3

# --- caching allocator --------------------------------------------------------
# Reserved-but-unallocated memory at the peak (fragmentation and cached
# blocks). c10/cuda/CUDACachingAllocator.cpp rounds large blocks to 2 MiB and
# caches freed blocks; a freed block serves later requests only where they fit,
# so the largest transient tensor of a step (the fp32 logits block, 4·t·V, or a
# dense embedding gradient) leaves a hole that smaller tensors only partly
# refill. Calibrated against the caching-allocator simulation of `oomless trace`
# on the accuracy matrix: reserve ≈ max(70% of the largest transient block, 5%
# of the memory that churns). With expandable_segments: 20% and 2%.
ALLOC_RESERVE_FRACTION = 0.05
ALLOC_RESERVE_FRACTION_EXPANDABLE = 0.02
ALLOC_RESERVE_LARGEST_BLOCK = 0.7
ALLOC_RESERVE_LARGEST_BLOCK_EXPANDABLE = 0.2
ALLOC_RESERVE_MIN_BYTES = 64 * MiB

# --- DeepSpeed ------------------------------------------------------------------
# ZeRO-2 reduce bucket and ZeRO-3 prefetch bucket: the HF/accelerate "auto"
# values hidden_size² and 0.9·hidden_size² elements
# (transformers/integrations/deepspeed.py, trainer_config_finalize).
ZERO3_PREFETCH_FRACTION = 0.9
# DeepSpeed's own ZeRO-3 estimator keeps "largest layer × 4 bytes" on the GPU
# for the gathered 16-bit parameters and gradients of the layer being computed
# (deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs).
ZERO3_LIVE_LAYER_BYTES_PER_PARAM = 4

# --- vLLM past one GPU (memory/vllm_parallel.py) ----------------------------------
# vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE:
# the vocabulary of VocabParallelEmbedding / ParallelLMHead is padded to a multiple of it.
VLLM_VOCAB_PADDING_SIZE = 64
# vllm/distributed/device_communicators/custom_all_reduce.py CustomAllreduce: used for
# world sizes 2, 4, 6, 8 (_SUPPORTED_WORLD_SIZES; above 2 only on fully NVLink-connected
# GPUs); a metadata + scratch buffer of max_size (8192 × 1024 bytes), an IPC buffer of
# max_size, and 8 MiB of rank_data.
VLLM_CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)
VLLM_CUSTOM_AR_MAX_SIZE_BYTES = 8192 * 1024
VLLM_CUSTOM_AR_RANK_DATA_BYTES = 8 * MiB

# --- DeepSpeed ZeRO's buffers (memory/zero_buffers.py) ------------------------------
# deepspeed/runtime/zero/config.py DeepSpeedZeroConfig field defaults (DeepSpeed 0.19):
# reduce_bucket_size and allgather_bucket_size pp_int(5e8), stage3_prefetch_bucket_size
# pp_int(5e7), stage3_max_live_parameters pp_int(1e9), contiguous_gradients True,
# overlap_comm None (True for stage 3, False otherwise: overlap_comm_valid).
DEEPSPEED_ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "contiguous_gradients": True,
    "overlap_comm": None,
}

# --- stacks' losses (memory/loss_paths.py) --------------------------------------------
# torchtune modules/loss/ce_chunked_output_loss.py, cross_entropy_loss.py: num_output_chunks=8
TORCHTUNE_LOSS_CHUNKS = 8
# unsloth models/llama.py CausalLM_fast_forward: `if bsz*q_len <= 1024: RETURN_LOGITS = True`
# (short batches return logits and take the Triton loss instead of cut cross-entropy)
UNSLOTH_CCE_MIN_TOKENS = 1024
