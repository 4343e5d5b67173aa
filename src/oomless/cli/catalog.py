"""`oomless models` and `oomless gpus`: the built-in catalogs."""

from __future__ import annotations

import argparse

ORDER = 90


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in model catalog")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_models)
    g = sub.add_parser("gpus", help="list the built-in GPU catalog")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=run_gpus)


def run_models(args: argparse.Namespace) -> int:
    import json

    from ..models.catalog import list_models
    from ..units import fmt_count

    entries = list_models()
    if args.json:
        print(json.dumps([_model_row(e) for e in entries], indent=2))
        return 0
    from rich.table import Table

    from ._render import console

    t = Table(title=f"{len(entries)} models (use the name or any alias)")
    for col in ("name", "params", "layers", "hidden", "heads/kv", "vocab", "kind", "config",
                "aliases"):
        t.add_column(col)
    for e in entries:
        s = e.spec
        kind = "moe" if s.is_moe else "dense"
        if s.vision:
            kind += "+vision"
        t.add_row(e.name, fmt_count(s.param_count), str(s.num_layers), str(s.hidden_size),
                  f"{s.num_heads}/{s.num_kv_heads}", str(s.vocab_size), kind, e.provenance,
                  ", ".join(e.aliases[:3]))
    console().print(t)
    return 0


def _model_row(entry) -> dict:
    d = entry.spec.to_dict()
    d["param_count"] = entry.spec.param_count
    d["aliases"] = list(entry.aliases)
    d["provenance"] = entry.provenance
    d["source"] = entry.source
    return d


def run_gpus(args: argparse.Namespace) -> int:
    import json

    from ..models.hardware import gpu_catalog
    from ..units import fmt_bytes

    gpus = list(gpu_catalog().values())
    if args.json:
        print(json.dumps([g.to_dict() for g in gpus], indent=2))
        return 0
    from rich.table import Table

    from ._render import console

    t = Table(title=f"{len(gpus)} GPUs (--gpu NAME or NAMExCOUNT, or a size: --gpu 24gb; "
                    "* memory total taken from a sibling card)")
    for col in ("name", "memory", "bf16", "bf16 TFLOP/s", "GB/s", "link", "aliases"):
        t.add_column(col)
    for g in gpus:
        t.add_row(g.name, fmt_bytes(g.memory_bytes) + ("*" if g.memory_inferred else ""),
                  "yes" if g.bf16 else "no",
                  f"{g.bf16_tflops:g}", f"{g.memory_bandwidth_gbs:g}",
                  f"{g.interconnect} {g.interconnect_gbs:g}", ", ".join(g.aliases[:3]))
    console().print(t)
    return 0
