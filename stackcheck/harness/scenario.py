"""Every building block the family tests share, under the one name the families import (`from stackcheck.harness import
scenario`). Each lives in the module of its phase of the user's journey, under `stackcheck/harness/` (`proof`,
`subject`, `load`, `place`, `adapt`, `train`, `merge`, `generate`, ...), re-exported here.

Each helper calls the public entry point whose code path users go through, and the `require_*` helpers turn a
missing precondition into ScenarioNotReached. The phases: docs/internals.md, "harness/scenario.py".
"""

from stackcheck.harness.proof import *  # noqa: F401,F403
from stackcheck.harness.subject import *  # noqa: F401,F403
from stackcheck.harness.load import *  # noqa: F401,F403
from stackcheck.harness.place import *  # noqa: F401,F403
from stackcheck.harness.adapt import *  # noqa: F401,F403
from stackcheck.harness.train import *  # noqa: F401,F403
from stackcheck.harness.generate import *  # noqa: F401,F403
from stackcheck.harness.merge import *  # noqa: F401,F403
