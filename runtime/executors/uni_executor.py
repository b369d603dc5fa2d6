"""The in-process executor: one rank, the model runner called directly (tests, debugging)."""

import gc
from collections.abc import Callable

import msgspec
import torch

from strata.engine_core.protocol import ModelRunnerOutput, SchedulerOutput
from strata.worker.config import WorkerConfig
from strata.worker.devices import check_device_visible, rank_device
from strata.worker.model_runner import ModelRunner, default_num_threads
from strata.worker.parallel_state import TensorParallel


class UniExecutor:
    """Rank 0's model runner in this process; ``shutdown`` frees its memory for the next engine."""

    def __init__(self, config: WorkerConfig) -> None:
        torch.set_num_threads(default_num_threads(1))
        device = rank_device(config.device, 0)  # "cuda" names the first visible GPU, cuda:0
        check_device_visible(device, 0, 1, torch.cuda.device_count())
        runner = ModelRunner(msgspec.structs.replace(config, device=device), TensorParallel(rank=0, size=1))
        self.runner: ModelRunner | None = runner  # None once shut down
        self.num_blocks = runner.num_blocks
        self.vocab_size = runner.model.vocab_size
        self.num_cpu_blocks = runner.num_cpu_blocks

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], bytes] | None = None
    ) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output, grammar_bitmask)

    def stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        """Stop the runner and drop it with its model, KV cache and CUDA graphs, then hand the
        freed blocks back to the device so that another engine in this process can take them."""
        runner, self.runner = self.runner, None
        if runner is None:
            return
        runner.shutdown()
        device = runner.device
        del runner
        gc.collect()  # modules and their hooks hold reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
