#!/bin/bash
# The multi-GPU validation run on one host: GPT 1.3B in 3D parallel against data parallel (loss match over
# 100 iterations, DP scaling), a Llama-style 8B through the interleaved pipeline in bf16 and FP8 with a
# resharded reload, a Mixtral-style MoE under expert parallelism, and CP=4 at 32k tokens. Prints one table;
# layouts and checks are in tools/bench/multi_gpu_validation.py.
#
#   bash examples/validation/run_8gpu.sh                  # 8 GPUs (or 4: every GPU of this host)
#   NGPUS=4 bash examples/validation/run_8gpu.sh --sections gpt,moe
set -euo pipefail
cd "$(dirname "$0")/../.."
NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}
exec python tools/bench/multi_gpu_validation.py --gpus "$NGPUS" "$@"
