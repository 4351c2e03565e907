"""``python -m service.cli``: the same entry point as the ``dynabatch`` command."""

from service.cli import main

main()
