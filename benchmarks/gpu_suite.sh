#!/usr/bin/env bash
# The GPU verification run, in one command (device time is scarce): the whole test suite (gpu-marked tests
# on CUDA, the rest on CPU under this machine's torch), compare on ResNet-50 and GPT-2 small, bf16 vs FP8, the
# loop-overhead benchmark on CUDA, and each mode eager vs compiled with its MFU. Writes logs and a tarball of the run directories to $OUT (or
# outputs/gpu_suite). Usage, from the project root on a machine with a GPU and ampctl importable:
#
#   bash benchmarks/gpu_suite.sh
set -uo pipefail
out=${OUT:-outputs/gpu_suite}
runs=outputs/gpu
mkdir -p "$out" "$runs"
py=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$out/env.txt"

timeout 300 $py -m pytest -q -p no:cacheprovider tests 2>&1 | tail -25 | tee "$out/pytest.log"

for recipe in "resnet50 recipe.batch_size=128" "gpt2"; do
  name=${recipe%% *}
  timeout 240 $py -m ampctl compare recipe=$recipe train.steps=60 compare.warmup_steps=15 \
    hydra.run.dir=$runs/compare_$name 2>&1 | tail -20 | tee "$out/compare_$name.log"
done

# Real FP8 (torchao, sm_89+) against bf16 where GEMMs dominate: GPT-2 small's width, a longer context.
# Both compiled (torchao fuses its casts only under torch.compile): like for like.
timeout 300 $py -m ampctl compare recipe=gpt2 recipe.d_model=2048 recipe.n_heads=16 recipe.n_layers=8 \
  "compare.precisions=[bf16,fp8]" "compare.compile=[true]" train.steps=60 compare.warmup_steps=20 \
  hydra.run.dir=$runs/compare_fp8 2>&1 | tail -12 | tee "$out/compare_fp8.log"

timeout 150 $py benchmarks/loop_overhead.py --recipe gpt2 --precisions bf16,fp16 --device cuda --rounds 10 \
  2>&1 | tee "$out/loop_overhead.log"

# Compile's gain and MFU (issue 14's GPU target: GPT-2 small bf16 + compile >= 45% MFU on one H100): each
# mode eager and compiled side by side; the table's MFU column is against the H100's dense peak per dtype.
timeout 420 $py -m ampctl compare recipe=gpt2 "compare.precisions=[bf16,fp16]" "compare.compile=[false,true]" \
  train.steps=60 compare.warmup_steps=20 hydra.run.dir=$runs/compare_compile 2>&1 | tail -14 \
  | tee "$out/compare_compile.log"
timeout 240 $py benchmarks/compile_speedup.py --recipe gpt2 --precisions bf16 --device cuda --rounds 10 \
  2>&1 | tee "$out/compile_speedup.log"

# Where GPT-2 small's bf16 compiled step goes (train.profile): GEMMs vs the rest vs device idle, top kernels.
timeout 240 $py -m ampctl train recipe=gpt2 precision=bf16 train.compile=true train.steps=20 train.profile=3 \
  device=cuda hydra.run.dir=$runs/profile_gpt2_bf16 2>&1 | grep -A 30 "^profile of" | tee "$out/profile_gpt2_bf16.log"

timeout 120 $py benchmarks/framework_overhead.py --recipe gpt2 --precisions bf16 --device cuda --rounds 10 \
  2>&1 | tee "$out/framework_overhead.log"

tar czf "$out/runs.tgz" --exclude='*.pt' --exclude='checkpoints' "$runs"
