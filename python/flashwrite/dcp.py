"""``flashwrite.dcp``: the public face of the DCP integration (``integrations/dcp/``)."""

from .integrations.dcp import *  # noqa: F401,F403
from .integrations.dcp import __all__  # noqa: F401
