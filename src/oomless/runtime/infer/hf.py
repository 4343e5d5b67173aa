"""The transformers backend: ``model.generate`` in batches, on CPU or one GPU.

Used where vLLM is not installed or there is no GPU. On a GPU the batch size
comes from the memory model (``estimate_generate``) and what is free on the
card; a batch that still runs out of memory is halved and retried, so an OOM
costs time, not results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import OomlessError, UnknownModelError
from .core import Generation, InferOptions

CPU_BATCH_SIZE = 8
MAX_BATCH_SIZE = 256
# Keep this share of the free memory unused: the estimate is ±10% (tests/memory).
FREE_MEMORY_MARGIN = 0.10


def batch_size_for(spec: Any, free_bytes: int, opts: InferOptions) -> int:
    """Largest power-of-two batch whose predicted generate peak fits ``free_bytes``."""
    from ...memory import estimate_generate

    budget = free_bytes * (1 - FREE_MEMORY_MARGIN)
    batch = 1
    while batch * 2 <= MAX_BATCH_SIZE:
        need = estimate_generate(spec, batch * 2, opts.cutoff_len, opts.max_new_tokens)
        if need.device_peak_bytes > budget:
            break
        batch *= 2
    return batch


def _dtype(torch: Any, opts: InferOptions, cuda: bool) -> Any:
    if opts.dtype != "auto":
        names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        return getattr(torch, names.get(opts.dtype, opts.dtype))
    if cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32  # CPU kernels of 16-bit types are slow or missing


class HFBackend:
    name = "transformers"

    def __init__(self, opts: InferOptions):
        import torch
        from transformers import AutoModelForCausalLM

        from ...dataset.records import load_tokenizer
        from ..loading import resolve_model_dir

        self.opts = opts
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        model_dir = str(resolve_model_dir(opts.model))  # a local folder: never the network
        if opts.adapter and not Path(opts.adapter).is_dir():
            raise UnknownModelError(f"--adapter '{opts.adapter}' is not a folder; give a PEFT "
                                    "LoRA folder (e.g. RUN/final of `oomless train`)")
        try:
            self.tokenizer = load_tokenizer(model_dir, opts.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=_dtype(torch, opts, self.device == "cuda"),
                trust_remote_code=opts.trust_remote_code, local_files_only=True,
            )
        except OSError as err:
            raise UnknownModelError(
                f"cannot load model '{opts.model}' ({err}); give a local model folder or a "
                "model id already in the Hugging Face cache (oomless works offline)"
            ) from None
        if opts.adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, opts.adapter, local_files_only=True)
        self.model = model.to(self.device).eval()
        self.tokenizer.padding_side = "left"  # generation continues at the right edge
        self.batch_size = opts.batch_size or self._default_batch_size()

    def _default_batch_size(self) -> int:
        if self.device == "cpu":
            return CPU_BATCH_SIZE
        from ...models.catalog import resolve_model

        try:
            spec = resolve_model(self.opts.model).spec
        except OomlessError:
            return CPU_BATCH_SIZE  # no config.json the memory model reads: stay small
        free_bytes, _ = self.torch.cuda.mem_get_info()
        return batch_size_for(spec, free_bytes, self.opts)

    def engine_info(self) -> dict[str, Any]:
        return {"backend": self.name, "device": self.device, "batch_size": self.batch_size,
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "max_model_len": self.opts.max_model_len, "adapter": self.opts.adapter}

    def _generate_batch(self, prompts: list[list[int]]) -> list[Generation]:
        torch = self.torch
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        sample = self.opts.temperature > 0
        extra = {"temperature": self.opts.temperature, "top_p": self.opts.top_p} if sample else {}
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=sample,
                                      max_new_tokens=self.opts.max_new_tokens, pad_token_id=pad,
                                      **extra)
        results = []
        for p, row in zip(prompts, out[:, width:].tolist(), strict=True):
            stop = {pad, self.tokenizer.eos_token_id}
            new = row[:next((i for i, t in enumerate(row) if t in stop), len(row))]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            results.append(Generation(text, len(p), len(new)))
        return results

    def generate(self, prompts: list[list[int]]) -> list[Generation]:
        """Generations in prompt order; similar lengths are batched together."""
        if self.opts.temperature > 0:
            self.torch.manual_seed(self.opts.seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Generation] = {}
        start = 0
        while start < len(order):
            batch = order[start:start + self.batch_size]
            try:
                outs = self._generate_batch([prompts[i] for i in batch])
            except self.torch.OutOfMemoryError:
                if self.batch_size == 1:
                    raise
                self.torch.cuda.empty_cache()
                self.batch_size //= 2  # retry this batch smaller; nothing is lost
                continue
            results.update(zip(batch, outs, strict=True))
            start += len(batch)
        return [results[i] for i in range(len(prompts))]

    def close(self) -> None:
        del self.model
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
