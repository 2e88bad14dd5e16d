"""`python -m autosp train | plan | explain`."""
import sys

from autosp.cli import main

sys.exit(main())
