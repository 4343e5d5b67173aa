"""The pure core and the CLI's estimate path must not import torch (fast start-up)."""

import json
import subprocess
import sys

CODE = """
import sys, json
import oomless, oomless.config, oomless.models.spec, oomless.models.catalog, oomless.models.hardware
import oomless.memory, oomless.api, oomless.cli
from oomless.cli import main
import contextlib, io
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = main(["estimate", "qwen2.5-7b", "--method", "qlora", "--gpu", "4090", "--json"])
heavy = sorted(m for m in ("torch", "transformers", "peft", "accelerate", "deepspeed", "numpy")
               if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def test_core_and_estimate_cli_leave_torch_out():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0, "heavy": []}
