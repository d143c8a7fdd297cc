"""fairseq models of this package; importing a module registers its architectures."""

import importlib
import pkgutil

from ..extras import require_fairseq

require_fairseq("fairseq_softtopk.models (the plugin's models)")  # an ImportError naming the two install commands

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
