import sys

from kvfleet.cli import main

if __name__ == "__main__":  # tensor-parallel ranks are spawned: they import this module again
    sys.exit(main())
