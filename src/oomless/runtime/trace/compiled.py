"""What torch.compile saves for backward: the min-cut partitioner run on fake tensors.

With ``torch.compile`` AOTAutograd traces the joint forward + backward graph of each
compiled region and ``torch._functorch.partitioners.min_cut_rematerialization_partition``
chooses the tensors the forward hands to the backward: it recomputes cheap pointwise
ops (a norm's intermediates, SiLU × mul, dtype casts) instead of saving them, and
inductor fuses the pointwise kernels so their transient buffers never exist. The
forward graph's outputs beyond the region's own outputs are exactly what the compiled
region saves (``CompiledFunction`` passes them to ``ctx.save_for_backward``).

:func:`partition_saved` runs that pipeline as inductor configures it (its
decomposition table, the partitioner with ``compiler="inductor"``) on FakeTensors: no
memory is allocated and no kernel is generated. Two regions are traced, the ones
torchtune compiles (pytorch/torchtune@bd2a0fc training/_compile.py ``compile_model``:
every ``TransformerSelfAttentionLayer``; ``compile_loss``: the chunked loss's
``compute_cross_entropy``, one chunk per call):

- :func:`decoder_layer_saved` — transformers' decoder layer of each of ``LAYER_FAMILIES``
  (Llama's has the same RMSNorm, grouped-query attention with RoPE, SDPA and SwiGLU as
  torchtune's Llama layer);
- :func:`chunk_loss_saved` — ``cross_entropy(logits.float(), labels, reduction="sum")``
  on one chunk of 16-bit logits, as torchtune modules/loss/ce_chunked_output_loss.py
  ``CEWithChunkedOutputLoss.compute_cross_entropy`` computes it.

:func:`saved_widths` names each saved tensor by its width per token (hidden,
intermediate, q/kv width, heads, vocabulary) from distinct probe dimensions, so the
pure core can evaluate the trace at any model's dimensions
(``benchmarks/compiled_partition.py`` writes oomless/data/compiled_saved.json).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# probe dimensions: pairwise distinct widths so that every saved tensor's width per
# token names one dimension (checked by saved_widths)
PROBE = {"hidden": 96, "intermediate": 352, "heads": 6, "kv_heads": 2, "head_dim": 20,
         "vocab": 1000, "batch": 2, "seq": 24, "lora_r": 8}
# the layer's own linears (transformers LlamaDecoderLayer), all wrapped by LoRA
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Saved:
    """One tensor a compiled region's forward keeps for its backward."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    input_index: int | None  # the region's own input (alive anyway) or None


def partition_saved(fn: Callable[..., Any], args: list[torch.Tensor]) -> list[Saved]:
    """The tensors ``min_cut_rematerialization_partition`` saves for ``fn(*args)``.

    ``args`` are FakeTensors (or real ones); ``fn`` returns one tensor. Runs AOTAutograd
    with inductor's decompositions; the compiler only reads the forward graph."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    found: dict[str, list[Saved]] = {}

    def forward_compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved, roots = [], set()
        for node in outputs[1:]:  # the first output is fn's own result
            val = node.meta.get("val") if hasattr(node, "meta") else None
            if not isinstance(val, torch.Tensor):
                continue  # symbolic ints
            root = _view_root(node)
            if root in roots:
                continue  # a view of a tensor already saved: one storage
            roots.add(root)
            base = root.meta.get("val") if root.op != "placeholder" else val
            base = base if isinstance(base, torch.Tensor) else val
            index = placeholders.index(root) if root in placeholders else None
            saved.append(Saved(tuple(base.shape), str(base.dtype).removeprefix("torch."),
                               base.numel() * base.element_size(), index))
        found["saved"] = saved
        return gm

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    compiled = aot_function(fn, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                            partition_fn=partition, decompositions=select_decomp_table())
    compiled(*args)
    return found["saved"]


def _view_root(node: Any) -> Any:
    """The node a chain of view ops (t, permute, view) reads: a saved transposed weight
    is the weight itself."""
    while (node.op == "call_function" and getattr(node.target, "is_view", False)
           and node.args and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# decoder layers traced: transformers' own classes, built from their configs (each the
# RMSNorm, grouped-query attention with RoPE, SDPA and SwiGLU of torchtune's Llama layer;
# Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorms)
LAYER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_layer(model_type: str = "llama", dims: dict[str, int] = PROBE) -> Any:
    """The first decoder layer of a one-layer ``model_type`` model (transformers' own
    class) in bf16 with SDPA, and the model's rotary embedding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        head_dim=dims["head_dim"], vocab_size=dims["vocab"], num_hidden_layers=1,
        max_position_embeddings=4 * dims["seq"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0].to(torch.bfloat16).train()
    return layer, model.model.rotary_emb


def layer_inputs(rotary: Any, dims: dict[str, int]) -> tuple[torch.Tensor, tuple]:
    b, s = dims["batch"], dims["seq"]
    x = torch.randn(b, s, dims["hidden"], dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    cos, sin = rotary(x, positions)
    return x, (cos.to(torch.bfloat16), sin.to(torch.bfloat16))


def layer_call(layer: Any) -> Callable[..., torch.Tensor]:
    """fn(x, cos, sin, *params) → the layer's output, parameters as explicit inputs."""
    names = [n for n, _ in layer.named_parameters()]

    def call(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             *params: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x,),
                                         {"position_embeddings": (cos, sin),
                                          "attention_mask": None})
        return out[0] if isinstance(out, tuple) else out

    return call


def with_lora(layer: Any, rank: int) -> Any:
    """PEFT's LoRA (its real layer code) on every linear of the layer, adapters in bf16."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                        target_modules=list(LORA_TARGETS))
    return inject_adapter_in_model(config, layer).to(torch.bfloat16)


def decoder_layer_saved(dims: dict[str, int] = PROBE, method: str = "full",
                        model_type: str = "llama") -> list[Saved]:
    """What one compiled decoder layer saves: ``method`` "full" (every weight trainable),
    "frozen" (none) or "lora" (PEFT LoRA on every linear, only it trainable)."""
    layer, rotary = tiny_layer(model_type, dims)
    if method == "lora":
        layer = with_lora(layer, dims["lora_r"])
    with _fake_mode():
        x, (cos, sin) = layer_inputs(rotary, dims)
        params = [p.detach().clone().requires_grad_(
            method == "full" or (method == "lora" and "lora_" in name))
            for name, p in layer.named_parameters()]
        saved = partition_saved(layer_call(layer), [x, cos, sin, *params])
    return [s for s in saved if s.input_index is None or s.input_index < 3]  # not weights


def chunk_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One chunk of torchtune's chunked cross-entropy (fp32 upcast inside the region)."""
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100,
                                             reduction="sum")


def chunk_loss_saved(rows: int = PROBE["batch"] * PROBE["seq"],
                     vocab: int = PROBE["vocab"]) -> list[Saved]:
    """What one compiled chunk of torchtune's cross-entropy saves."""
    with _fake_mode():
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(rows, dtype=torch.long)
        return partition_saved(chunk_loss, [logits, labels])


def saved_widths(saved: list[Saved], tokens: int, dims: dict[str, int]) -> list[dict]:
    """Each saved tensor as {"width": <dimension name or "1">, "bytes": per element,
    "input": bool}: its elements per token matched to one probe dimension (or a product
    of heads × head_dim, the q and kv widths)."""
    names = {"1": 1, "hidden": dims["hidden"], "intermediate": dims["intermediate"],
             "heads": dims["heads"], "kv_heads": dims["kv_heads"], "vocab": dims["vocab"],
             "head_dim": dims["head_dim"], "lora_r": dims["lora_r"],
             "q_width": dims["heads"] * dims["head_dim"],
             "kv_width": dims["kv_heads"] * dims["head_dim"]}
    by_value: dict[int, str] = {}
    for name, value in names.items():
        if value in by_value:
            raise ValueError(f"probe dimensions {by_value[value]} and {name} are both {value}")
        by_value[value] = name
    out = []
    for s in saved:
        numel = s.nbytes // torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
        if numel % tokens or numel // tokens not in by_value:
            raise ValueError(f"saved tensor {s.shape} {s.dtype}: {numel} elements are not "
                             f"{tokens} tokens × one named width")
        out.append({"width": by_value[numel // tokens], "bytes": s.nbytes // numel,
                    "dtype": s.dtype, "input": s.input_index is not None})
    return out
