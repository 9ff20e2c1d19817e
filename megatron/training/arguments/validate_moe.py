"""Mixture-of-experts flags: Megatron's parsing of `--moe-layer-freq`, and the checks that name flags.

    --moe-layer-freq 2                    every 2nd layer is MoE (layers 0, 2, 4, ...)
    --moe-layer-freq "([1]*3+[0]*1)*3"    one 0/1 entry per layer (Megatron evaluates this list syntax)
    world size = ETP x EP x expert-DP x PP  (the expert layout must fit the world, as TP x CP x DP x PP does)
"""

import argparse
import ast
import re

from megatron.training.arguments.validate_parallel import legal_sizes

_LIST_EXPRESSION = re.compile(r"^[\[\]\d\s,*+()]+$")


def _evaluate_list_expression(node):
    """Evaluates list literals, ints, `+` (concatenation) and `*` (repetition) only."""
    if isinstance(node, ast.Expression):
        return _evaluate_list_expression(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate_list_expression(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_list_expression(node.left), _evaluate_list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("unsupported expression")


def parse_moe_layer_freq(value):
    """`--moe-layer-freq` as an int (every N-th layer) or a list of 0/1; raises ValueError on anything else."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    if _LIST_EXPRESSION.match(text):
        try:
            pattern = _evaluate_list_expression(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError, TypeError):
            pattern = None
        if isinstance(pattern, list):
            return pattern
    raise ValueError(f'--moe-layer-freq {value!r} must be an integer or a 0/1 list such as "([1]*3+[0]*1)*3"')


def _unwrap_single(args, name: str, flag: str, problems: list) -> None:
    value = getattr(args, name)
    if isinstance(value, list):
        if len(value) == 1:
            setattr(args, name, value[0])
        else:
            problems.append(f"{flag} {' '.join(map(str, value))}: combining several load-balancing losses is "
                            f"not supported yet; give one")


def check_moe(args: argparse.Namespace, problems: list) -> None:
    """Normalises the MoE flags and reports what does not fit the expert-parallel layout."""
    _unwrap_single(args, "moe_router_load_balancing_type", "--moe-router-load-balancing-type", problems)
    _unwrap_single(args, "moe_aux_loss_coeff", "--moe-aux-loss-coeff", problems)
    try:
        args.moe_layer_freq = parse_moe_layer_freq(args.moe_layer_freq)
    except ValueError as error:
        problems.append(str(error))
        args.moe_layer_freq = 1
    ep, etp, tp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if etp < 1:
        problems.append(f"--expert-tensor-parallel-size {etp} must be at least 1")
        return
    if args.num_experts is None:
        if ep > 1:
            problems.append(f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    if args.num_experts % ep:
        problems.append(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
                        f"valid EP sizes: {legal_sizes(args.num_experts)}")
    expert_model_size = etp * ep * args.pipeline_model_parallel_size
    if args.world_size % expert_model_size:
        problems.append(f"world size {args.world_size} is not divisible by expert TP {etp} x EP {ep} x PP "
                        f"{args.pipeline_model_parallel_size} = {expert_model_size}")
    torch_files = (args.ckpt_format == "torch" and (args.save or args.load)) or args.ckpt_convert_format == "torch"
    if tp % etp and torch_files:
        problems.append(f"--ckpt-format torch names each file by tensor and expert rank (mp_rank_TT_EEE), which "
                        f"needs --expert-tensor-parallel-size {etp} to divide --tensor-model-parallel-size {tp}; "
                        f"use --ckpt-format torch_dist")
    if args.add_bias_linear and args.moe_grouped_gemm:
        problems.append("--moe-grouped-gemm has no expert biases (as in Megatron-LM): add --disable-bias-linear, or "
                        "leave out --moe-grouped-gemm to run the experts one by one")
    if args.add_bias_linear and args.moe_shared_expert_intermediate_size is not None:
        problems.append("--moe-shared-expert-intermediate-size: shared experts have no biases (as in Megatron-LM); "
                        "add --disable-bias-linear")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        problems.append(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
                        f"{args.num_experts}")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    freq = args.moe_layer_freq
    if isinstance(freq, list) and args.num_layers is not None and len(freq) != args.num_layers:
        problems.append(f"--moe-layer-freq has {len(freq)} entries but --num-layers is {args.num_layers}")
