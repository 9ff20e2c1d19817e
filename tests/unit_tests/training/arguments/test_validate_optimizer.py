"""--optimizer muon against the rest of the run: what it turns into (Megatron-LM's rules) and what is refused."""

import pytest

from .conftest import MINIMAL


@pytest.mark.parametrize("flags", [["--optimizer", "muon", "--use-distributed-optimizer"],
                                   ["--optimizer", "dist_muon"]])
def test_muon_turns_the_distributed_optimizer_off_with_a_line(validated, capsys, flags):
    args = validated(*MINIMAL, "--bf16", *flags)
    assert (args.optimizer, args.use_distributed_optimizer) == ("muon", False)
    assert "note: --use-distributed-optimizer with --optimizer muon: Megatron-LM shards" in capsys.readouterr().out


@pytest.mark.parametrize("flags, problem", [
    (["--fp16"], "--optimizer muon is not supported with --fp16 (as in Megatron-LM): use --bf16"),
    (["--use-torch-fsdp2"], "--optimizer muon is not supported with --use-torch-fsdp2 (as in Megatron-LM)"),
    (["--muon-fp32-matmul-prec", "low"], "(--muon-fp32-matmul-prec) 'low' is not one of medium, high"),
    (["--muon-coefficient-type", "custom"], "(--muon-coefficient-type) 'custom' is not one of simple, quintic"),
    (["--muon-num-ns-steps", "0"], "(--muon-num-ns-steps) must be at least 1, got 0"),
    (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion is not supported yet; use adam"),
])
def test_muon_refusals(validated, flags, problem):
    with pytest.raises(ValueError) as error:
        validated(*MINIMAL, "--optimizer", "muon", *flags)
    assert problem in str(error.value)
