"""``python -m coati_kto`` is the ``coati-kto`` command."""

import sys

from coati_kto.cli import entry

sys.exit(entry())
