"""``python -m jacutil.bench``: see ``cli.py``."""

from .cli import main

main()
