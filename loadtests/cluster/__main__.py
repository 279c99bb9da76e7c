"""``python -m loadtests.cluster``: see ``loadtests/cluster/run.py``."""

import sys

from loadtests.cluster.run import main

sys.exit(main())
