"""The GPU flags reach EngineArgs, and bad values are refused naming the field."""

import pytest

from strata.launch.cli.main import build_parser
from strata.runtime.engine_args import EngineArgs


def test_gpu_flags_parse_into_engine_args() -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--cuda-graph-sizes", "1,2,8", "--enforce-eager",
         "--gpu-memory-utilization", "0.5", "--load-format", "dummy", "--skip-tokenizer"]
    )
    engine = EngineArgs.from_cli(args)
    assert engine.cuda_graph_sizes == [1, 2, 8]
    assert engine.enforce_eager and engine.skip_tokenizer
    assert engine.gpu_memory_utilization == 0.5 and engine.load_format == "dummy"


def test_cuda_graph_sizes_that_are_not_integers_are_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--cuda-graph-sizes", "1,two"])
    assert "expected comma-separated integers, got '1,two'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"load_format": "pt"}, "load_format must be one of auto, dummy"),
        ({"tokenizer": "/tmp", "skip_tokenizer": True}, "tokenizer and skip_tokenizer exclude each other"),
        ({"gpu_memory_utilization": 1.2}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"cuda_graph_sizes": [1, 512], "max_num_seqs": 256}, r"cuda_graph_sizes must lie in 1..max_num_seqs \(256\)"),
    ],
)
def test_bad_gpu_settings_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**fields)
