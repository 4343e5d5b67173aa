"""GPU catalog and cluster description (torch-free).

The catalog is data: ``oomless/data/gpus.json``. ``memory_bytes`` is the
total that ``cudaMemGetInfo``/``torch.cuda.mem_get_info`` reports for the card
(what nvidia-smi shows as "Total", minus nothing): the budget every process
on the card shares, CUDA context included.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources

from ..errors import UnknownGPUError


@dataclass(frozen=True)
class GPUSpec:
    name: str  # canonical id, e.g. "a100-80gb"
    display_name: str  # "NVIDIA A100-SXM4-80GB"
    memory_bytes: int
    bf16: bool
    bf16_tflops: float  # dense tensor-core peak, no sparsity
    fp16_tflops: float
    memory_bandwidth_gbs: float  # GB/s (10**9)
    compute_capability: str  # "8.0"
    interconnect: str  # "nvlink" | "pcie"
    interconnect_gbs: float  # per-GPU bandwidth one way, GB/s
    pcie_gbs: float  # host <-> device, one way, GB/s
    aliases: tuple[str, ...] = field(default=())
    source: str = ""

    @property
    def flash_attention(self) -> bool:
        """FlashAttention-2 needs Ampere or newer (compute capability ≥ 8.0)."""
        return float(self.compute_capability) >= 8.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        return d


@dataclass(frozen=True)
class Cluster:
    """The GPUs a run may use: ``gpus_per_node`` × ``nodes`` of one kind."""

    gpu: GPUSpec
    gpus_per_node: int = 1
    nodes: int = 1
    host_ram_bytes: int | None = None  # per node; None: not stated

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        n = f" x{self.gpus_per_node}" if self.gpus_per_node > 1 else ""
        nodes = f" x {self.nodes} nodes" if self.nodes > 1 else ""
        return f"{self.gpu.display_name}{n}{nodes}"

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu.name,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "host_ram_bytes": self.host_ram_bytes,
        }


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower()).removeprefix("nvidia-")


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPUSpec]:
    raw = json.loads(resources.files("oomless.data").joinpath("gpus.json").read_text())
    out: dict[str, GPUSpec] = {}
    for entry in raw["gpus"]:
        entry = dict(entry)
        entry["aliases"] = tuple(entry.get("aliases", ()))
        out[entry["name"]] = GPUSpec(**entry)
    return out


@lru_cache(maxsize=1)
def _gpu_index() -> dict[str, GPUSpec]:
    index: dict[str, GPUSpec] = {}
    for spec in gpu_catalog().values():
        for key in (spec.name, spec.display_name, *spec.aliases):
            index[_norm(key)] = spec
    return index


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by id or alias ("4090", "rtx-4090", "A100 80GB")."""
    index = _gpu_index()
    key = _norm(name)
    if key in index:
        return index[key]
    close = difflib.get_close_matches(key, list(index), n=5, cutoff=0.5)
    names = sorted({index[c].name for c in close})
    hint = f" Closest: {', '.join(names)}." if names else ""
    raise UnknownGPUError(
        f"unknown GPU '{name}'.{hint} Run `oomless gpus` for the full list."
    )


_COUNT = re.compile(r"^(?P<name>.+?)\s*[x×*]\s*(?P<count>\d+)$", re.IGNORECASE)
_LEADING_COUNT = re.compile(r"^(?P<count>\d+)\s*[x×*]\s*(?P<name>.+)$", re.IGNORECASE)


def _split_count(text: str) -> tuple[GPUSpec, int]:
    """(gpu, count) from "4090x8", "a100-40gb x8", "H100 * 4", "8xA100" or a bare name."""
    for pattern in (_COUNT, _LEADING_COUNT):
        match = pattern.match(text)
        if match and match.group("name").lower() != "rt":  # "rtx4090" is a name, not "rt" x 4090
            try:
                return get_gpu(match.group("name")), int(match.group("count"))
            except UnknownGPUError:
                continue
    return get_gpu(text), 1


def parse_gpu_arg(text: str, nodes: int = 1, host_ram_bytes: int | None = None) -> Cluster:
    """Parse ``--gpu`` values: "4090", "4090x8", "a100-40gb x8", "H100 * 4", "8xA100"."""
    text = text.strip()
    gpu, count = _split_count(text)
    if count < 1 or nodes < 1:
        raise UnknownGPUError(f"--gpu '{text}' with {nodes} node(s): counts must be at least 1")
    return Cluster(gpu=gpu, gpus_per_node=count, nodes=nodes, host_ram_bytes=host_ram_bytes)
