#!/usr/bin/env bash
# A kernel change timed against its base on the same GPU machine in one call (like with like:
# the `run` tool's machines differ from call to call). Here, on the CPU machine:
#   `bash suites/bench/gpu_ab.sh prep [REV]` (default HEAD) puts REV's kernels/, quantizers/
#   and suites/ in .gpuab/ (ignored; ~3 MB) with REV's hash in .gpuab/rev.
# On the GPU machine, a call that carries .gpuab (and .gpu_commit) runs the same module twice:
#   `bash suites/bench/gpu_ab.sh py -m kvqbench.suites.bench.cuda.hqmq_bench ...` runs it on
#   the base tree (as package kvqbench, from /tmp/pp_base; its libraries build in
#   /tmp/kvq_ext_base, so the two trees' builds do not wait on one lock), with
#   KVQBENCH_COMMIT=REV so results record the base; then call the module as usual
#   (gpu_env.sh's /tmp/pp) for the working tree. Prebuild the base's libraries too:
#   `gpu_ab.sh prebuild` (after prep) puts them in .gpubuild beside the working tree's.
set -eu
# base_package DIR: DIR/kvqbench as the base tree's package (its kernels/, quantizers/, suites/)
base_package() { mkdir -p "$1/kvqbench"; for d in kernels quantizers suites; do ln -sfn "$PWD/.gpuab/tree/$d" "$1/kvqbench/$d"; done; }
case "${1:-}" in
  prep)
    rev=$(git rev-parse "${2:-HEAD}")
    rm -rf .gpuab && mkdir -p .gpuab/tree
    git archive "$rev" kernels quantizers suites | tar x -C .gpuab/tree
    echo "$rev" > .gpuab/rev
    echo "base $rev in .gpuab ($(du -sh .gpuab | cut -f1))" ;;
  py)
    shift
    [ -f .gpuab/rev ] || { echo "gpu_ab.sh: no .gpuab here (run 'prep' on the CPU machine and carry .gpuab)" >&2; exit 2; }
    PPB=/tmp/pp_base; base_package $PPB
    echo "base tree: $(cat .gpuab/rev)"
    # (a prebuilt .gpubuild holds both trees' libraries: their names carry their sources' hashes)
    EXT=/tmp/kvq_ext_base; [ -d .gpubuild/kvqbench_cuda_decode ] && EXT=$PWD/.gpubuild
    PYTHONPATH=$PPB KVQBENCH_COMMIT=$(cat .gpuab/rev) TORCH_EXTENSIONS_DIR=$EXT PYTHONDONTWRITEBYTECODE=1 \
      ${PYTHON:-python} "$@" ;;
  prebuild)
    [ -f .gpuab/rev ] || { echo "gpu_ab.sh: run 'prep' first" >&2; exit 2; }
    PPB=/tmp/pp_base_cpu; base_package $PPB
    PYTHONPATH=$PPB ${PYTHON:-python} -m kvqbench.suites.bench.gpu_prebuild --out "$PWD/.gpubuild" ;;
  *) echo "usage: gpu_ab.sh prep [REV] | prebuild | py ARGS..." >&2; exit 2 ;;
esac
