"""``flashwrite.transformers``: the public face of the Trainer integration (``integrations/transformers.py``)."""

from .integrations.transformers import *  # noqa: F401,F403
from .integrations.transformers import __all__  # noqa: F401
