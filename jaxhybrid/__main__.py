import sys

from jaxhybrid.cli import main

sys.exit(main())
