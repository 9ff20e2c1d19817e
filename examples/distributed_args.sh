# Sourced by the example training scripts (not run on its own): the torchrun layout and pretrain_gpt.py.
#
# Environment overrides, for several GPUs or nodes:
#   GPUS_PER_NODE   processes per node (default: the GPUs torch sees, or 1 on a machine without CUDA)
#   NUM_NODES NODE_RANK MASTER_ADDR MASTER_PORT   (default: 1 0 localhost 6000)
# Without CUDA the same command trains on the CPU: the training code then uses gloo instead of NCCL.

# Lets tensor-parallel communication kernels be queued ahead of the GEMMs that wait on them, as in
# Megatron-LM's scripts (not needed on Blackwell).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

GPUS_PER_NODE=${GPUS_PER_NODE:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

# The scripts work from any directory.
PRETRAIN_GPT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/pretrain_gpt.py"
