import sys

from megatron_marsrl.cli import main

sys.exit(main())
