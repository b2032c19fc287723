"""The parallel side: which ranks hold what, and everything that knows ColossalAI's plugins.

``distributed`` (process groups, ``ParallelLayout``, reductions over sums and counts, rank-0 helpers), ``plan``
(``ParallelPlan``: the plugin, boosting, the reference built the policy's way, who clips), ``grad_norm`` (the
gradient norm from ZeRO's and Gemini's own stores), ``fp32_kept`` (what stays fp32 after the bf16 cast),
``optimizers`` (the run's AdamW) and ``upstream`` (ColossalAI 0.5.0 made usable here, each change with why).
Plugin internals are read here and nowhere else; the trainer asks the plan.

May import: config, families, errors.
"""
