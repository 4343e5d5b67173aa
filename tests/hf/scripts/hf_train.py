"""A user's training script, as the transformers examples write them (no oomless in it).

    python hf_train.py ARGS.json          (HfArgumentParser.parse_json_file)
    python hf_train.py --model_name_or_path M --output_dir D ...

It fine-tunes a local causal LM on the demo records and saves the result to
OUTPUT_DIR/final. ``--simulate_gpu_rows N`` plays a GPU on which, from optimizer
step ``--simulate_from_step``, a micro batch of more than N rows runs out of
memory: a real ``torch.OutOfMemoryError`` with CUDA's message, raised when the
step begins (outside ``training_step``, like an OOM in the optimizer step), so
that only a smaller ``per_device_train_batch_size`` gets past it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "23.65 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
            "has 22.58 GiB memory in use. Of the allocated memory 21.90 GiB is allocated by "
            "PyTorch, and 236.00 MiB is reserved by PyTorch but unallocated.")


@dataclass
class ScriptArguments:
    model_name_or_path: str
    max_seq_length: int = 64
    simulate_gpu_rows: int = 0
    simulate_from_step: int = 1
    # float64 for comparisons across process counts: gloo sums gradients in another
    # order than one process does (see test_protect_distributed.py)
    model_dtype: str = "float32"


class SimulatedGpu(TrainerCallback):
    def __init__(self, rows: int, from_step: int) -> None:
        self.rows, self.from_step = rows, from_step

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rows and state.global_step + 1 >= self.from_step \
                and args.per_device_train_batch_size > self.rows:
            raise torch.OutOfMemoryError(CUDA_OOM)


def demo_rows(model_dir: str, seq_len: int):
    from oomless.config import DataConfig
    from oomless.dataset.records import load_examples, load_tokenizer
    from oomless.runtime.tiny import demo_data_path

    tok = load_tokenizer(model_dir)
    examples = load_examples(demo_data_path(), tok, DataConfig(), seq_len).examples
    return tok, [{"input_ids": list(e.input_ids), "labels": list(e.labels),
                  "attention_mask": [1] * len(e)} for e in examples]


def main() -> None:
    torch.set_num_threads(1)
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        script, args = parser.parse_json_file(sys.argv[1])
    else:
        script, args = parser.parse_args_into_dataclasses()
    tok, rows = demo_rows(script.model_name_or_path, script.max_seq_length)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path,
                                                 dtype=getattr(torch, script.model_dtype))
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                      data_collator=DataCollatorForSeq2Seq(tok, padding=True),
                      callbacks=[SimulatedGpu(script.simulate_gpu_rows,
                                              script.simulate_from_step)])
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    main()
