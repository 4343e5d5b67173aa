"""Fuzzing every command's inputs (hypothesis, bounded): garbage bytes, non-UTF-8,
wrong types, NaN/Infinity, huge and negative numbers, alias bombs, hostile paths.

Every example runs the real CLI in-process and asserts: the exit code is 0/1 (a
legal input: an answer) or 2 (a message), never a traceback or an internal error;
no input and no file outside the output is touched; the memory Python allocates
stays bounded (tracemalloc). Where garbage is legal (a config.json with odd numbers
that happen to be valid), the answer is not nonsense (positive sizes).
"""

from __future__ import annotations

import hashlib
import json
import re
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomless.cli import main
from oomless.config import RunConfig
from oomless.models.catalog import find_entry

FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
MEMORY_BOUND_MIB = 256

HOSTILE_TEXT = ["[bold]x[/]", "run[link=file:x]y[/link]", "../../../etc/passwd", "/dev/null",
                "a" * 300, "\u2028", "\x00", "llama-3.1-8b-instruct", "4090", "auto", "-1",
                "1e308", "NaN", "ｆｕｌｌ", "lora"]
HOSTILE_NUMBERS = st.one_of(
    st.integers(-2**70, 2**70), st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -0.0, 0.5]))
SCALARS = st.one_of(st.none(), st.booleans(), HOSTILE_NUMBERS,
                    st.text(max_size=20), st.sampled_from(HOSTILE_TEXT))
RUN_KEYS = sorted(set(RunConfig.model_fields) | {f"{s}.{k}" for s, m in (
    ("lora", "LoraConfig"), ("training", "TrainingConfig"), ("hardware", "HardwareConfig"),
    ("data", "DataConfig"), ("eval", "EvalConfig")) for k in getattr(
    __import__("oomless.config", fromlist=[m]), m).model_fields})
FOREIGN_KEYS = ["model_name_or_path", "finetuning_type", "stage", "cutoff_len", "deepspeed",
                "per_device_train_batch_size", "gradient_accumulation_steps", "bf16",
                "zero_optimization", "train_micro_batch_size_per_gpu", "data_config",
                "training_args", "peft_config", "max_input_length", "output_dir"]


def _nest(flat: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[leaf] = value
    return out


VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
RUN_DOCS = st.dictionaries(st.sampled_from(RUN_KEYS), VALUES, max_size=8).map(_nest)
FOREIGN_DOCS = st.dictionaries(st.sampled_from(FOREIGN_KEYS + RUN_KEYS), VALUES, max_size=8)


def _bomb(levels: int) -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join(
            [f"*{chr(96 + i)}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _mutate(text: str, edits: list[tuple[int, bytes]]) -> bytes:
    data = bytearray(text.encode())
    for at, chunk in edits:
        at %= len(data) + 1
        data[at:at + len(chunk)] = chunk
    return bytes(data)


VALID_LF = ("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nstage: sft\ndo_train: true\n"
            "finetuning_type: lora\nlora_target: all\ndataset: alpaca_en_demo\n"
            "template: qwen\ncutoff_len: 2048\nper_device_train_batch_size: 2\n"
            "gradient_accumulation_steps: 8\nlearning_rate: 1.0e-4\nbf16: true\n"
            "output_dir: saves/qwen\n")
EDITS = st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=4)),
                 min_size=1, max_size=6)
YAML_FILES = st.one_of(
    st.binary(max_size=300),
    RUN_DOCS.map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode()),
    FOREIGN_DOCS.map(lambda d: yaml.safe_dump(d).encode()),
    EDITS.map(lambda e: _mutate(VALID_LF, e)),
    st.integers(3, 12).map(lambda n: _bomb(n).encode()),
    st.sampled_from([b"\xff\xfe\x00m\x00o", "model: caf\xe9\n".encode("latin-1"),
                     b"[" * 5000, b"- " * 5000 + b"x", b"a: &a [*a]\n"]),
)


class Sandbox:
    """inputs/ (read by the command), out/ (where it may write), outside/ (a bystander)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("inputs", "out", "outside"):
            (root / name).mkdir(parents=True, exist_ok=True)
        (root / "outside" / "keep.txt").write_text("untouched")

    def input(self, name: str, data: bytes) -> Path:
        path = self.root / "inputs" / name
        path.write_bytes(data)
        return path

    def snapshot(self) -> dict[str, str]:
        files = [p for d in ("inputs", "outside") for p in (self.root / d).rglob("*")]
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
                for p in files}


def run_cli(box: Sandbox, argv: list[str], capsys) -> tuple[int, str, str]:
    """One command in-process: exit code, stdout, stderr; checks the invariants."""
    before = box.snapshot()
    tracemalloc.start()
    try:
        code = main([str(a) for a in argv])
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    out, err = capsys.readouterr()
    assert code in (0, 1, 2), (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 2:  # one message line first (more lines list each problem found)
        assert err.startswith("oomless") and len(err) < 8000, err
    assert box.snapshot() == before, "an input or a bystander file changed"
    assert peak < MEMORY_BOUND_MIB, f"{peak:.0f} MiB allocated"
    return code, out, err


@pytest.fixture
def box(tmp_path_factory):
    return lambda: Sandbox(tmp_path_factory.mktemp("fuzz"))


@FUZZ
@given(data=YAML_FILES, command=st.sampled_from(["estimate", "check", "plan", "train"]))
def test_yaml_inputs(box, capsys, data, command):
    sandbox = box()
    path = sandbox.input("config.yaml", data)
    argv = {"estimate": ["estimate", path, "--gpu", "4090"],
            "check": ["check", path, "--gpu", "4090"],
            "plan": ["plan", path, "--gpu", "4090", "--out", sandbox.root / "out"],
            "train": ["train", path, "--output-dir", sandbox.root / "out" / "run",
                      "--no-progress"]}[command]
    code, _, _ = run_cli(sandbox, argv, capsys)
    if command == "train":
        assert code == 2  # a fuzzed config never names a model that is on this machine


HF_FIELDS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
             "intermediate_size", "vocab_size", "head_dim", "max_position_embeddings",
             "tie_word_embeddings", "num_local_experts", "num_experts_per_tok", "model_type",
             "torch_dtype", "sliding_window"]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(HF_FIELDS), SCALARS, min_size=1, max_size=4),
       raw=st.booleans())
def test_config_json_values(box, capsys, changes, raw):
    sandbox = box()
    config = {**find_entry("qwen2.5-7b-instruct").config, **changes}
    text = json.dumps(config, allow_nan=True)
    path = sandbox.input("config.json", text.encode() if not raw else text.encode()[:200])
    code, out, err = run_cli(sandbox, ["estimate", path, "--gpu", "h100", "--json"], capsys)
    if code in (0, 1):  # a legal config.json: a model with a size, not "0 params, FITS"
        est = json.loads(out)
        assert est["param_count"] > 0 and est["device_peak_bytes"] > 0


JSONL_LINES = st.one_of(
    st.binary(max_size=60),
    st.dictionaries(st.sampled_from(["step", "peak_bytes", "allocated_bytes", "loss", "event",
                                     "message", "instruction", "output", "prompt",
                                     "messages"]), VALUES, max_size=4)
    .map(lambda d: json.dumps(d, allow_nan=True).encode()),
)
JSONL_FILES = st.lists(JSONL_LINES, max_size=6).map(lambda lines: b"\n".join(lines))


@FUZZ
@given(memlog=JSONL_FILES, events=JSONL_FILES, estimate=st.one_of(
    st.binary(max_size=100), VALUES.map(lambda v: json.dumps(v, allow_nan=True).encode())))
def test_report_inputs(box, capsys, memlog, events, estimate):
    pytest.importorskip("plotly")
    sandbox = box()
    run = sandbox.root / "inputs" / "run"
    run.mkdir()
    (run / "memlog.jsonl").write_bytes(memlog)
    (run / "events.jsonl").write_bytes(events)
    (run / "estimate.json").write_bytes(estimate)
    run_cli(sandbox, ["report", run, "--out", sandbox.root / "out" / "r.html"], capsys)
    run_cli(sandbox, ["report", run / "estimate.json", "--out", sandbox.root / "out" / "e.html"],
            capsys)


@FUZZ
@given(data=JSONL_FILES, suffix=st.sampled_from([".jsonl", ".json", ".parquet"]))
def test_dataset_inputs(box, capsys, data, suffix):
    sandbox = box()
    path = sandbox.input("data" + suffix, data)
    run_cli(sandbox, ["plan", "qwen2.5-0.5b-instruct", "--gpu", "4090", "--data", path],
            capsys)
    code, _, _ = run_cli(sandbox, ["infer", path, "-m", sandbox.root / "inputs" / "no-model",
                                   "-o", sandbox.root / "out" / "o.jsonl", "--backend", "hf"],
                         capsys)
    assert code == 2


@FUZZ
@given(data=st.binary(max_size=2000))
def test_diagnose_any_bytes(box, capsys, data):
    sandbox = box()
    run_cli(sandbox, ["diagnose", sandbox.input("log.txt", data)], capsys)


NUMERIC_FLAGS = {
    "estimate": ["--batch-size", "--grad-accum", "--seq-len", "--lora-r", "--lora-dropout",
                 "--nodes", "--host-ram-gb", "--eval-batch-size", "--max-new-tokens",
                 "--images"],
    "plan": ["--nodes", "--seq-len", "--effective-batch", "--headroom", "--top",
             "--host-ram-gb", "--images", "--lora-r"],
    "check": ["--nodes", "--seq-len", "--images", "--headroom", "--host-ram-gb"],
    "infer": ["--cutoff-len", "--max-new-tokens", "--temperature", "--top-p", "--chunk-size",
              "--batch-size", "--limit", "--gpu-used-gb", "--gpu-memory-utilization"],
}
NUMBER_TEXT = st.one_of(HOSTILE_NUMBERS.map(str), st.sampled_from(
    ["", "x", "0x10", "1_000", "inf", "-inf", "nan", "1e999", ",,,", "--"]))


@pytest.mark.slow  # 30 CLI runs, about 8 s: with the longer checks (make test-slow)
@FUZZ
@given(command=st.sampled_from(sorted(NUMERIC_FLAGS)), data=st.data())
def test_numeric_flags(box, capsys, command, data):
    sandbox = box()
    flags = data.draw(st.lists(st.sampled_from(NUMERIC_FLAGS[command]), min_size=1,
                               max_size=3, unique=True))
    values = [data.draw(NUMBER_TEXT) for _ in flags]
    head = {"estimate": ["estimate", "qwen2.5-7b-instruct", "--gpu", "4090"],
            "plan": ["plan", "qwen2.5-7b-instruct", "--gpu", "4090"],
            "check": ["check", sandbox.input("lf.yaml", VALID_LF.encode()), "--gpu", "4090"],
            "infer": ["infer", "--engine-args", "-m", "qwen2.5-7b-instruct", "--gpu", "4090"]}
    argv = head[command] + [f"{f}={v}" for f, v in zip(flags, values, strict=True)]
    code, out, _ = run_cli(sandbox, argv, capsys)
    if command == "infer" and code == 0:  # a computed vLLM utilization is a fraction
        for u in re.findall(r'"gpu_memory_utilization": ([0-9.e+-]+)', out):
            assert 0 < float(u) <= 1


PATHS = st.one_of(st.sampled_from(["/dev/null", "{root}/outside", "{root}/outside/keep.txt",
                                   "{root}/inputs/lf.yaml", "{root}/out/" + "n" * 300,
                                   "{root}/out/[bold]x[/]", "{root}/out/a\nb",
                                   "{root}/out/missing/deeper/f", "{root}/out"]),
                  st.text(alphabet="ab/[]._-", min_size=1, max_size=12)
                  .map(lambda t: "{root}/out/" + t))


@FUZZ
@given(path=PATHS, command=st.sampled_from(["plan", "report", "infer", "score"]))
def test_hostile_output_paths(box, capsys, path, command):
    pytest.importorskip("plotly")
    sandbox = box()
    lf = sandbox.input("lf.yaml", VALID_LF.encode())
    target = path.format(root=sandbox.root)
    run = sandbox.root / "inputs" / "run"
    run.mkdir()
    (run / "memlog.jsonl").write_text(json.dumps({"step": 1, "peak_bytes": [1]}) + "\n")
    data = sandbox.input("d.jsonl", b'{"prompt": "hi"}\n')
    argv = {"plan": ["plan", lf, "--gpu", "4090", "--out", target],
            "report": ["report", run, "--out", target],
            "infer": ["infer", data, "-m", sandbox.root / "no-model", "-o", target],
            "score": ["score", data, "-m", sandbox.root / "no-model", "-o",
                      sandbox.root / "out" / "s.jsonl", "--kept", target]}[command]
    run_cli(sandbox, argv, capsys)
