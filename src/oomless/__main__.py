"""`python -m oomless` runs the CLI."""

from .cli import run

run()
