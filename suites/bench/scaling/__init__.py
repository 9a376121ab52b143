"""Scaling of `kvqbench compare` over ranks (issue 12): the same grid scored under
`torchrun --nproc-per-node N` for each N of `--ranks`, throughput = scored tokens
(sum of every configuration's predicted tokens) / wall seconds of the scoring phase
(results.json meta.distributed.scoring.wall_s: from the first unit to the last
gather, model loading and the report excluded), and the figures of every N checked
against the first N's (PPL to 1e-6 relative).

    python -m kvqbench.suites.bench.scaling --ranks 1,2 --out reports/scaling -- --windows 16 --window 1024
    python -m kvqbench.suites.bench.scaling --ranks 1,2 --resume-check -- --device cpu --model DIR --specs "fp16;int4"

Everything after `--` goes to `kvqbench compare` unchanged (model, corpus, grid,
device). Every N runs `--fresh` into <out>/<name>/runs/ranks<N>. Before the timed
runs, an untimed one at the largest N fills the on-disk Triton compile cache, so no
N pays for compiling what another already compiled; in-process autotuning is paid
by every process in every run alike. Every run gets OMP_NUM_THREADS=1 unless the
caller sets it (torchrun itself does so for N > 1 only). `--resume-check` then starts the largest N
again, stops it (SIGTERM to torchrun) once results.json holds half the grid, resumes
on one process without torchrun and checks that what was saved was not measured again
and that the figures still match. Writes scaling.json and scaling.md.
"""

