"""``python -m harness.report``: see :mod:`harness.report.markdown`."""
import sys

from .markdown import main

sys.exit(main())
