"""Oracle for host/cli/tests/cli/launch.rs: Accelerate's write_basic_config(MIXED,
PATH) on this machine; prints what it returned (the path, or False when
the file existed)."""
import sys

from accelerate.utils import write_basic_config

print(write_basic_config(sys.argv[1], sys.argv[2]))
