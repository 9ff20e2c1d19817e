"""A run's configuration as typed sections: every command-line flag is a documented field of one section.

    fields.py         how a field becomes a flag (`flag()`, `Section.add_to`, `Section.from_namespace`)
    model.py          NetworkSizeConfig, InitializationConfig, MupConfig, KernelFusionConfig
    training.py       TrainingConfig (batch, length, recompute, exit), ValidationConfig, AutoresumeConfig
    data.py           DataConfig
    checkpointing.py  CheckpointingConfig
    logging.py        LoggingConfig (console, TensorBoard, W&B, timers, profilers)
    parallel.py       DistributedConfig
    optimizer.py      OptimizerChoiceConfig, RegularizationConfig, LearningRateConfig
    precision.py      MixedPrecisionConfig, LowPrecisionConfig (FP8/FP4)
    moe.py            MoEConfig
    mla.py            MultiLatentAttentionConfig, MultiTokenPredictionConfig
    linear_attention.py  LinearAttentionConfig (Gated DeltaNet layers)
    resilience.py     ResilienceConfig (bad steps, auto-resume, dry run)
    run_config.py     RunConfig: one instance of each, in --help order

Each section checks its own flags (`validate()`) and derives its own values (`derived()`); the command
line, the rules across sections and the parsed `args` namespace are in megatron/training/arguments/.
`RunConfig.from_namespace(args)` gives the typed view of validated arguments.
"""
