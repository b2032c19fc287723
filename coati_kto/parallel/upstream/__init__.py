"""ColossalAI 0.5.0 made usable here, one concern per module; ``apply()`` installs them all (every rank).

``fixes`` (its bugs, on every device), ``cpu`` (the accelerator and ZeRO patch without CUDA, the plugins'
device kwargs), ``noise`` (known third-party notices silenced) and ``policy_routing`` (shardformer's automatic
policy choice routed to the project's policies). Each change says why, next to it.
"""

from __future__ import annotations

from coati_kto.parallel.upstream.cpu import cuda_available, install_cpu_support
from coati_kto.parallel.upstream.fixes import fix_bugs_on_every_device
from coati_kto.parallel.upstream.noise import quiet_known_logs, quiet_known_warnings
from coati_kto.parallel.upstream.policy_routing import route_policies_to_the_project

_applied = False


def apply() -> None:
    """Silence the known notices; fix ColossalAI's bugs and route its policies; without CUDA, also install the CPU
    support (the GPU path runs ColossalAI otherwise untouched). Idempotent; every rank."""
    global _applied
    quiet_known_warnings()
    quiet_known_logs()
    if _applied:
        return
    fix_bugs_on_every_device()
    route_policies_to_the_project()
    _applied = True
    if not cuda_available():
        install_cpu_support()
