import sys

from privleak.cli import main

sys.exit(main())
