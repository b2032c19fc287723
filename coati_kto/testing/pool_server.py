"""What the worker pool's fork server imports once (coati_kto.testing.worker_pool): the project's ColossalAI
patches first, then the modules named in ``COATI_KTO_POOL_PRELOAD`` (``pkg.*``: every submodule), in the order a
rank imports them. Every rank forked from the server starts with them loaded.

No process group and no launcher variables here: the ranks join their group after the fork.
"""

from __future__ import annotations

import gc
import os

gc.disable()  # while importing (coati_kto.runtime.startup: full collections over the growing heap cost seconds)

import torch  # noqa: E402

from coati_kto.parallel import upstream  # noqa: E402
from coati_kto.testing.worker_pool import PRELOAD_ENV, _preload  # noqa: E402

torch.set_num_threads(1)
# The patches before any preloaded module binds a patched function by name, as in a rank (init_distributed).
upstream.apply()
_preload([name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name])
gc.collect()
gc.freeze()  # the imports' objects stay in shared pages in every forked rank, untouched by its collections
gc.enable()
