"""FP8 training without Transformer Engine: the transformer layers' linears through `torch._scaled_mm`.

    recipe.py            formats (e4m3 / hybrid), recipes (delayed / tensorwise), which layers, config checks
    quantize.py          per-tensor saturating casts (compiled on CUDA): the reference, the CPU and tensorwise path
    triton_quantize.py   the delayed-scaling cast as one Triton kernel (q, q^T, amax, 1 / scale), used on GPUs
    scaling.py           per-GEMM scaling state (amax history, scales, the step's quantized weight), its
                         step-end update, its checkpoint entry
    linear.py            the FP8 linear autograd function
    params.py            weights stored in FP8 (fp8_param, --fp8-param-gather): the casts from the optimizer's
                         main params, the value in high precision for checkpoints

Configured by `TransformerConfig.fp8` and the other fp8_* fields (`--fp8-format` ...). The pipeline
schedules call `update_fp8_scaling` after each step's last backward; a training loop that calls the model
directly must call it once per step itself (after backward, before the next forward): it updates the
scales and drops the step's quantized weights, so that the next forward quantizes the optimizer's new ones.
"""

from megatron.core.fp8.params import is_fp8_param, store_weight_in_fp8
from megatron.core.fp8.recipe import Fp8Recipe, fp8_config_problems, layer_runs_in_fp8
from megatron.core.fp8.scaling import Fp8Scaling, update_fp8_scaling
from megatron.core.lazy_names import lazy_names

# linear.py loads torch._dynamo, which a run without FP8 does not need.
__getattr__ = lazy_names(__name__, {"fp8_linear": ".linear"})


__all__ = ["Fp8Recipe", "Fp8Scaling", "fp8_config_problems", "fp8_linear", "is_fp8_param", "layer_runs_in_fp8",
           "store_weight_in_fp8", "update_fp8_scaling"]
