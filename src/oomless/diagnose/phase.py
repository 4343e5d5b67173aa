"""The training or serving phase an event happened in, read from its traceback.

Frames are read from the Python traceback printed before the error line
(``File "…", line N, in func`` and the code line under it) or from a rich
traceback (``/path/file.py:176 in to``). The most specific phase wins: a
generation inside an evaluation is "generation", a forward inside
``from_pretrained`` is "model_load".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .text import LogText

_PY_FRAME = re.compile(r'File "(?P<path>[^"]+)", line \d+, in (?P<func>[\w<>.]+)')
_RICH_FRAME = re.compile(r"(?P<path>\S+\.py):\d+ in (?P<func>[\w<>.]+)")
# a frame line cut at its start (a pasted fragment): 'line 3479, in cross_entropy'
_CUT_FRAME = re.compile(r"^\s*line \d+, in (?P<func>[\w<>.]+)\s*$")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_ERROR_LINE = re.compile(r"[\w.]+(?:Error|Exception|Exit|Interrupt):")
_MAX_LOOKBACK = 600  # lines; long tracebacks (DeepSpeed, vLLM) run to a few hundred


@dataclass(frozen=True)
class Frame:
    path: str
    func: str
    code: str  # the source line printed under the frame, if any

    def label(self) -> str:
        return f"{self.path}:{self.func}"


PHASES = (
    "vllm_sampler_warmup", "vllm_cuda_graphs", "vllm_profile_run", "vllm_startup", "checkpoint_save", "zero_init", "model_load",
    "generation", "evaluation", "optimizer_step", "backward", "forward", "data_loading",
)


def _has(frames: list[Frame], funcs: tuple[str, ...] = (), paths: tuple[str, ...] = (),
         code: tuple[str, ...] = ()) -> bool:
    for f in frames:
        if f.func in funcs or any(p in f.path for p in paths) or any(c in f.code for c in code):
            return True
    return False


def _vllm(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if "vllm" in f.path]


def _rules(frames: list[Frame]) -> dict[str, bool]:
    """Which phases the frames show (several may; PHASES orders them by specificity)."""
    vllm = _vllm(frames)
    return {
        # vllm/v1/worker/gpu_model_runner.py: _dummy_sampler_run (inside profile_run) and
        # capture_model (CUDA graphs, after the KV cache is allocated)
        "vllm_sampler_warmup": _has(vllm, ("_dummy_sampler_run",)),
        "vllm_cuda_graphs": _has(vllm, ("capture_model", "_capture_cudagraphs", "capture"),
                                 ("vllm/compilation/cuda_graph.py",))
        or _has(frames, ("capture_begin", "graph"), ("torch/cuda/graphs.py",)),
        "vllm_profile_run": _has(vllm, ("profile_run", "_dummy_run", "_dummy_sampler_run",
                                        "determine_available_memory", "determine_num_available_blocks")),
        "vllm_startup": _has(vllm, ("load_model", "_initialize_kv_caches", "initialize_from_config",
                                    "init_device", "initialize_cache",
                                    "_check_enough_kv_cache_memory", "check_enough_kv_cache_memory")),
        "checkpoint_save": _has(frames, ("save_model", "_save_checkpoint", "save_pretrained",
                                         "save_checkpoint", "_save", "save_state", "consolidated_16bit_state_dict"),
                                ("torch/serialization.py",)),
        "zero_init": _has(frames, ("_configure_zero_optimizer", "_create_fp16_partitions_with_defragmentation",
                                   "_setup_for_real_optimizer", "_create_fp16_sub_groups"),
                          ("deepspeed/runtime/zero/partition_parameters.py",))
        or _has([f for f in frames if "deepspeed/runtime/zero" in f.path], ("__init__",)),
        "model_load": _has(frames, ("from_pretrained", "_load_pretrained_model", "load_state_dict",
                                    "load_checkpoint_in_model", "dispatch_model", "_load_state_dict_into_meta_model",
                                    "load_shard_file", "get_peft_model", "prepare_model_for_kbit_training"))
        or _has([f for f in frames if "bitsandbytes/nn" in f.path], ("cuda", "to", "_quantize")),
        "generation": _has(frames, ("generate", "_sample", "greedy_search", "sample", "beam_search",
                                    "_beam_search", "_assisted_decoding", "contrastive_search")),
        "evaluation": _has(frames, ("evaluate", "evaluation_loop", "prediction_step", "predict",
                                    "prediction_loop", "_evaluate", "eval_step", "validation_step"))
        or any(f.func.startswith(("evaluat", "validat")) for f in frames),
        "optimizer_step": _has(frames, ("step", "_step", "_optimizer_step", "optimizer_step"),
                               ("torch/optim/", "bitsandbytes/optim/"))
        and _has(frames, (), ("torch/optim/", "bitsandbytes/optim/", "deepspeed/runtime/", "accelerate/optimizer.py"),
                 ("optimizer.step", ".step()")),
        "backward": _has(frames, ("backward", "_engine_run_backward", "run_backward"), ("torch/autograd/",),
                         ("loss.backward", ".backward(")),
        "forward": _has(frames, ("forward", "_call_impl", "_wrapped_call_impl", "compute_loss", "training_step",
                                 "cross_entropy", "loss_function")),
        "data_loading": _has(frames, ("_next_data", "__getitem__", "_worker_loop", "collate_fn",
                                      "default_collate")),
    }


def phase_of(frames: list[Frame]) -> str:
    shown = _rules(frames)
    for phase in PHASES:
        if shown[phase]:
            return phase
    return "unknown"


def _frames_at(log: LogText, indices: list[int]) -> list[Frame]:
    frames: list[Frame] = []
    for i in indices:
        text = log.lines[i].text
        m = _PY_FRAME.search(text) or _RICH_FRAME.search(text)
        cut = None if m else _CUT_FRAME.match(text)
        if m:
            frames.append(Frame(m.group("path").replace("\\", "/"), m.group("func"), ""))
        elif cut:
            frames.append(Frame("", cut.group("func"), ""))
        elif frames and not frames[-1].code and text.strip():
            last = frames[-1]
            frames[-1] = Frame(last.path, last.func, text.strip()[:200])
    return frames


_CARET = re.compile(r"^\s*[~^]+\s*$")
# a tqdm bar another thread printed into the traceback ("Loading checkpoint shards:  0%| …")
_PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+\s*\[")


def _is_frame(text: str) -> bool:
    return bool(_PY_FRAME.search(text) or _RICH_FRAME.search(text) or _CUT_FRAME.match(text))


def _frame_block(log: LogText, index: int, rank: int | None, pid: int | None) -> list[int]:
    """The lines right above ``index`` that are frames, their code lines and carets: a
    traceback pasted without its "Traceback (most recent call last)" header."""
    block: list[int] = []
    i = index - 1
    while i >= 0 and index - i <= _MAX_LOOKBACK:
        if not log.same_stream(i, rank, pid):
            i -= 1
            continue
        text = log.lines[i].text
        j = i - 1
        while j > 0 and _PROGRESS.search(log.lines[j].text):
            j -= 1
        above = log.lines[j].text if j >= 0 else ""
        if not text.strip() and block == [] and index - i <= 2:
            i -= 1  # a blank line between the frames and the error line
            continue
        if _PROGRESS.search(text):
            i -= 1
            continue
        if _is_frame(text) or _CARET.match(text) or (text.strip() and _is_frame(above)):
            block.append(i)
            i -= 1
            continue
        break
    return sorted(block)


def traceback_before(log: LogText, index: int, rank: int | None, pid: int | None) -> list[Frame]:
    """Frames of the traceback that ends at line ``index`` (outermost first), same stream
    only; without a "Traceback" header, the frames printed right above the error line."""
    lowest = max(0, index - _MAX_LOOKBACK)
    for i in range(index, lowest - 1, -1):
        if not log.same_stream(i, rank, pid):
            continue
        text = log.lines[i].text
        if _TRACEBACK.search(text):
            return _frames_at(log, [j for j in range(i + 1, index) if log.same_stream(j, rank, pid)])
        if i < index and _ERROR_LINE.match(text):
            break  # the end of an earlier, unrelated traceback
    return _frames_at(log, _frame_block(log, index, rank, pid))


_CONTEXT_HINTS = (
    ("model_load", re.compile(r"Loading checkpoint shards|Loading safetensors checkpoint shards|Loading weights")),
    ("checkpoint_save", re.compile(r"Saving model checkpoint to|Saving checkpoint|saving checkpoint")),
    ("evaluation", re.compile(r"\*\*\*\*\* Running (?:Evaluation|Prediction) \*\*\*\*\*|Evaluating:")),
    ("vllm_profile_run", re.compile(r"Memory profiling takes|Starting profile run")),
)


def phase_from_context(log: LogText, index: int, lines: int = 15) -> str:
    """A phase from the last progress lines before ``index`` (for kills without a traceback)."""
    for i in range(index - 1, max(-1, index - 1 - lines), -1):
        text = log.lines[i].text
        for phase, pattern in _CONTEXT_HINTS:
            if pattern.search(text):
                return phase
    return "unknown"
