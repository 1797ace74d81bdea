"""Our Megatron-LM-style training package, layered on the installed megatron-core.

There is deliberately no ``megatron/__init__.py``: ``megatron`` is a namespace package shared with
the megatron-core wheel, and an ``__init__`` of ours would hide ``megatron.core``.
"""
