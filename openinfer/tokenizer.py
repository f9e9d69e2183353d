"""A model's tokenizer: a checkpoint directory's (or a Hub id's), or the one a .gguf file
describes in its metadata. transformers is imported on first use: the processes that never
see text (a router without --tokenizer, a rank) do not pay for it."""

from __future__ import annotations

import os


def load_tokenizer(path: str):
    """The tokenizer of a checkpoint directory (or Hub id), or the one a .gguf file describes
    in its metadata, with the file's chat template. A GGUF without tokenizer metadata, or
    with one transformers cannot build, is a ValueError naming the file."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy: only when text is used

    if not (path.lower().endswith(".gguf") and os.path.isfile(path)):
        return AutoTokenizer.from_pretrained(path)
    from openinfer import gguf_file as gguf  # the gguf library takes ~0.6 s to import

    problem = gguf.tokenizer_metadata_problem(path)
    if problem is not None:
        raise ValueError(f"model: {path!r}: {problem}; pass a tokenizer (--tokenizer) or use "
                         "token ids only (skip_tokenizer_init)")
    folder, name = os.path.split(os.path.abspath(path))
    # AutoTokenizer first parses the whole file again for a config, only to pick the class
    # (seconds for a real vocabulary); a byte-level BPE is fully described by the metadata,
    # and the generic fast class is what it gets anyway.
    cls = PreTrainedTokenizerFast if gguf.tokenizer_model(path) == "gpt2" else AutoTokenizer
    try:
        tokenizer = cls.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers' converters raise a variety of errors
        message = " ".join(str(e).split())[:200]
        raise ValueError(f"model: {path!r}: cannot build its tokenizer ({type(e).__name__}: "
                         f"{message})") from None
    # transformers copies the template today; the file is the authority either way.
    template = gguf.chat_template(path)
    if template is not None and tokenizer.chat_template != template:
        tokenizer.chat_template = template
    return tokenizer
