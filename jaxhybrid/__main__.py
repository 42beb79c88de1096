import sys

from jaxhybrid.launch_env import bind_rank_cpus

bind_rank_cpus()  # a `jaxhybrid launch` rank pins itself first: XLA sizes its thread pool from the affinity

from jaxhybrid.cli import main  # noqa: E402

sys.exit(main())
