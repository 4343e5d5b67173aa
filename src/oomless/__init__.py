"""oomless: fine-tune large language models without running out of GPU memory.

The pure core (this package, outside ``oomless.runtime``) imports neither
torch nor transformers.
"""

__version__ = "0.1.0"
