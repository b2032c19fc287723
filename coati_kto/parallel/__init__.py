"""The parallel side: which ranks hold what, and everything that knows ColossalAI's plugins.

``distributed`` (process groups, ``ParallelLayout``, reductions over sums and counts, rank-0 helpers), ``plan``
(``ParallelPlan``: the run's parallel settings and its backend), ``backends`` (a ``ParallelBackend`` per plugin,
registered by name: building and boosting, the reference built the policy's way, the gradient-norm source, what
it refuses), ``grad_norm`` (the gradient norm from ``p.grad`` or ZeRO's stores), ``fp32_kept`` (what stays fp32
after the bf16 cast), ``optimizers`` (the run's AdamW), ``sequence`` (sequence parallelism's building blocks,
not wired into a run yet) and ``upstream`` (ColossalAI 0.5.0 made usable here, each change with why). Plugin
internals are read here and nowhere else; the rest of the code asks the backend.

May import: config, families, errors.
"""
