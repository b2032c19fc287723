"""coati-kto: KTO training on ColossalAI, from one CPU to many GPU nodes."""

__version__ = "0.1.0"

# Before anything imports bitsandbytes or ColossalAI: their import-time torch.compile calls wait for a first call.
from coati_kto import import_compiles as _import_compiles  # noqa: E402

_import_compiles.install()

# Before anything imports transformers: its lazy modules' import structures come from a disk cache.
from coati_kto import import_structures as _import_structures  # noqa: E402

_import_structures.install()
