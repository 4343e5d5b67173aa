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


def test_paged_states_of_small_tensors_stay_on_the_device(monkeypatch):
    import bitsandbytes.functional as F
    from bitsandbytes.optim import PagedAdamW

    paged_elements: list[int] = []

    def record(*shape, dtype=None, device=None):  # CUDA unified memory: not on a CPU
        import torch

        paged_elements.append(int(torch.Size(shape).numel()))
        return torch.zeros(shape, dtype=dtype)

    import torch

    monkeypatch.setattr(F, "get_paged", record)
    monkeypatch.setattr(F, "fill", lambda *args: None)
    # on the CPU bitsandbytes never pages; meta tensors take the GPU path of the rule
    params = [torch.nn.Parameter(torch.empty(p.shape, device="meta"))
              for p in _trainable("full", 16)]
    opt = PagedAdamW(params)
    device_elements = 0
    for p in params:
        before = len(paged_elements)
        opt.get_state_buffer(p)
        device_elements += p.numel() if len(paged_elements) == before else 0
    spec = spec_from_hf_config(TINY_LLAMA, "tiny-llama")
    cfg = RunConfig(model="tiny-llama", method="full", optimizer="paged-adamw")
    st = model_states(spec, cfg, dtypes_for(cfg))
    assert st.gpu["optimizer"] == 2 * 4 * device_elements  # m and v, fp32
    assert st.paged_bytes == 2 * 4 * sum(paged_elements)
