"""``flashwrite.lightning``: the public face of the Lightning integration (``integrations/lightning.py``)."""

from .integrations.lightning import *  # noqa: F401,F403
from .integrations.lightning import __all__  # noqa: F401
