"""Launcher side: what runs before the ranks exist. ``torchrun`` wraps torchrun (signal forwarding, one-line
failures, exit 75 for a clean stop; ``python -m coati_kto.launch``), ``colossalai`` wraps ``colossalai run``
for hostfile jobs (``python -m coati_kto.colossalai_launch``).

May import: runtime.signals (exit codes), parallel.distributed (environment), errors. Never the trainer.
"""
