"""`python -m trl_scale.seams`: check every seam against the installed packages (`--update`: print fresh
fingerprints)."""

import sys

from . import main

sys.exit(main())
