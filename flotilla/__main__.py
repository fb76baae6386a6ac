import sys

from flotilla.cli import main

sys.exit(main())
