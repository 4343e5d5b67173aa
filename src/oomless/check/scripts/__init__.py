"""Reading the launch scripts and training scripts people run: a shell reading with a
real shell parser (oomless.check.scripts.shell), the launchers and the frameworks
they start (oomless.check.scripts.launchers), flags by meaning from a sourced table
(oomless.check.scripts.flags), Python training scripts read with ``ast``
(oomless.check.scripts.pyscript) and torchtune recipes (oomless.check.scripts.torchtune).
Nothing is ever executed.
"""
