"""Files written by `oomless plan --out`, each loaded by its own tool's parser.

Checked with the real libraries installed here: DeepSpeed's DeepSpeedConfig,
transformers' TrainingArguments (which also runs its DeepSpeed integration's
consistency checks), accelerate's ClusterConfig and launch parser.
Not installable here, so checked against their argument names as data:
- LLaMA-Factory 0.9.5: field names and choices of its argument dataclasses,
  read from the wheels' sources, every 0.8.3-0.9.5 version (oomless/data/foreign_keys.json), plus a round
  trip through our own LLaMA-Factory reader;
- vLLM: EngineArgs field names, copied below from vllm/engine/arg_utils.py
  (vllm-project/vllm, a v0.11-era revision read with the project's code search).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from oomless.check import foreign_keys as K
from oomless.check.readers_lf import read_llamafactory
from oomless.check.sources import Source
from oomless.config import RunConfig, load_run_config
from oomless.memory.inference import needs_remote_code
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.planner.plan import KNOBS, _get
from oomless.planner.writers import DATA_PLACEHOLDER, write_plan_files

# vLLM EngineArgs fields (vllm/engine/arg_utils.py, dataclass EngineArgs), the ones
# a planner could write; the written vllm.json must use no other key.
VLLM_ENGINE_ARGS = frozenset({
    "model", "served_model_name", "tokenizer", "trust_remote_code", "dtype", "kv_cache_dtype",
    "seed", "max_model_len", "pipeline_parallel_size", "tensor_parallel_size",
    "data_parallel_size", "block_size", "enable_prefix_caching", "swap_space",
    "cpu_offload_gb", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "max_num_batched_tokens", "max_num_seqs", "max_logprobs", "revision", "quantization",
    "enforce_eager", "enable_lora", "max_loras", "max_lora_rank", "fully_sharded_loras",
    "max_cpu_loras", "lora_dtype", "enable_chunked_prefill", "generation_config",
    "disable_log_stats", "distributed_executor_backend",
})

CASES = {
    "qlora-1gpu": dict(model="glm-4-9b-chat", method="qlora", micro_batch_size=2, grad_accum=8,
                       grad_ckpt=True, attn="flash", seq_len=2048,
                       eval={"batch_size": 2, "steps": 100, "predict_with_generate": True,
                             "max_new_tokens": 256},
                       hardware={"gpu": "rtx-4090"}),
    "full-zero3-offload-2nodes": dict(model="qwen2.5-14b-instruct", method="full",
                                      micro_batch_size=2, grad_accum=4, zero=3, offload="all",
                                      grad_ckpt=True, seq_len=4096,
                                      hardware={"gpu": "a100-80gb", "gpus_per_node": 8,
                                                "nodes": 2}),
    "lora-zero2-fp16": dict(model="llama-2-7b", method="lora", precision="fp16", zero=2,
                            micro_batch_size=4, grad_accum=2, lora={"r": 8,
                            "targets": ["q_proj", "v_proj"]},
                            hardware={"gpu": "v100-32gb", "gpus_per_node": 4}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def written(request, tmp_path_factory):
    cfg = RunConfig.model_validate({"model": "x", **CASES[request.param]})
    spec = resolve_model(cfg.model).spec
    hw = cfg.hardware
    cluster = parse_gpu_arg(f"{hw.gpu} x{hw.gpus_per_node}", nodes=hw.nodes)
    out = tmp_path_factory.mktemp(request.param)
    paths = write_plan_files(out, cfg, spec, cluster, resolve_model(cfg.model).entry.hf_id,
                             resolve_model(cfg.model).entry.family)
    return cfg, out, {p.name: p for p in paths}


def _strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


def test_oomless_yaml_is_the_plan(written):
    cfg, out, files = written
    back = load_run_config(files["oomless.yaml"])
    assert back.data.train_file == DATA_PLACEHOLDER  # no --data: the placeholder README explains
    assert DATA_PLACEHOLDER in files["README.md"].read_text()
    remote = needs_remote_code(resolve_model(cfg.model).spec)
    assert back.training.trust_remote_code == remote
    assert back.replace(**{"data.train_file": None, "training.trust_remote_code": False}) == cfg
    assert not list(out.glob("*.tmp"))


def test_models_with_their_own_code_get_trust_remote_code_in_every_file(written):
    cfg, _out, files = written
    remote = needs_remote_code(resolve_model(cfg.model).spec)
    assert remote == (cfg.model == "glm-4-9b-chat")
    assert load_run_config(files["oomless.yaml"]).training.trust_remote_code == remote
    assert yaml.safe_load(files["llamafactory.yaml"].read_text()).get("trust_remote_code",
                                                                         False) == remote
    assert json.loads(files["vllm.json"].read_text())["trust_remote_code"] == remote


def test_warmup_is_never_a_fractional_warmup_steps(written):
    _cfg, _out, files = written
    for name in ("training_args.json", "llamafactory.yaml"):
        data = yaml.safe_load(files[name].read_text())
        assert "warmup_steps" not in data or isinstance(data["warmup_steps"], int)
        assert data.get("warmup_ratio") == 0.03 or data.get("warmup_steps")


def test_data_gives_the_train_file_and_whole_warmup_steps(tmp_path):
    from oomless.planner.datastats import DataProfile

    cfg = RunConfig.model_validate({"model": "qwen2.5-0.5b-instruct", "micro_batch_size": 4,
                                    "grad_accum": 2, "hardware": {"gpu": "rtx-4090"}})
    spec = resolve_model(cfg.model).spec
    data = tmp_path / "train.jsonl"
    data.write_text("")
    profile = DataProfile(file=str(data), source="test", lengths=(10,) * 800, records=800)
    paths = {p.name: p for p in write_plan_files(tmp_path / "out", cfg, spec,
                                                  parse_gpu_arg("rtx-4090"), "Qwen/x", "",
                                                  data=profile)}
    assert load_run_config(paths["oomless.yaml"]).data.train_file == str(data.resolve())
    args = json.loads(paths["training_args.json"].read_text())
    assert args["warmup_steps"] == 3 and "warmup_ratio" not in args  # 3% of 100 steps
    assert "YOUR_TRAINING_DATA" not in paths["README.md"].read_text()


def test_deepspeed_json_loads_in_deepspeed_with_no_auto(written):
    cfg, _out, files = written
    if cfg.zero == 0:
        assert "deepspeed.json" not in files
        return
    from deepspeed.runtime.config import DeepSpeedConfig

    data = json.loads(files["deepspeed.json"].read_text())
    assert "auto" not in set(_strings(data))
    ds = DeepSpeedConfig(data)
    assert ds.zero_optimization_stage == cfg.zero
    assert ds.train_micro_batch_size_per_gpu == cfg.micro_batch_size
    assert ds.gradient_accumulation_steps == cfg.grad_accum
    assert (ds.zero_config.offload_optimizer is not None) == (cfg.offload != "none")
    assert (ds.zero_config.offload_param is not None) == (cfg.offload == "all")
    assert ds.bfloat16_config.enabled == (cfg.precision == "bf16")
    assert ds.float16_config.enabled == (cfg.precision == "fp16")


def test_training_args_json_builds_transformers_training_arguments(written, monkeypatch):
    import torch
    from transformers import TrainingArguments

    cfg, _out, files = written
    kwargs = json.loads(files["training_args.json"].read_text())
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "warmup_ratio" in kwargs and "warmup_ratio" not in fields:
        # what the written README says for transformers after 5.14
        assert "write the same fraction as `warmup_steps`" in files["README.md"].read_text()
        kwargs["warmup_steps"] = kwargs.pop("warmup_ratio")
    if not torch.cuda.is_available():
        kwargs["use_cpu"] = True  # bf16/fp16 need a GPU; everything else is checked as is
    args = TrainingArguments(**kwargs)
    assert args.per_device_train_batch_size == cfg.micro_batch_size
    assert args.gradient_accumulation_steps == cfg.grad_accum
    assert bool(args.gradient_checkpointing) == cfg.grad_ckpt
    if cfg.zero:  # transformers' DeepSpeed integration accepted the pair (no mismatch)
        assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == cfg.zero


def test_accelerate_yaml_loads_as_cluster_config(written):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    cfg, _out, files = written
    cc = ClusterConfig.from_yaml_file(str(files["accelerate.yaml"]))
    assert cc.num_processes == cfg.world_size and cc.num_machines == cfg.hardware.nodes
    dests = {a.dest for a in launch_command_parser()._actions}
    assert set(cc.deepspeed_config) <= dests
    assert cc.distributed_type.value == ("DEEPSPEED" if cfg.zero else
                                         "MULTI_GPU" if cfg.world_size > 1 else "NO")


def test_llamafactory_yaml_uses_its_argument_names_and_reads_back(written):
    cfg, _out, files = written
    text = files["llamafactory.yaml"].read_text()
    data = yaml.safe_load(text)
    known = K.keys_of("llamafactory", *K.TRAINING_ARGUMENTS)
    assert set(data) <= known
    for key, choices in K.LLAMAFACTORY_CHOICES.items():
        assert data.get(key) is None or data[key] in choices, key
    src = Source("main", files["llamafactory.yaml"], text, "yaml", data, {})
    back = RunConfig.model_validate({**read_llamafactory(src, None).run,
                                     "hardware": cfg.hardware.model_dump()})
    skip = {"quantization.bits"} if cfg.method != "qlora" else set()
    if cfg.method == "full":
        skip |= {"lora.r", "lora.targets"}
    for key, _label, _w in KNOBS:
        if key not in skip:
            assert _get(back, key) == _get(cfg, key), key


def test_vllm_json_uses_engine_args_names(written):
    cfg, _out, files = written
    args = json.loads(files["vllm.json"].read_text())
    assert set(args) <= VLLM_ENGINE_ARGS
    assert args["max_model_len"] == cfg.seq_len + (cfg.eval.max_new_tokens or 512)
    assert 0 < args["gpu_memory_utilization"] <= 0.95
    assert args["enable_lora"] == (cfg.method != "full") and args["enable_prefix_caching"]
    if cfg.method != "full":
        assert args["max_lora_rank"] >= cfg.lora.r
        assert args["max_lora_rank"] in (1, 8, 16, 32, 64, 128, 256, 320, 512)


def test_vllm_json_splits_a_model_over_gpus_when_one_cannot_hold_it():
    from oomless.models.hardware import Cluster, get_gpu
    from oomless.planner.writers import vllm_engine_args

    spec = resolve_model("qwen2.5-32b").spec
    cfg = RunConfig(model="qwen2.5-32b", method="lora", seq_len=2048)
    args = vllm_engine_args(cfg, spec, Cluster(get_gpu("l40s"), 4), "Qwen/Qwen2.5-32B-Instruct")
    # TP 2 × DP 2 holds ~19 sequences per engine, TP 4 over six times as many: the decode
    # model (oomless.planner.serving) picks TP 4 despite its all-reduces over PCIe
    assert args["tensor_parallel_size"] * args.get("data_parallel_size", 1) == 4
    assert args["tensor_parallel_size"] == 4
    assert set(args) <= VLLM_ENGINE_ARGS
    one = vllm_engine_args(cfg, spec, Cluster(get_gpu("a100-80gb"), 4), "Qwen/Qwen2.5-32B-Instruct")
    assert "tensor_parallel_size" not in one  # fits one GPU: one GPU per engine


def test_llamafactory_yaml_keeps_modules_to_save_as_additional_target():
    """lora.modules_to_save is written under LLaMA-Factory's name and reads back."""
    from oomless.planner.writers import llamafactory_config

    cfg = RunConfig(model="qwen2.5-0.5b", lora={"modules_to_save": ["embed_tokens", "lm_head"]})
    spec = resolve_model("qwen2.5-0.5b").spec
    lf = llamafactory_config(cfg, spec, "Qwen/Qwen2.5-0.5B-Instruct", "qwen2", None)
    assert lf["additional_target"] == "embed_tokens,lm_head"
    text = yaml.safe_dump(lf)
    src = Source("main", "x.yaml", text, "yaml", yaml.safe_load(text), {})
    assert read_llamafactory(src, None).run["lora"]["modules_to_save"] == ["embed_tokens",
                                                                           "lm_head"]
    assert "additional_target" not in llamafactory_config(
        RunConfig(model="qwen2.5-0.5b"), spec, "Qwen/Qwen2.5-0.5B-Instruct", "qwen2", None)
