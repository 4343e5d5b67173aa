"""torchtune: ``tune run <recipe> --config <yaml>`` and its YAML, read through the
``_component_`` names of the model, the optimizer and the dataset."""

from __future__ import annotations

from ...errors import ConfigError
from ..sources import Reading, Source


def read_tune_launch(src: Source, model: str | None) -> Reading:
    launch = src.command.launch
    raise ConfigError(f"{src.path}:{launch.command.line}: `tune run {launch.program}`: "
                      "torchtune recipes are not supported yet; check the config with "
                      "--model, --method and --seq-len written as an oomless.yaml")
