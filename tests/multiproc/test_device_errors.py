"""A rank whose GPU is not visible stops start-up with an error that says what to change."""

import pytest
import torch

from strata import LLM

pytestmark = pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs a machine with at most one GPU")


def test_uni_engine_on_a_gpu_that_is_not_there_fails_at_start_up():
    with pytest.raises(ValueError, match=r"rank 0 of 1 needs cuda:1 but [01] GPU\(s\) are visible"):
        LLM(executor="uni", device="cuda:1")


def test_mp_rank_on_a_gpu_that_is_not_there_fails_start_up_naming_the_rank():
    with pytest.raises(RuntimeError, match=r"worker rank 0 failed during start-up: .*needs cuda:1 but [01] GPU\(s\) are visible"):
        LLM(executor="mp", device="cuda:1")
