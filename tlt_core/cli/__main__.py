"""`python -m tlt_core.cli ...` (and `torchrun ... -m tlt_core.cli train`): the `tlt` command."""

import sys

from tlt_core.cli.main import main

sys.exit(main())
