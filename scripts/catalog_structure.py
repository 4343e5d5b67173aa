"""Write the "structure" of catalog entries whose family the formulas do not know.

    python scripts/catalog_structure.py NAME [NAME ...]

Builds each entry's stored config.json with transformers on the meta device
(oomless.runtime.meta.meta_spec), and stores the ModelSpec it reads in
src/oomless/data/models.json, so that the catalog stays torch-free;
tests/test_catalog_params.py rebuilds it and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oomless.fileio import write_atomic
from oomless.models.catalog import get_entry
from oomless.runtime.meta import meta_spec

MODELS = Path(__file__).resolve().parents[1] / "src" / "oomless" / "data" / "models.json"


def structure_of(name: str) -> dict:
    entry = get_entry(name)
    spec = meta_spec(entry.config, entry.name, where=f"catalog entry '{entry.name}'")
    d = spec.to_dict()
    for key in ("name", "aliases", "quantization"):  # the catalog reads quantization itself
        d.pop(key)
    return d


def main(names: list[str]) -> None:
    data = json.loads(MODELS.read_text(encoding="utf-8"))
    for item in data["models"]:
        if item["name"] in names:
            item["structure"] = structure_of(item["name"])
    write_atomic(MODELS, json.dumps(data, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
