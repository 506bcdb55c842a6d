"""Stand-in for torchtitan's ``components/tokenizer.py`` (HF tokenizers): the model only names
``BaseTokenizer`` in type hints of its flex/varlen attention masks, unused with SDPA."""


class BaseTokenizer:
    """The tokenizer interface's name; the test feeds token ids directly."""

    eos_id: int | None = None
