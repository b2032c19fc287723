"""The recipes, each read top to bottom: ``train.py`` (``coati-kto train``), ``export.py`` (``coati-kto export``) and
``precompute.py`` (``coati-kto precompute``). They share one setup: ``setup.py`` (the process group, the data
and tokenizer, the plan and plugin, the loaders: ``setup_training``, ``setup_export``, ``load_run_data``),
``components.py`` (the boosted models, optimizer and schedule, and the KTOTrainer) and ``save.py`` (the final
model and its card). Only the recipes and the CLI read the whole ``Config``: they hand each part its sections."""
