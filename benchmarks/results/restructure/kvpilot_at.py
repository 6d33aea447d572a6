"""Runs the `kvpilot` command from another checkout of the repository (ROOT, first argument) with
this venv's editable install: the install's path finder is pointed at ROOT's folders before
anything of kvpilot loads. Used to run the code before and after a move side by side."""
import sys
from pathlib import Path

import __editable___kvpilot_0_1_0_finder as finder

root = sys.argv.pop(1)
installed = str(Path(finder.MAPPING["kvpilot.engine"]).parent)  # the checkout this venv installed
for name, path in finder.MAPPING.items():
    finder.MAPPING[name] = path.replace(installed, root, 1)

from kvpilot.cli.main import main  # noqa: E402  (after the finder points at ROOT)

sys.exit(main())
