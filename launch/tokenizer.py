"""The frontend's tokenizer: the model's own, another directory (``--tokenizer``) or none
(``--skip-tokenizer``, token-id prompts only)."""

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase


def load_tokenizer(path: Path | None) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in ``path``; None for ``path=None``. Nothing is ever downloaded."""
    if path is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, config=_model_type_config(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"no usable tokenizer in {path} ({error}); pass --tokenizer DIR, or --skip-tokenizer for token-id prompts"
        ) from error


def _model_type_config(path: Path) -> PreTrainedConfig | None:
    """The directory's config.json as transformers' base config class, which is all AutoTokenizer
    reads (the model type) to pick a tokenizer: left to itself, it would load the config class of
    that model type, whose module imports transformers' modeling code (seconds of every start)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    return PreTrainedConfig.from_dict(json.loads(config_file.read_text()))


def generation_eos_token_ids(model_path: Path, tokenizer_eos_token_id: int | None) -> tuple[int, ...]:
    """The end-of-sequence ids the model's ``generation_config.json`` lists beside the tokenizer's
    own (a chat model's end-of-turn token, say); () when there is no such file or no other id.
    As in vLLM, requests stop on them unless they ignore EOS."""
    path = model_path / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and i != tokenizer_eos_token_id))
