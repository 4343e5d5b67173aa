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
    memory_inferred: bool = False  # no card of this kind printed its total: a sibling's figure
    specs_unverified: bool = False  # compute/bandwidth figures not checked against a datasheet
    assumption: str = ""  # what a generic (size-only) GPU assumes

    @property
    def assumptions(self) -> list[str]:
        """What an estimate on this GPU takes on trust (for MemoryEstimate.assumptions)."""
        out = [self.assumption] if self.assumption else []
        if self.memory_inferred:
            memory = self.source.split("|")[0].strip()
            out.append(f"{self.display_name}: total memory not measured on this card, {memory}")
        return out

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


# Words that name the vendor or product line but never tell two cards apart.
_NOISE_WORDS = {"nvidia", "geforce", "tesla"}
_UNIT_WORDS = {"g": "gb", "gib": "gb"}  # "80G", "80GiB" and "80GB" name the same card
_PRODUCT_LINES = {"rtx", "gtx"}  # "2080 ti" names the RTX 2080 Ti


def _tokens(text: str) -> tuple[str, ...]:
    """Lower-case words and numbers of a GPU name: "RTX2080Ti" -> ("rtx", "2080", "ti")."""
    parts = re.findall(r"[a-z]+|\d+(?:\.\d+)?", text.strip().lower())
    return tuple(_UNIT_WORDS.get(p, p) for p in parts if p not in _NOISE_WORDS)


def _norm(name: str) -> str:
    """Lookup key: separators, case, vendor words and letter/number boundaries do not matter."""
    return "-".join(_tokens(name))


def _keys(name: str) -> set[str]:
    key = _norm(name)
    head, _, rest = key.partition("-")
    return {key, rest} if head in _PRODUCT_LINES and rest else {key}


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
        for name in (spec.name, spec.display_name, *spec.aliases):
            for key in _keys(name):
                owner = index.setdefault(key, spec)
                if owner.name != spec.name:
                    raise ValueError(f"gpus.json: '{name}' names both {owner.name} and {spec.name}")
    return index


# --gpu 12gb / 24GiB / generic-12gb: a GPU known only by its memory total.
_SIZE = re.compile(r"^(?:generic-?)?(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>gb|gib|g)$", re.IGNORECASE)
# What a GPU given only by its size is assumed to be: an Ampere-class data-centre
# card (compute capability 8.0: bf16 and FlashAttention-2) with the NVIDIA A10's
# throughput (125 TFLOP/s dense bf16, 600 GB/s, PCIe Gen4; A10 datasheet), which
# only the planner's speed ranking uses.
GENERIC_COMPUTE_CAPABILITY = "8.0"
GENERIC_TFLOPS = 125.0
GENERIC_BANDWIDTH_GBS = 600.0
GENERIC_PCIE_GBS = 25.0


def generic_gpu(memory_bytes: int, name: str | None = None, display_name: str | None = None,
                source: str = "the size the user gave") -> GPUSpec:
    """A GPU known only by its total memory (see GENERIC_* for what is assumed)."""
    label = display_name or f"GPU with {memory_bytes / 2**30:.2f} GiB"
    return GPUSpec(
        name=name or f"generic-{memory_bytes}b", display_name=label, memory_bytes=memory_bytes,
        bf16=True, bf16_tflops=GENERIC_TFLOPS, fp16_tflops=GENERIC_TFLOPS,
        memory_bandwidth_gbs=GENERIC_BANDWIDTH_GBS, compute_capability=GENERIC_COMPUTE_CAPABILITY,
        interconnect="pcie", interconnect_gbs=GENERIC_PCIE_GBS, pcie_gbs=GENERIC_PCIE_GBS,
        memory_inferred=False, source=f"memory: {source} | compute: generic (assumed)",
        assumption=(f"{label}: a generic GPU of that total (what torch.cuda.mem_get_info reports; "
                    "a card sold as 24 GB reports about 23.6 GiB), assumed compute capability "
                    f"{GENERIC_COMPUTE_CAPABILITY} with bf16 and FlashAttention-2 and an A10's "
                    "speed for the planner; name a catalog GPU (`oomless gpus`) for its real figures"),
    )


def _sized_gpu(text: str) -> GPUSpec | None:
    match = _SIZE.match(text.replace(" ", ""))
    if not match:
        return None
    value, unit = float(match.group("value")), match.group("unit").lower()
    if value <= 0:
        raise UnknownGPUError(f"--gpu '{text}': a GPU size must be above 0 (e.g. 12gb or 24GiB)")
    unit = "GiB" if unit == "gib" else "GB"
    size = round(value * (2**30 if unit == "GiB" else 10**9))
    label = f"{match.group('value')} {unit}"
    return generic_gpu(size, name=f"generic-{match.group('value')}{unit.lower()}",
                       display_name=f"generic {label} GPU")


def close_gpus(text: str, n: int = 5) -> list[str]:
    """Catalog GPUs whose names are close to ``text``. Numbers matter: a name
    that shares none of the numbers the user typed is never suggested
    ("2080ti" does not suggest the B200)."""
    query = _norm(text)
    numbers = {t for t in query.split("-") if t[:1].isdigit() and t != "0"}
    scored: dict[str, float] = {}
    for key, spec in _gpu_index().items():
        shared = numbers & {t for t in key.split("-") if t[:1].isdigit()}
        if numbers and not shared:
            continue
        score = difflib.SequenceMatcher(None, query, key).ratio() + len(shared)
        if score >= 0.5:
            scored[spec.name] = max(score, scored.get(spec.name, 0.0))
    return sorted(scored, key=lambda name: (-scored[name], name))[:n]


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by id or alias ("4090", "rtx-4090", "A100 80GB", "2080ti") or
    give a generic one by its size ("12gb", "24GiB")."""
    sized = _sized_gpu(name.strip())
    if sized is not None:
        return sized
    index = _gpu_index()
    for key in _keys(name):
        if key in index:
            return index[key]
    if not _norm(name):
        raise UnknownGPUError("--gpu: empty GPU name; e.g. --gpu 4090 or --gpu 24gb")
    close = close_gpus(name)
    hint = f" Closest: {', '.join(close)}." if close else ""
    raise UnknownGPUError(
        f"unknown GPU '{name}'.{hint} Run `oomless gpus` for the full list, or give the "
        "card's memory instead of a name (--gpu 12gb, --gpu 24GiB, --gpu-memory-gb 12)."
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
