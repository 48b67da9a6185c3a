import sys

from hetpar.cli import main

sys.exit(main())
