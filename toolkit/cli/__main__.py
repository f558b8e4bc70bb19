"""``python -m sparsecal.cli ...``: the same as the ``sparsecal`` command."""
from sparsecal.cli import run

run()
