"""What a rank does around the training loop to keep a run operable: checks before anything heavy
(``preflight``), a clean stop on SIGTERM/SIGINT/SIGUSR1 ending in a checkpoint (``signals``), and a heartbeat
that stops a rank whose peers are gone (``watchdog``).

May import: parallel, data, config, errors (not the trainer).
"""
