"""`python -m trt_diffusion.cli`: the command line, as the console script runs it minus the progress lines."""

import sys

from .main import main

sys.exit(main())
