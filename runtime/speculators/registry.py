"""The speculator registry: ``speculator_type`` string (as stored in a checkpoint's
``config.json``) -> module class.

Its own module so that imports flow one way: the package and :mod:`.checkpoint` both read the
registry from here, and this module imports only the model definitions.
"""

from __future__ import annotations

from torch import nn

from .eagle import Eagle3Head, EagleHead
from .medusa import MedusaHeads

__all__ = ["SPECULATOR_REGISTRY"]

SPECULATOR_REGISTRY: dict[str, type[nn.Module]] = {cls.type: cls for cls in (EagleHead, Eagle3Head, MedusaHeads)}
