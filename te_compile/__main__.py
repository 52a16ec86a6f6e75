"""``python -m te_compile`` is the ``te-compile`` command."""

from .cli import main

raise SystemExit(main())
