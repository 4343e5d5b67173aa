"""``oomless diagnose``: explain out-of-memory events in a log or traceback (torch-free).

Pipeline: clean the lines (:mod:`.text`) → find events (:mod:`.parse`,
:mod:`.vllm`, :mod:`.host`) → attach traceback phase (:mod:`.phase`) → read
run hints (:mod:`.hints`) → classify causes (:mod:`.causes`) → price fixes
(:mod:`.fixes`, :mod:`.serving`) with the estimator when a run configuration
is given (:mod:`.predict`).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import RunConfig
from ..models.hardware import Cluster
from ..units import fmt_bytes
from .causes import Situation, classify
from .events import (
    CUDA_OOM,
    GPU_KINDS,
    HOST_KINDS,
    NCCL_OOM,
    NO_EVENT,
    PROCESS_KILLED,
    VLLM_KINDS,
    VLLM_SAMPLER,
    Diagnosis,
    Finding,
    Fix,
    OomEvent,
    RunHints,
)
from .fixes import FixContext, host_ram_needed, training_fixes
from .hints import context_notes, read_hints
from .host import find_host_events
from .parse import find_gpu_events
from .phase import phase_from_context, phase_of, traceback_before
from .predict import Predictor, choose_cluster
from .repair import repair
from .serving import serving_fixes
from .text import LogText
from .view import gpu_view
from .vllm import find_vllm_events, find_vllm_fragments, vllm_profile

__all__ = ["NO_EVENT", "Diagnosis", "diagnose_log", "diagnose_text"]

MAX_FINDINGS = 50  # a retry loop can print thousands of identical errors
_LIBRARIES = ("bitsandbytes", "deepspeed", "vllm", "peft", "accelerate", "transformers")
_NCCL_MERGE_LINES = 30
_ECHO_LINES = 200  # a re-raised or logged copy of the same error follows within a traceback's length
# A retry loop repeats its error within a traceback or two; further apart, the same message
# is a new failure (the run was started again)
_REPEAT_LINES = 2 * _ECHO_LINES


def _with_traceback(log: LogText, event: OomEvent) -> OomEvent:
    index = event.line - 1
    frames = traceback_before(log, index, event.rank, log.pid_at(index))
    phase = phase_of(frames)
    if phase == "unknown":
        phase = event.phase
    if phase == "unknown" and event.kind in HOST_KINDS:
        phase = phase_from_context(log, index)
    library = next((lib for f in reversed(frames) for lib in _LIBRARIES if f"/{lib}/" in f.path),
                   event.library)
    labels = tuple(f.label() for f in frames)
    return replace(event, phase=phase, frames=labels, library=library)


def _key(event: OomEvent) -> tuple:
    numbers = tuple(sorted(event.numbers.items()))
    return (event.kind, event.rank, numbers, event.message if not numbers else "")


def _same_stream(a: OomEvent, b: OomEvent) -> bool:
    return a.rank is None or b.rank is None or a.rank == b.rank


def _merge(events: list[OomEvent], log: LogText) -> list[OomEvent]:
    """Identical messages of one rank in a row (a retry loop) count once; one NCCL
    failure's lines make one event. Identical messages far apart (a run that failed
    again after a restart) stay separate events."""
    merged: dict[tuple, OomEvent] = {}
    last: dict[tuple, int] = {}  # log line of the latest occurrence merged into a key
    at = lambda ev: log.raw_number(ev.line)  # noqa: E731
    for e in sorted(events, key=lambda ev: ev.line):
        if e.kind == NCCL_OOM:
            near = [k for k, o in merged.items() if o.kind == NCCL_OOM and _same_stream(o, e)
                    and at(e) - at(o) <= _NCCL_MERGE_LINES]
            if near:
                prev = merged[near[-1]]
                merged[near[-1]] = replace(
                    prev, numbers={**e.numbers, **prev.numbers},
                    rank=prev.rank if prev.rank is not None else e.rank,
                    device=prev.device if prev.device is not None else e.device,
                    phase=prev.phase if prev.phase != "unknown" else e.phase,
                    frames=prev.frames or e.frames)
                continue
        key = _key(e)
        if key in merged and at(e) - last[key] <= _REPEAT_LINES:
            merged[key] = replace(merged[key], occurrences=merged[key].occurrences + 1)
            last[key] = at(e)
            continue
        if key in merged:  # the same message again, much later: its own event
            merged[(*key, e.line)] = merged.pop(key)
        merged[key] = e
        last[key] = at(e)
    return _fold_echoes(sorted(merged.values(), key=lambda ev: ev.line), log)


def _echo_of(e: OomEvent, o: OomEvent, log: LogText) -> bool:
    """``e`` repeats ``o``: same kind and process, close by, and no numbers of its own."""
    return (o.kind == e.kind and o.rank == e.rank
            and abs(log.raw_number(e.line) - log.raw_number(o.line)) <= _ECHO_LINES
            and (not e.numbers or (not o.numbers and e.source == o.source)))


def _fold_echoes(events: list[OomEvent], log: LogText) -> list[OomEvent]:
    out: list[OomEvent] = []
    for e in events:
        twin = next((i for i, o in enumerate(out) if _echo_of(e, o, log)), None)
        if twin is not None:
            out[twin] = replace(out[twin], occurrences=out[twin].occurrences + e.occurrences)
            continue
        bare = next((i for i, o in enumerate(out) if _echo_of(o, e, log)), None)
        if bare is not None:  # the numbers came after their echo: keep the numbers
            out[bare] = replace(e, occurrences=e.occurrences + out[bare].occurrences)
            continue
        out.append(e)
    return out


def _with_vllm_profile(log: LogText, event: OomEvent) -> OomEvent:
    """vLLM's start-up failures carry the memory profile it logged before them."""
    if event.kind not in VLLM_KINDS:
        return event
    through = sum(len(line.text) + 1 for line in log.lines[: event.line])  # its line too
    profile = {f"profile_{k}": v for k, v in vllm_profile(log.text, through).items()}
    return replace(event, numbers={**profile, **event.numbers})


# A log that shows a vLLM engine starting and no training loop is a serving log: its
# GPU errors get serving fixes even without a vLLM frame in their traceback
_SERVING = ("Initializing a V1 LLM engine", "Initializing an LLM engine", "vLLM API server",
            "vllm.entrypoints", "EngineCore", "vllm serve ", "(VllmWorker", "(APIServer pid=",
            "multiproc_executor.py")
_TRAINING = ("trainer.py", "training_step", ".backward(", "'loss':", "optimizer.step")


def _serving_log(text: str) -> bool:
    return any(m in text for m in _SERVING) and not any(m in text for m in _TRAINING)


def _fold_sampler(events: list[OomEvent], log: LogText) -> list[OomEvent]:
    """vLLM re-raises the sampler's torch OOM as "CUDA out of memory occurred when warming
    up sampler": one failure, read as the sampler event with the torch message's numbers."""
    out = list(events)
    for s in [e for e in events if e.kind == VLLM_SAMPLER]:
        inner = [e for e in out if e.kind in GPU_KINDS and 0 <= log.raw_number(s.line)
                 - log.raw_number(e.line) <= _ECHO_LINES and _same_stream(e, s)]
        if inner:
            at = out.index(s)
            out[at] = replace(s, numbers={**inner[-1].numbers, **s.numbers},
                              processes=inner[-1].processes, frames=inner[-1].frames)
            out = [e for e in out if e not in inner]
    return out


def find_events(log: LogText, serving: bool = False) -> tuple[list[OomEvent], list[str]]:
    """Every event of the log; ``serving``: the log is a serving engine's (its GPU errors
    get serving fixes, see :func:`_serving_log`)."""
    vllm = list(find_vllm_events(log))
    raw = [*repair(log, list(find_gpu_events(log))), *vllm, *find_vllm_fragments(log, vllm),
           *find_host_events(log)]
    events = _merge([_with_vllm_profile(log, _with_traceback(log, e)) for e in raw], log)
    events = _fold_sampler(events, log)
    if serving:
        events = [replace(e, library="vllm") if e.kind in GPU_KINDS and e.library is None
                  else e for e in events]
    notes: list[str] = []
    gpu = [e for e in events if e.kind in GPU_KINDS]
    collateral = [e for e in events if e.kind == PROCESS_KILLED and e.source != "kernel"]
    if gpu and collateral:
        # Launchers kill the other ranks once one fails; those kills are not host OOMs.
        events = [e for e in events if e not in collateral]
        notes.append(f"{len(collateral)} process kill(s) after the GPU error were left out: the "
                     "launcher stops the other ranks once one fails")
    if len(events) > MAX_FINDINGS:
        notes.append(f"{len(events)} events found; the first {MAX_FINDINGS} are shown")
        events = events[:MAX_FINDINGS]
    return events, notes


# Model-state categories of an estimate (result.py breakdown), the part ZeRO shards.
_STATE_KEYS = ("weights", "gradients", "optimizer", "master_weights", "grad_partition_fp32")


def _replica_states(spec, cfg: RunConfig | None, cluster: Cluster | None) -> tuple[int, int] | None:
    """Model states per GPU as configured and with ZeRO-3, when N GPUs run plain data
    parallelism (ZeRO-1/2 already shard by choice)."""
    if cfg is None or spec is None or cluster is None or cfg.world_size < 2 or cfg.zero != 0:
        return None
    from ..errors import ConfigError
    from ..memory import estimate_training

    def states(c: RunConfig) -> int:
        phase = estimate_training(spec, c, cluster).breakdown["optimizer"]
        return sum(v for k, v in phase.items() if k in _STATE_KEYS)

    try:
        sharded = cfg.replace(zero=3, offload="none")
    except ConfigError:  # e.g. QLoRA, which ZeRO-3 does not shard here
        return None
    return states(cfg), states(sharded)


def _situation(events: list[OomEvent], hints: RunHints, cfg: RunConfig | None, spec,
               cluster: Cluster | None = None) -> Situation:
    tokens: tuple[int, ...] = ()
    vocab = None
    if cfg is not None and spec is not None:
        from ..memory.training import llm_seq_len

        s = llm_seq_len(spec, cfg)
        tokens = (cfg.micro_batch_size * s, cfg.eval_batch_size * s)
        vocab = spec.vocab_size
    return Situation(
        events=tuple(events), hints=hints,
        zero_stage=cfg.zero if cfg else hints.zero_stage,
        micro_batch_size=cfg.micro_batch_size if cfg else hints.micro_batch_size,
        eval_batch_size=cfg.eval_batch_size if cfg else hints.eval_batch_size,
        logits_tokens=tokens, vocab_size=vocab,
        world_size=cfg.world_size if cfg else (hints.world_size or 1),
        replica_states=_replica_states(spec, cfg, cluster),
        vision_heads=spec.vision.num_heads if spec is not None and spec.vision else None,
    )


def _fixes_for(event: OomEvent, causes, s: Situation, predictor: Predictor | None) -> tuple[Fix, ...]:
    ctx = FixContext(event, gpu_view(event), s.hints, predictor)
    out: list[Fix] = []
    if event.kind in HOST_KINDS and predictor is not None:
        needed = host_ram_needed(predictor)
        out += [needed] if needed else []
    seen: set[str] = set()
    serving = event.library == "vllm" or event.kind in VLLM_KINDS
    for cause in causes:
        own = serving_fixes(event, cause, s)
        for fix in [*own, *([] if serving else training_fixes(cause, ctx))]:
            if fix is not None and fix.code not in seen and fix.code not in {f.code for f in out}:
                seen.add(fix.code)
                out.append(fix)
    # Training-preserving fixes first; among them those predicted to fit.
    return tuple(sorted(out, key=lambda f: (not f.keeps_training, f.fits is False)))


def _calibration_note(event: OomEvent, predictor: Predictor) -> str | None:
    """When the estimator says the failing run fits, say how far off it is."""
    view = gpu_view(event)
    predicted = predictor.peak()
    if predicted is None or view.used_bytes is None or view.requested_bytes is None:
        return None
    seen = view.used_bytes - view.others_bytes + view.requested_bytes
    if predicted >= seen:
        return None
    return (f"the estimator predicts {fmt_bytes(predicted)} for the configuration that ran out of "
            f"memory, but the log shows at least {fmt_bytes(seen)} needed: predictions may be "
            f"{fmt_bytes(seen - predicted)} low for this run")


def diagnose_log(source: str, cfg: RunConfig | None = None,
                 cluster: Cluster | None = None) -> Diagnosis:
    """:func:`diagnose_text` of a log file ('-': standard input) of any size, read with
    bounded memory (:mod:`.stream`: a long log is read as the lines around its errors)."""
    from .stream import excerpt_notes, read_excerpt

    ex = read_excerpt(source)
    d = diagnose_text(ex.text, cfg, cluster, line_numbers=None if ex.whole else ex.numbers)
    return replace(d, notes=(*excerpt_notes(ex), *d.notes))


def diagnose_text(text: str, cfg: RunConfig | None = None, cluster: Cluster | None = None,
                  line_numbers: list[int] | None = None) -> Diagnosis:
    """Find every out-of-memory event in ``text`` and explain it.

    ``cfg``: the run configuration; with it every fix carries the estimator's
    predicted peak. ``cluster``: the GPUs to predict for (default: the
    configuration's, else the total printed in the message). ``line_numbers``:
    the log line of each line of ``text`` when it is an excerpt.
    """
    log = LogText(text, line_numbers)
    events, notes = find_events(log, _serving_log(text))
    first = None
    if events:
        first = sum(len(line.text) + 1 for line in log.lines[: events[0].line - 1])
    hints = read_hints(log.text, first)
    notes.extend(context_notes(log.text))
    spec = None
    if cfg is not None:
        from ..models.catalog import resolve_model

        spec = resolve_model(cfg.model).spec
    totals = [int(e.numbers["total_bytes"]) for e in events if e.numbers.get("total_bytes")]
    if cluster is None and (cfg is not None or totals):
        cluster = choose_cluster(cfg, None, totals[0] if totals else None)
    s = _situation(events, hints, cfg, spec, cluster)
    findings = []
    cache: dict = {}
    for event in events:
        predictor = None
        if cfg is not None and spec is not None and cluster is not None and event.library != "vllm":
            predictor = Predictor(spec, cfg, cluster, gpu_view(event).others_bytes, cache)
            if event.kind == CUDA_OOM and (note := _calibration_note(event, predictor)) and note not in notes:
                notes.append(note)
        causes = classify(event, s)
        shown = replace(event, line=log.raw_number(event.line))  # the log's own line number
        findings.append(Finding(shown, causes, _fixes_for(event, causes, s, predictor)))
    return Diagnosis(
        findings=tuple(findings), hints=hints, notes=tuple(notes),
        gpu=cluster.gpu.display_name if cluster else None,
        gpu_memory_bytes=cluster.gpu.memory_bytes if cluster else None,
    )
