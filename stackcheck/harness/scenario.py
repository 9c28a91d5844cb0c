"""Every building block the family tests share, under the one name the families import (`from stackcheck.harness import
scenario`). Each lives in the module of its phase of the user's journey, under `stackcheck/harness/`:

- `proof`: a precondition not reached, a tolerance, the measures judged by mechanism;
- `subject`: the model under test (an architecture on the lane's device);
- `load`: quantized loading and the proofs that weights are 4-bit;
- `place`: dispatch, offload and memory budgets;
- `adapt`: PEFT adapters, loaded or fresh;
- `train`: the training batch and steps;
- `merge`: merging an adapter, and the measures a merge is judged by;
- `generate`: prompt, logits and decoding.

Each helper calls the public entry point whose code path users go through, and the `require_*` helpers turn a
missing precondition into ScenarioNotReached.
"""

from stackcheck.harness.proof import *  # noqa: F401,F403
from stackcheck.harness.subject import *  # noqa: F401,F403
from stackcheck.harness.load import *  # noqa: F401,F403
from stackcheck.harness.place import *  # noqa: F401,F403
from stackcheck.harness.adapt import *  # noqa: F401,F403
from stackcheck.harness.train import *  # noqa: F401,F403
from stackcheck.harness.generate import *  # noqa: F401,F403
from stackcheck.harness.merge import *  # noqa: F401,F403
