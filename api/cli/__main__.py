"""``python -m dynabatch.api.cli``: the same entry point as the ``dynabatch`` command."""

from dynabatch.api.cli import main

main()
