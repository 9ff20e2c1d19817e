"""The runs behind the Megatron-LM interchange fixtures: one tiny GPT, trained by both frameworks with the same
command line, in every checkpoint format, precision, optimizer and layout the fixtures cover.

A configuration is named `{format}-{precision}-{optimizer}-{layout}`:

| part | values | flags |
|---|---|---|
| format | `torch`, `dist` | `--ckpt-format torch` / `torch_dist` |
| precision | `fp32`, `bf16` | none / `--bf16` (fp32 main params in the optimizer) |
| optimizer | `adam`, `distopt`, `distoptfr` | none / `--use-distributed-optimizer` / plus |
|  |  | `--dist-ckpt-optim-fully-reshardable` (torch_dist only) |
| layout | `tp1`, `tp2`, `pp2`, `dp2` | one process / `--tensor-model-parallel-size 2` / |
|  |  | `--pipeline-model-parallel-size 2` / two data-parallel ranks (distributed optimizer only) |

Every run trains 20 iterations and saves at 10 and 20, logging every iteration, so a resume from the
iteration-10 checkpoint can be compared with the uninterrupted losses of 11..20. Dropout is off and the seed
fixed, so the only differences between two frameworks' runs are floating-point rounding.

Paths in the command lines are placeholders (`{data}`, `{vocab}`, `{merges}`, `{save}`, `{load}`, `{cache}`),
filled in by `command()`; the fixture file records the placeholder form, which is the exact command once the
paths are substituted.
"""

from dataclasses import dataclass

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
]
TRAINING = [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]
DATA = [
    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}", "--merge-file", "{merges}",
    "--data-path", "{data}", "--split", "90,5,5", "--num-workers", "0", "--data-cache-path", "{cache}",
]
LOGGING = ["--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1"]
# Megatron-LM's local (no Transformer Engine) implementation on a GPU without apex: every fused kernel that
# needs apex or TE off. This project accepts the same flags (its kernels need neither).
LOCAL_IMPLEMENTATION = [
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
]
SAVE_ITERATION = 10
TRAIN_ITERATIONS = 20

FORMATS = {"torch": "torch", "dist": "torch_dist"}
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
}


@dataclass(frozen=True)
class Config:
    """One configuration of the matrix (see the module docstring for the name's parts)."""

    format: str
    precision: str
    optimizer: str
    layout: str

    @property
    def name(self) -> str:
        return f"{self.format}-{self.precision}-{self.optimizer}-{self.layout}"

    @property
    def processes(self) -> int:
        return LAYOUTS[self.layout][0]

    def flags(self) -> list[str]:
        """The flags that set this configuration apart from the common ones."""
        flags = ["--ckpt-format", FORMATS[self.format]]
        if self.precision == "bf16":
            flags.append("--bf16")
        if self.optimizer in ("distopt", "distoptfr"):
            flags.append("--use-distributed-optimizer")
        if self.optimizer == "distoptfr":
            flags.append("--dist-ckpt-optim-fully-reshardable")
        return flags + LAYOUTS[self.layout][1]


def _matrix() -> list[Config]:
    configs = []
    for layout in ("tp1", "tp2", "pp2"):
        for precision in ("fp32", "bf16"):
            configs.append(Config("torch", precision, "adam", layout))
            configs.append(Config("torch", precision, "distopt", layout))
            configs.append(Config("dist", precision, "adam", layout))
            configs.append(Config("dist", precision, "distopt", layout))
            configs.append(Config("dist", precision, "distoptfr", layout))
    configs.append(Config("torch", "fp32", "distopt", "dp2"))
    configs.append(Config("dist", "bf16", "distopt", "dp2"))
    configs.append(Config("dist", "fp32", "distoptfr", "dp2"))
    return configs


MATRIX = _matrix()


def by_name(name: str) -> Config:
    """The configuration called `name`; a clear error naming the valid ones otherwise."""
    for config in MATRIX:
        if config.name == name:
            return config
    raise ValueError(f"no configuration {name!r}; valid: {', '.join(c.name for c in MATRIX)}")


def command(config: Config, *, save: str | None = "{save}", load: str | None = None,
            paths: dict | None = None) -> list[str]:
    """The full `pretrain_gpt.py` argument list of `config` (the same for both frameworks), with the path
    placeholders filled from `paths` where given. `save=None` writes no checkpoint; `load` resumes."""
    argv = MODEL + TRAINING + DATA + LOGGING + LOCAL_IMPLEMENTATION + config.flags()
    if save is not None:
        argv += ["--save", save, "--save-interval", str(SAVE_ITERATION)]
    if load is not None:
        argv += ["--load", load]
    if paths:
        argv = [arg.format(**paths) if "{" in arg else arg for arg in argv]
    return argv
