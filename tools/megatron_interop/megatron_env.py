"""How Megatron-LM's `pretrain_gpt.py` is started for the interchange fixtures: its source folder, the
environment of its processes, and a check of its command lines by Megatron-LM's own argument validation
(which needs no GPU)."""

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig

HELPERS = os.path.join("megatron", "core", "datasets")
REQUIRED_MODULES = ("torch", "numpy", "packaging", "psutil", "transformers", "triton")
# Megatron-LM's GPT2BPETokenizer loads the hub's `gpt2` through transformers' AutoTokenizer, with the
# vocabulary and merges files passed in; a local folder of that name answers the lookup without a network.
GPT2_STUB = {"config.json": '{"model_type": "gpt2"}\n',
             "tokenizer_config.json": '{"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024}\n'}
MAKE_SHIM = """#!/bin/sh
# Megatron-LM runs `make -C megatron/core/datasets` at start-up; the helpers are built already.
for library in "$2"/helpers_cpp*.so; do [ -e "$library" ] && exit 0; done
echo "no helpers_cpp library in $2: run tools/megatron_interop/prepare_megatron.py" >&2; exit 1
"""
# Run on Python < 3.12 only where the arguments are checked on a CPU: Megatron-LM imports `typing.override`.
TYPING_OVERRIDE = ("import typing, typing_extensions\n"
                   "typing.override = getattr(typing, 'override', typing_extensions.override)\n")
VALIDATE = TYPING_OVERRIDE + """import contextlib, io, json, os, sys, torch, warnings
warnings.filterwarnings('ignore')
import megatron.training.arguments as arguments
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.training.global_vars import unset_global_variables
if not torch.cuda.is_available():  # validate_args asks the GPU's architecture for TP > 1; an H100's
    arguments.get_device_arch_version = lambda: 9
for argv, world_size in json.load(sys.stdin):
    os.environ['WORLD_SIZE'] = str(world_size)
    sys.argv = ['pretrain_gpt.py', *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_and_validate_args(args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})
        print('VALIDATED', args.ckpt_format, 'distopt' if args.use_distributed_optimizer else 'adam',
              'bf16' if args.bf16 else 'fp32', 'vocab', args.padded_vocab_size, 'TP', args.tensor_model_parallel_size,
              'PP', args.pipeline_model_parallel_size, 'DP', args.data_parallel_size, flush=True)
    except BaseException as error:
        print('FAILED', type(error).__name__, error, flush=True)
    unset_global_variables()
    destroy_num_microbatches_calculator()
"""


class MegatronEnvironment:
    """A Megatron-LM source folder made ready to run: helpers built, `make` answered, tokenizer stub."""

    RECORDED = ("CUDA_DEVICE_MAX_CONNECTIONS", "NVIDIA_TF32_OVERRIDE", "HF_HUB_OFFLINE", "NCCL_NVLS_ENABLE")

    def __init__(self, source: str, work: str, build_helpers: bool = True):
        self.source = os.path.abspath(source)
        self.script = os.path.join(self.source, "pretrain_gpt.py")
        if not os.path.isfile(self.script):
            raise SystemExit(f"--megatron {source}: no pretrain_gpt.py there (prepare_megatron.py lays it out)")
        commit_file = os.path.join(self.source, "COMMIT")
        self.commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown"
        if build_helpers:
            self._ensure_helpers()
            self._check_imports()
        self.bin = os.path.join(work, "bin")
        os.makedirs(self.bin, exist_ok=True)
        with open(os.path.join(self.bin, "make"), "w") as file:
            file.write(MAKE_SHIM)
        os.chmod(os.path.join(self.bin, "make"), 0o755)
        self.cwd = os.path.join(work, "megatron-cwd")
        os.makedirs(os.path.join(self.cwd, "gpt2"), exist_ok=True)
        for name, text in GPT2_STUB.items():
            with open(os.path.join(self.cwd, "gpt2", name), "w") as file:
                file.write(text)

    def _check_imports(self) -> None:
        """Fails at once, naming them, when packages Megatron-LM's runs need are missing (psutil: its torch_dist
        writer; transformers: its GPT2BPETokenizer)."""
        missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
        if missing:
            raise SystemExit(f"Megatron-LM's runs need {', '.join(missing)}: install the wheel(s) first")

    def _ensure_helpers(self) -> None:
        folder = os.path.join(self.source, HELPERS)
        library = os.path.join(folder, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
        if os.path.exists(library):
            return
        import pybind11  # only needed when prepare_megatron.py did not build the helpers

        subprocess.run(["g++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", f"-I{pybind11.get_include()}",
                        f"-I{sysconfig.get_paths()['include']}", os.path.join(folder, "helpers.cpp"), "-o", library],
                       check=True)

    def environment(self, visible_devices: str) -> dict:
        """The environment of a Megatron-LM process: its source first on the path (not this project's
        `megatron`), offline tokenizer lookup, true fp32 GEMMs."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and os.path.abspath(p) != root]
        return dict(os.environ, PYTHONPATH=os.pathsep.join([self.source, *inherited]),
                    PATH=self.bin + os.pathsep + os.environ.get("PATH", ""), CUDA_VISIBLE_DEVICES=visible_devices,
                    CUDA_DEVICE_MAX_CONNECTIONS="1", NVIDIA_TF32_OVERRIDE="0", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")

    def validate(self, commands: list[tuple[list[str], int]]) -> list[str]:
        """Megatron-LM's parse_and_validate_args on each (argv, world size), as rank 0, in one process (no GPU
        needed); one line per command, starting with VALIDATED or FAILED."""
        env = dict(self.environment(""), RANK="0", LOCAL_RANK="0")
        result = subprocess.run([sys.executable, "-c", VALIDATE], input=json.dumps(commands), cwd=self.cwd,
                                env=env, capture_output=True, text=True)
        lines = [line for line in result.stdout.splitlines() if line.startswith(("VALIDATED", "FAILED"))]
        if len(lines) != len(commands):
            raise SystemExit(f"Megatron-LM's argument check stopped:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
        return lines
