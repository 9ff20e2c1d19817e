"""Three fixes to Megatron-LM main's distributed-optimizer loaders, for runs with torch's Adam (no apex and no
Transformer Engine, as `--transformer-impl local` on a plain PyTorch install). Without them Megatron-LM
cannot resume any distributed-optimizer checkpoint there, its own included; `load_check.py` shows that on
the checkpoints Megatron-LM wrote itself (`tests/fixtures/megatron_lm/gpu1/megatron/`), and without the
third it resumes them but trains on with the wrong Adam bias correction.

1. `_set_main_param_and_optimizer_states`, which the torch-format (`distrib_optim.pt`) and `dp_reshardable`
   loaders call per param, copies the loaded tensors into the main param and Adam state outside
   `torch.no_grad()`. With fp32 params the main param is a view of the model param, a leaf that requires
   grad: "a view of a leaf Variable that requires grad is being used in an in-place operation". And it
   copies every tensor of the param's Adam state, `step` included (a tensor in torch's Adam, which
   `load_state_dict` has just restored from the checkpoint's param groups): `distrib_optim.pt` has no
   `step`, `KeyError: 'step'` (bf16); `dp_reshardable` hands back, as a non-persistent object, the step
   tensor the optimizer held when the state dict to load into was built, so the loaded step would be
   overwritten with the pre-load one. Fixed: the copy runs under `torch.no_grad()` and `step` keeps the
   value `load_state_dict` restored from the param groups (where Megatron-LM saves it in every format).
2. torch_dist: `sharded_state_dict(is_loading=True)` starts with `self.state_dict()`, which reads Adam's
   step from the inner optimizer's per-param state; torch's Adam creates that state lazily at its first
   step, so a freshly built optimizer has none: `assert len(steps) == 1`. Fixed: before that call, the
   state torch's Adam would create at its first step is allocated (step 0, zero moments); the checkpoint's
   values then replace it, as with apex's or Transformer Engine's Adam.
3. `load_state_dict` hands torch's Adam one `step` tensor for every param (it builds
   `torch.tensor(step)` once and puts that object into each param's state; torch keeps a CPU step tensor as
   given). Adam then adds 1 to it once per param at every step: after the first resumed step the step count
   is 10 + (number of params) instead of 11, the bias correction is wrong and the losses drift from the
   uninterrupted run's (5e-3 relative after 10 iterations of the tiny GPT; its own checkpoints too). Fixed:
   each param gets its own copy after the load.

`apply()` installs both (they change nothing else). As a runner, for Megatron-LM's own processes:

    python megatron_fixes.py pretrain_gpt.py ARGS...     (= pretrain_gpt.py ARGS with the fixes)
"""

import os
import runpy
import sys

import torch


def _fixed_set_main_param_and_optimizer_states(original):
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        complete = {key: value for key, value in tensors.items() if key != "step"}
        for key, value in self.optimizer.state[main_param].items():
            if isinstance(value, torch.Tensor):
                complete.setdefault(key, value.clone())
        with torch.no_grad():
            original(self, model_param, complete)

    return set_main_param_and_optimizer_states


def _fixed_sharded_state_dict(original):
    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        if is_loading:
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if not self.optimizer.state[param]:
                        self.optimizer.state[param] = {
                            "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                            "exp_avg_sq": torch.zeros_like(param),
                        }
        return original(self, model_sharded_state_dict, is_loading, **kwargs)

    return sharded_state_dict


def _fixed_load_state_dict(original):
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    return load_state_dict


def apply() -> None:
    """Installs the three fixes on Megatron-LM's DistributedOptimizer (its source must be importable); does
    nothing where Megatron-LM has apex's or Transformer Engine's Adam, whose loaders need neither."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    optimizer = distrib_optimizer.DistributedOptimizer
    optimizer._set_main_param_and_optimizer_states = _fixed_set_main_param_and_optimizer_states(
        optimizer._set_main_param_and_optimizer_states)
    optimizer.sharded_state_dict = _fixed_sharded_state_dict(optimizer.sharded_state_dict)
    optimizer.load_state_dict = _fixed_load_state_dict(optimizer.load_state_dict)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python megatron_fixes.py pretrain_gpt.py ARGS...")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python pretrain_gpt.py` would have it
    apply()
    runpy.run_path(script, run_name="__main__")
