"""What runs in the pytest child: the building blocks family tests share, one module per phase of the user's
journey (`load`, `place`, `adapt`, `train`, `generate`), the model under test (`subject`) and the proof
vocabulary (`proof`). `stackcheck.harness.scenario` re-exports them all for the families written before the split."""
