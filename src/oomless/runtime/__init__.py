"""The only part of oomless that imports torch, transformers, peft and friends.

Import its modules lazily (inside functions) from the CLI and the core.
"""
