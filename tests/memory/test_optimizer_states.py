"""Optimizer states tensor by tensor against bitsandbytes' own code (issue 18, item 9).

A tiny Llama is built with transformers (and PEFT for LoRA); bitsandbytes' AdamW8bit
allocates its states for every trainable tensor on the CPU (``init_state`` is the code
a GPU run runs), and oomless' optimizer bytes must equal what it allocated: tensors under
``min_8bit_size`` keep fp32 states. The paged rule (states of tensors under 1e5 elements
stay in PyTorch's allocator) is checked on the same tensors, as meta tensors, through
bitsandbytes' ``get_state_buffer``, with its CUDA-only ``get_paged`` and ``fill``
recording instead of allocating.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory.precision import dtypes_for
from oomless.memory.states import model_states
from oomless.models.hf_config import spec_from_hf_config

TINY_LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=704,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=16384, max_position_embeddings=1024, tie_word_embeddings=False)


def _trainable(method: str, r: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=r, target_modules="all-linear"))
    return [p for p in model.parameters() if p.requires_grad]


def _bnb_state_bytes(params) -> int:
    import torch
    from bitsandbytes.optim import AdamW8bit

    opt = AdamW8bit(params)
    total = 0
    for i, p in enumerate(params):
        opt.init_state(opt.param_groups[0], p, 0, i)
        total += sum(v.numel() * v.element_size() for k, v in opt.state[p].items()
                     if torch.is_tensor(v) and not k.startswith("qmap"))  # qmaps: shared
    return total


@pytest.mark.parametrize(("method", "r"), [("lora", 8), ("lora", 16), ("lora", 64),
                                           ("full", 16)])
def test_8bit_states_equal_what_bitsandbytes_allocates(method, r):
    params = _trainable(method, r)
    spec = spec_from_hf_config(TINY_LLAMA, "tiny-llama")
    cfg = RunConfig(model="tiny-llama", method=method, optimizer="adamw-8bit",
                    lora={"r": r})
    st = model_states(spec, cfg, dtypes_for(cfg))
    assert st.trainable_params == sum(p.numel() for p in params)
    assert st.gpu["optimizer"] == _bnb_state_bytes(params)


def test_the_rule_is_stated_and_changes_narrow_adapters():
    """r=8 on hidden 256: lora_A of every linear (8 × 256 = 2,048 elements) is under
    4,096 and keeps fp32 states, so the states exceed the flat 8-bit figure."""
    from oomless.memory.constants import ADAM8BIT_BYTES

    spec = spec_from_hf_config(TINY_LLAMA, "tiny-llama")
    cfg = RunConfig(model="tiny-llama", optimizer="adamw-8bit", lora={"r": 8})
    st = model_states(spec, cfg, dtypes_for(cfg))
    assert st.gpu["optimizer"] > 1.5 * ADAM8BIT_BYTES * st.trainable_params
    assert any("min_8bit_size" in a for a in st.assumptions)


@pytest.mark.parametrize("name", ["paged-adamw", "paged-adamw-8bit"])
def test_paged_states_of_small_tensors_stay_on_the_device(monkeypatch, name):
    import bitsandbytes.functional as F
    import torch

    from oomless.knobs import OPTIMIZERS, load_class

    paged_bytes: list[int] = []

    def record(*shape, dtype=None, device=None):  # CUDA unified memory: not on a CPU
        paged_bytes.append(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size())
        return torch.empty(shape, dtype=dtype, device="meta")

    monkeypatch.setattr(F, "get_paged", record)
    monkeypatch.setattr(F, "fill", lambda *args: None)
    # on the CPU bitsandbytes never pages; meta tensors take the GPU path of the rule
    params = [torch.nn.Parameter(torch.empty(p.shape, device="meta"))
              for p in _trainable("full", 16)]
    opt = load_class(OPTIMIZERS[name].torch_class)(params)
    device_bytes = 0
    for i, p in enumerate(params):
        before = len(paged_bytes)
        opt.init_state(opt.param_groups[0], p, 0, i)
        paged_here = set(range(before, len(paged_bytes)))
        assert len(paged_here) in (0, 2)  # both states paged, or neither
        device_bytes += sum(v.numel() * v.element_size() for k, v in opt.state[p].items()
                            if torch.is_tensor(v) and not k.startswith("qmap"))
        if paged_here:  # the paged states are in opt.state too: not device bytes
            device_bytes -= sum(paged_bytes[j] for j in paged_here)
    spec = spec_from_hf_config(TINY_LLAMA, "tiny-llama")
    cfg = RunConfig(model="tiny-llama", method="full", optimizer=name)
    st = model_states(spec, cfg, dtypes_for(cfg))
    assert st.paged_bytes == sum(paged_bytes) > 0
    assert st.gpu["optimizer"] == device_bytes
