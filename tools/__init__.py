"""Command-line tools (``tools/*.py``) and the small libraries behind them.

Entry points stay thin: they parse arguments, build a typed config and call a library module here.
Run them as ``python tools/<name>.py`` or ``python -m tools.<name>`` from the repository root.
"""
