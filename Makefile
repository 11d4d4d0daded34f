# All targets run inside the environment that scripts/env.sh creates outside the
# checkout (keyed by the pins in requirements/) and reuses on later runs.
.PHONY: env env-path test test-fast run selfcheck bench-convert gpu-carry

env:
	@scripts/env.sh >/dev/null

env-path:
	@scripts/env.sh 2>/dev/null

# pytest-xdist workers; each test file runs whole on one worker (its module fixtures, e.g. the
# shared training run of tests/rl/test_train.py, are made once), files handed out in collection
# order (tests/conftest.py puts the main job's first, then the files with most tests). 2 matches
# the 2-core CI machine: most tests are one rank with one thread, so two workers fill both cores.
TEST_WORKERS ?= 2

# The whole CPU suite (what CI runs); no test needs a GPU (scripts/gpu_check.sh is the GPU check).
test:
	@scripts/test.sh -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The suite without the tests marked slow (over ~7 s: marsrl train / convert / selfcheck runs,
# SGLang engines, multi-node, cluster-recipe dry runs): 876 tests, about 5 minutes on 2 cores.
test-fast:
	@scripts/test.sh -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

# The embedded CPU main job: SFT warm start, then RL of the three roles on 2 CPU ranks (8-12 minutes).
run:
	@env=$$(scripts/env.sh) && OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 "$$env/bin/marsrl" train --recipe tiny_arithmetic_sft_rl run.output_dir=outputs/tiny_arithmetic_sft_rl-$$(date +%Y%m%d-%H%M%S)

selfcheck:
	@env=$$(scripts/env.sh) && OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} "$$env/bin/marsrl" selfcheck

bench-convert:
	@env=$$(scripts/env.sh) && OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} "$$env/bin/marsrl" bench convert

# The carry for the lent GPU machine: wheels beyond torch/transformers into gpu_wheels/ (needs network).
gpu-carry:
	@scripts/gpu_carry.sh
