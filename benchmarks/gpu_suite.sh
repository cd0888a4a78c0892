#!/usr/bin/env bash
# The GPU verification run (device time is scarce), in stages that each fit a short lease:
#   env        the GPU, the driver, torch and CUDA
#   compile    GPT-2 small bf16 eager vs compiled, side by side, with its MFU (issue 14's target: >= 45%)
#   fp8        real FP8 (torchao) vs bf16 on 2048-wide GEMMs, both compiled (target: >= +20% tokens/s)
#   launch     GPT-2 small at batch 8 is launch-bound (device idle 60% of a compiled step): CUDA graphs
#              (compile_mode=reduce-overhead) against eager, and the compiled step at batch 32
#   fp8_wide   FP8 vs bf16 on 4096-wide GEMMs, both compiled
#   fp8_fsdp   FP8 under FSDP2 (weights all-gathered in FP8) vs bf16 under FSDP2, both compiled, on every GPU here
#   tests      the gpu-marked tests (losses and scales against the canonical torch.amp loop on CUDA, no sync)
#   profile    where GPT-2 small's bf16 compiled step goes (GEMMs vs the rest vs idle, top kernels)
#   compare    ResNet-50 and GPT-2 small in every mode (the speedup tables of docs/gpu_results.md)
#   overhead   the loop against a hand-written one, and against Lightning Fabric and Accelerate
#   suite      the whole test suite (CPU tests under this machine's torch)
# Usage, from the project root on a machine with a GPU and ampctl importable:
#
#   bash benchmarks/gpu_suite.sh                      # every stage (about 35 minutes on an H100)
#   bash benchmarks/gpu_suite.sh env compile fp8      # the stages named, in that order
#
# Writes logs, and a tarball of the run directories, to $OUT (or outputs/gpu_suite). On the GPU image (torch 2.11,
# no Hydra, no registry): here `bash ../shared/device/wheelhouse.sh torchao==0.17.0` (torchao's release for torch
# 2.11), carry .whl, and there `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
# export PYTHONPATH=$PWD:/tmp/site` before this script. The budget a lease had in 2026-11: 15 minutes, of which a
# start takes 1-2; `env compile fp8 tests profile` took 4 minutes, `env launch fp8_wide tests` 7.
set -uo pipefail
out=${OUT:-outputs/gpu_suite}
runs=outputs/gpu
mkdir -p "$out" "$runs"
py=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env compile fp8 launch fp8_wide fp8_fsdp tests profile compare overhead suite)

stage_env() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    $py -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1; } 2>&1 | tee "$out/env.txt"
}

stage_compile() {  # eager and compiled side by side, alternating rounds; the MFU column is against the dense peak
  timeout 300 $py -m ampctl compare recipe=gpt2 "compare.precisions=[bf16]" "compare.compile=[false,true]" \
    train.steps=60 compare.warmup_steps=20 compare.rounds=4 hydra.run.dir=$runs/compare_compile 2>&1 \
    | tail -14 | tee "$out/compare_compile.log"
}

stage_fp8() {  # GPT-2 small's recipe at a width where GEMMs dominate; both compiled (torchao fuses its casts only so)
  timeout 300 $py -m ampctl compare recipe=gpt2 recipe.d_model=2048 recipe.n_heads=16 recipe.n_layers=8 \
    "compare.precisions=[bf16,fp8]" "compare.compile=[true]" train.steps=60 compare.warmup_steps=20 \
    compare.rounds=4 hydra.run.dir=$runs/compare_fp8 2>&1 | tail -12 | tee "$out/compare_fp8.log"
}

stage_launch() {
  timeout 240 $py -m ampctl compare recipe=gpt2 "compare.precisions=[bf16]" "compare.compile=[false,true]" \
    train.compile.mode=reduce-overhead train.steps=60 compare.warmup_steps=20 compare.rounds=4 \
    hydra.run.dir=$runs/compare_cudagraphs 2>&1 | tail -14 | tee "$out/compare_cudagraphs.log"
  timeout 150 $py -m ampctl train recipe=gpt2 recipe.batch_size=32 precision=bf16 train.compile.enabled=true \
    train.steps=40 train.timing_warmup_steps=15 device=cuda hydra.run.dir=$runs/gpt2_bf16_batch32 2>&1 | tail -3 \
    | tee "$out/gpt2_bf16_batch32.log"
}

stage_fp8_wide() {
  timeout 240 $py -m ampctl compare recipe=gpt2 recipe.d_model=4096 recipe.n_heads=32 recipe.n_layers=4 \
    "compare.precisions=[bf16,fp8]" "compare.compile=[true]" train.steps=60 compare.warmup_steps=20 \
    compare.rounds=4 hydra.run.dir=$runs/compare_fp8_wide 2>&1 | tail -12 | tee "$out/compare_fp8_wide.log"
}

stage_fp8_fsdp() {  # on one GPU this proves the path on CUDA (compile, FP8, FSDP2's hooks); the all-gather's bytes
  # saving shows with several GPUs. torchrun's runs take no turns: read the tokens/s of the two as a first figure
  local gpus; gpus=$($py -c "import torch; print(torch.cuda.device_count())")
  for mode in bf16 fp8; do
    timeout 240 $py -m torch.distributed.run --standalone --nproc_per_node="$gpus" -m ampctl train recipe=gpt2 \
      recipe.d_model=2048 recipe.n_heads=16 recipe.n_layers=8 precision=$mode distributed=fsdp train.compile.enabled=true \
      train.steps=60 train.timing_warmup_steps=20 device=cuda hydra.run.dir=$runs/fsdp_$mode 2>&1 | tail -3 \
      | tee "$out/fsdp_$mode.log"
  done
}

stage_tests() {
  # the whole log comes back: a failure's traceback is what the next lease needs
  timeout 240 $py -m pytest -q -p no:cacheprovider --tb=short -rfs -m gpu tests > "$out/pytest_gpu.log" 2>&1
  tail -15 "$out/pytest_gpu.log"
}

stage_profile() {
  timeout 200 $py -m ampctl train recipe=gpt2 precision=bf16 train.compile.enabled=true train.steps=20 train.profile=3 \
    device=cuda hydra.run.dir=$runs/profile_gpt2_bf16 2>&1 | grep -A 30 "^profile of" \
    | tee "$out/profile_gpt2_bf16.log"
}

stage_compare() {
  for recipe in "resnet50 recipe.batch_size=128" "gpt2"; do
    name=${recipe%% *}
    timeout 240 $py -m ampctl compare recipe=$recipe train.steps=60 compare.warmup_steps=15 \
      hydra.run.dir=$runs/compare_$name 2>&1 | tail -20 | tee "$out/compare_$name.log"
  done
}

stage_overhead() {
  timeout 150 $py benchmarks/loop_overhead.py --recipe gpt2 --precisions bf16,fp16 --device cuda --rounds 10 \
    2>&1 | tee "$out/loop_overhead.log"
  timeout 240 $py benchmarks/compile_speedup.py --recipe gpt2 --precisions bf16 --device cuda --rounds 10 \
    2>&1 | tee "$out/compile_speedup.log"
  timeout 120 $py benchmarks/framework_overhead.py --recipe gpt2 --precisions bf16 --device cuda --rounds 10 \
    2>&1 | tee "$out/framework_overhead.log"
}

stage_suite() {
  timeout 600 $py -m pytest -q -p no:cacheprovider --tb=short -rfs tests > "$out/pytest.log" 2>&1
  tail -25 "$out/pytest.log"
}

for stage in "${stages[@]}"; do
  if ! declare -F "stage_$stage" >/dev/null; then
    echo "gpu_suite.sh: unknown stage '$stage'; choose from: env compile fp8 launch fp8_wide fp8_fsdp tests profile compare overhead suite" >&2
    exit 2
  fi
done
for stage in "${stages[@]}"; do
  echo "== $stage ($(date +%T))"
  "stage_$stage"
done
tar czf "$out/runs.tgz" --exclude='*.pt' --exclude='checkpoints' --exclude='*.dcp' "$runs"
