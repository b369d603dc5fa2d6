"""The frontend's tokenizer: the model's own, another directory (``--tokenizer``) or none
(``--skip-tokenizer``, token-id prompts only)."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: Path | None) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in ``path``; None for ``path=None``. Nothing is ever downloaded."""
    if path is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"no usable tokenizer in {path} ({error}); pass --tokenizer DIR, or --skip-tokenizer for token-id prompts"
        ) from error
