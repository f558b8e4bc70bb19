"""``python -m sparsecal ...`` (and ``torchrun ... -m sparsecal ...``): the ``sparsecal`` command,
the same as ``python -m sparsecal.cli``."""
from sparsecal.cli import run

run()
