import sys

from kvfleet.cli import main

sys.exit(main())
