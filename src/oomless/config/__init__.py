"""RunConfig: one fine-tuning run, as written in ``oomless.yaml``.

The same file is read by ``oomless estimate FILE``, ``oomless check``,
``oomless train`` and written by ``oomless plan``. Memory-relevant knobs are
top-level keys (they map 1:1 to ``estimate``'s flags); the data and training
loop live in their own sections. Every key is documented in docs/config.md.
"""

from __future__ import annotations

from ..yamlfile import (  # noqa: F401 (the YAML reader, imported from here by callers)
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    load_yaml_with_lines,
    parse_yaml_with_lines,
)
from .run import (
    RunConfig,
    build_run_config,
    dump_run_config,
    format_validation_error,
    load_run_config,
    set_dotted,
)
from .sections import (
    Attention,
    DataConfig,
    DeepSpeedConfig,
    EvalConfig,
    FsdpConfig,
    HardwareConfig,
    InjectOOM,
    LoraConfig,
    Method,
    Offload,
    Optimizer,
    Precision,
    QuantConfig,
    QuantStorage,
    Reference,
    RlhfConfig,
    Stack,
    StackOptions,
    Stage,
    TrainingConfig,
    VisionConfig,
)

__all__ = ["Attention", "DataConfig", "DeepSpeedConfig", "EvalConfig", "FsdpConfig", "HardwareConfig",
           "InjectOOM", "LoraConfig", "Method", "Offload", "Optimizer", "Precision",
           "QuantConfig", "QuantStorage", "Reference", "RlhfConfig", "RunConfig", "Stack",
           "StackOptions", "Stage", "TrainingConfig", "VisionConfig", "build_run_config",
           "dump_run_config", "format_validation_error", "load_run_config", "set_dotted"]
