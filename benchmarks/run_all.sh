#!/bin/sh
# Runs the benchmarks of issue 6 on every backend, each in its own environment and process,
# then merges the results into docs/speed.md (between <!-- bench:start --> and <!-- bench:end -->)
# and benchmarks/results/bench.png.
#
#   benchmarks/run_all.sh                 # tox envs bench-numpy ... bench-mxnet, then the merge
#   benchmarks/run_all.sh --quick         # the same with tiny sizes (a smoke test)
#
# Extra arguments go to every `python -m benchmarks` (e.g. --threads 4, --suite speed).
# Without tox, run `python -m benchmarks --backend NAME --out benchmarks/results` from the
# repository root in each framework's environment yourself (the package installed or not: the
# checkout's attention_core is used), then `python -m benchmarks --merge benchmarks/results`
# (this needs matplotlib for the plot).
set -eu
cd "$(dirname "$0")/.."
for env in numpy torch tensorflow jax mxnet; do
    tox -e "bench-$env" -- "$@"
done
tox -e bench-merge
