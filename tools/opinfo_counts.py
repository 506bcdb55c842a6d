"""OpInfo counts for docs/ops.md, written by `python tests/opinfo_sweep.py --write-counts`."""

TORCH_VERSION = '2.13.0'
MODE = 'sampled'  # sampled: the CI run; full: SHARDWISE_OPINFO_FULL=1
OPINFOS = 702
TESTABLE = 644  # with float32 or float64 samples on CPU
PASSED = 640  # forward in every variant, backward if differentiable
UNSUPPORTED = 2  # an aten op without a sharding rule
ERRORS = 2
WRONG = 0
