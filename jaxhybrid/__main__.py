import sys

from jaxhybrid.cli.main import main

sys.exit(main())
