"""coati-kto: KTO (Kahneman-Tversky Optimization) training on ColossalAI.

Dependencies are pinned in requirements/ (cpu.txt, gpu.txt) rather than here: ColossalAI 0.5.0's own metadata
pins an old torch, so it is installed with --no-deps next to exactly the packages it imports (see Makefile).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

# One place for the version: coati_kto/__init__.py (also what `coati-kto --version` prints).
VERSION = re.search(
    r'__version__ = "([^"]+)"', (Path(__file__).parent / "coati_kto/__init__.py").read_text()
)[1]

setup(
    name="coati-kto",
    version=VERSION,
    description="Distributed KTO training from binary feedback on ColossalAI",
    packages=find_packages(include=["coati_kto", "coati_kto.*"]),
    python_requires=">=3.10",
    entry_points={"console_scripts": ["coati-kto=coati_kto.cli:entry"]},
)
