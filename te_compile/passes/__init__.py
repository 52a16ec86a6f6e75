"""FX graph rewrites, one file per pass, each with its site finder.

The backend runs them in order (``te_compile.backend.PASSES``, ``run_passes``) under settings it
resolved first (``settings.py``); README.md beside this file gives the order, what each pass hands the
next, and the path of one linear through the package.
"""

__all__: list[str] = []
