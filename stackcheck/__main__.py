import sys

from stackcheck.cli import main

sys.exit(main())
