import sys

from dhisparse.cli import main

sys.exit(main())
