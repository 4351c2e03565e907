"""``python -m dynabatch.service.cli``: the same entry point as the ``dynabatch`` command."""

from dynabatch.service.cli import main

main()
