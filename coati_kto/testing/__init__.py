"""Test support shipped with the package (tests, benchmarks and the applications use it): tiny models and
tokenizers of every family built offline (``tiny``), a runner that executes a function on N real gloo processes
(``distributed``), and TensorBoard readers (``tensorboard``).

May import anything below the trainer; nothing in the library imports it.
"""
