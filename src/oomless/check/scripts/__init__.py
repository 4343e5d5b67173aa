"""Reading the launch scripts and training scripts people run: a shell reading with a
real shell parser (oomless.check.scripts.shell), the launchers and the frameworks
they start (oomless.check.scripts.launchers), flags by meaning from a sourced table
(oomless.check.scripts.flags), Python training scripts read with ``ast``
(oomless.check.scripts.pyscript) and torchtune recipes (oomless.check.scripts.torchtune);
a fix is written back into the flags the script writes (oomless.check.scripts.edits).
Nothing is ever executed.
"""
