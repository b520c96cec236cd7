"""``python -m torchdist_magic``: the ``torchdist`` command (``cli``) where no console script is
installed."""

from .cli import console

console()
