"""The frameworks: ``dcp/`` (torch.distributed.checkpoint storage writer and reader), ``lightning.py``
(``FlashwriteCheckpointIO``), ``transformers.py`` (the Trainer). Reached by
users through the faces ``flashwrite.dcp``, ``flashwrite.lightning`` and ``flashwrite.transformers``. May
import everything below it; nothing in the library imports it."""
