"""Runs the `kvpilot` command from another checkout of the repository (ROOT, first argument) with
this venv's editable install: the install's path finder is pointed at ROOT's folders before
anything of kvpilot loads. Used to run the code before and after a move side by side."""
import sys

import __editable___kvpilot_0_1_0_finder as finder

root = sys.argv.pop(1)
for name, path in finder.MAPPING.items():
    finder.MAPPING[name] = path.replace("/work/main", root, 1)

from kvpilot.cli.main import main  # noqa: E402  (after the finder points at ROOT)

sys.exit(main())
