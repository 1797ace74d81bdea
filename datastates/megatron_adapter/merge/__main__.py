"""``python -m datastates.megatron_adapter.merge --source DIR --output DIR``: see `run`."""
import sys

from .run import main

sys.exit(main())
