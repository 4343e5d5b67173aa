"""``oomless infer`` and ``oomless score``: batch generation and LLM-judge scoring of a JSONL.

vLLM on a GPU with engine arguments from the memory model, transformers
elsewhere; results are appended per chunk, so a rerun continues where a crash
or an OOM stopped.
"""

from __future__ import annotations

import argparse

from ._options import POSITIVE, UTILIZATION, add_vllm_parallel_options, count, number

ORDER = 80


def _common(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("data", metavar="DATA.jsonl", nargs="?",
                   help="records: prompt, alpaca, sharegpt or messages (.jsonl/.json/.parquet)")
    p.add_argument("--model", "-m", required=True,
                   help="local model folder or a model id in the Hugging Face cache")
    p.add_argument("--out", "-o", metavar="OUT.jsonl",
                   help="results, appended per chunk; a rerun skips what is there")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder (PEFT)")
    p.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto",
                   help="auto: vLLM when installed and a GPU is visible, else transformers")
    p.add_argument("--cutoff-len", type=POSITIVE, default=1024,
                   help="prompt tokens kept (longer prompts keep their end; default 1024)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=max_new_tokens,
                   help=f"tokens generated per record (default {max_new_tokens})")
    p.add_argument("--temperature", type=number(0.0, 100.0), default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=UTILIZATION, default=1.0)
    p.add_argument("--seed", type=count(0, 2**63 - 1), default=42)
    p.add_argument("--chunk-size", type=POSITIVE, default=64,
                   help="records per written chunk (default 64)")
    p.add_argument("--batch-size", type=POSITIVE,
                   help="transformers: sequences per generate call (default: from the "
                   "memory model on a GPU, 8 on CPU)")
    p.add_argument("--max-num-seqs", type=POSITIVE, default=256, help="vLLM: concurrent sequences")
    p.add_argument("--gpu-memory-utilization", type=UTILIZATION,
                   help="vLLM: override the utilization the memory model computes")
    p.add_argument("--dtype", default="auto", help="auto, bf16, fp16 or fp32")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="feed the text as is, without the tokenizer's chat template")
    p.add_argument("--system", help="a system message for every prompt")
    p.add_argument("--id-field", help="key records by this field instead of their line")
    p.add_argument("--limit", type=POSITIVE, help="process at most N new records this run")
    p.add_argument("--overwrite", action="store_true", help="start OUT again from scratch")
    p.add_argument("--force", action="store_true",
                   help="OUT (or --kept) exists but was not written by oomless: replace it, "
                   "keeping the old file as FILE.orig")
    p.add_argument("--trust-remote-code", action="store_true")
    add_vllm_parallel_options(p)
    p.add_argument("--engine-args", action="store_true",
                   help="print the vLLM engine arguments the memory model computes, and stop")
    p.add_argument("--gpu", help="with --engine-args: size for this catalog GPU instead of "
                   "the one NVML sees")
    p.add_argument("--gpu-used-gb", type=number(0.0), default=0.0,
                   help="with --gpu: GiB other processes already use on it")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "infer", help="batch generation over a dataset (vLLM or transformers), resumable",
        description="Generate an answer for every record; rows: line, predict, label.")
    _common(p, max_new_tokens=512)
    p.set_defaults(func=_run_infer)
    s = subparsers.add_parser(
        "score", help="LLM-judge scoring 1-5 of a dataset; keep the good records",
        description="Score every record 1-5 with a judge model, write every score to OUT and "
        "the records scoring at least --min-score to --kept (data cleaning).")
    _common(s, max_new_tokens=16)
    s.add_argument("--min-score", type=count(1, 5), default=4, help="keep records scoring ≥ this (1-5)")
    s.add_argument("--kept", metavar="FILE", help="kept records (default OUT.kept.jsonl)")
    s.add_argument("--judge-prompt", metavar="FILE", help="judge prompt template with "
                   "{instruction} and {response} (or {record}); default: a 1-5 rubric")
    s.set_defaults(func=_run_score)


def _options(args: argparse.Namespace):
    from ..runtime.infer.core import InferOptions

    return InferOptions(
        model=args.model, adapter=args.adapter, backend=args.backend,
        cutoff_len=args.cutoff_len, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        chunk_size=args.chunk_size, batch_size=args.batch_size, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
        chat_template=args.chat_template, system=args.system,
        trust_remote_code=args.trust_remote_code, id_field=args.id_field, limit=args.limit,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )


def _need_files(args: argparse.Namespace) -> None:
    from ..errors import ConfigError

    if not args.data or not args.out:
        raise ConfigError(f"`oomless {args.command}` needs a dataset and --out OUT.jsonl "
                          "(only --engine-args runs without them)")


def _print_engine_args(args: argparse.Namespace, opts) -> int:
    from ..errors import GPUUnavailableError
    from ..models.catalog import resolve_model
    from ..models.hardware import get_gpu
    from ..runtime.infer.vllm import device_memory, engine_args, gpu_spec_for
    from ..units import GiB, fmt_bytes

    if args.gpu:
        gpu, used = get_gpu(args.gpu), int(args.gpu_used_gb * GiB)
        if used >= gpu.memory_bytes:
            from ..errors import ConfigError

            raise ConfigError(f"--gpu-used-gb {args.gpu_used_gb:g}: {gpu.display_name} has "
                              f"{fmt_bytes(gpu.memory_bytes)} in all; give what other "
                              "processes use, less than that")
    else:
        try:
            name, total, used = device_memory()
        except GPUUnavailableError as err:
            raise GPUUnavailableError(f"{err}; or size for a catalog GPU with --gpu NAME") \
                from None
        gpu = gpu_spec_for(name, total)
    engine, budget = engine_args(opts, resolve_model(opts.model).spec, gpu, used)
    from ._render_infer import CUDAGRAPH_WARNING, budget_verdict, engine_args_text

    print(engine_args_text(engine))
    print(f"{gpu.display_name}: {fmt_bytes(gpu.memory_bytes)}, {fmt_bytes(used)} used by others; "
          f"budget {fmt_bytes(budget.budget_bytes)} = weights {fmt_bytes(budget.weights_bytes)} "
          f"+ profile peak {fmt_bytes(budget.profile_peak_bytes)} + non-torch "
          f"{fmt_bytes(budget.non_torch_bytes)} + KV cache {fmt_bytes(budget.kv_cache_bytes)}")
    from rich.console import Console

    out = Console(highlight=False, soft_wrap=True)
    out.print(budget_verdict(budget))
    if not budget.cudagraphs_fit:
        out.print(CUDAGRAPH_WARNING)
    return 0


def _progress():
    import sys

    def report(done: int, todo: int) -> None:
        print(f"  {done}/{todo} records written", file=sys.stderr, flush=True)

    return report


def _summary_line(summary) -> str:
    engine = summary.engine
    how = ", ".join(f"{k}={v}" for k, v in engine.items()
                    if k in {"backend", "device", "batch_size", "gpu_memory_utilization",
                             "max_model_len", "max_num_seqs", "kv_blocks"})
    line = (f"{summary.output}: {summary.written} written, {summary.skipped_done} already done, "
            f"{summary.errors} bad records, of {summary.total} ({how})")
    if summary.kept is not None:
        line += (f"\nkept {summary.kept} records → {summary.kept_file}"
                 f" ({summary.unparsed} judge replies had no score)")
    return line


def _run_infer(args: argparse.Namespace) -> int:
    from ..runtime.infer.jobs import infer_file

    opts = _options(args)
    if args.engine_args:
        return _print_engine_args(args, opts)
    _need_files(args)
    summary = infer_file(args.data, args.out, opts, overwrite=args.overwrite,
                         on_chunk=_progress(), force=args.force)
    print(_summary_line(summary))
    return 0


def _run_score(args: argparse.Namespace) -> int:
    from ..runtime.infer.core import DEFAULT_JUDGE_PROMPT, check_judge_template
    from ..runtime.infer.jobs import score_file

    opts = _options(args)
    if args.engine_args:
        return _print_engine_args(args, opts)
    _need_files(args)
    template = DEFAULT_JUDGE_PROMPT
    if args.judge_prompt:
        from ..errors import ConfigError
        from ..fileio import read_text

        template = read_text(args.judge_prompt, "--judge-prompt", ConfigError, 2**20)
        check_judge_template(template, f"'{args.judge_prompt}'")
    summary = score_file(args.data, args.out, opts, min_score=args.min_score, kept=args.kept,
                         template=template, overwrite=args.overwrite, on_chunk=_progress(),
                         force=args.force)
    print(_summary_line(summary))
    return 0
