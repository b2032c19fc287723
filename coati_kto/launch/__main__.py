"""``python -m coati_kto.launch``: torchrun with signal forwarding and one-line failures (``torchrun.py``)."""

import sys

from coati_kto.launch.torchrun import main

sys.exit(main())
