"""`python -m nanoserve.course ...`: the same as `nanoserve course ...`."""

import sys

from nanoserve.course.cli import main

sys.exit(main())
