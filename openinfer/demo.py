"""The built-in demo model: a small Qwen3 with RANDOM weights and a locally trained tokenizer.

It exists so that `make serve`, the tests and the benchmarks have a real Hugging Face style
checkpoint to load without downloading anything. Its output is gibberish by construction.

Everything is built from material present on every machine with Python 3.11: the tokenizer is a
byte-level BPE trained on docstrings of a fixed list of standard-library modules, and the weights
come from a seeded random init. Building twice in the same environment gives identical files.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, as Qwen uses it. Content may be a string or a list of OpenAI-style content parts, of
# which only the text parts are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Pure-Python or platform-independent modules only, so that the training text (and so the
# vocabulary) is the same on Linux and macOS. The order is fixed; do not sort or shuffle it.
_CORPUS_MODULES = (
    "json", "collections", "itertools", "functools", "textwrap", "string", "re", "pathlib",
    "argparse", "logging", "typing", "dataclasses", "enum", "abc", "contextlib", "heapq",
    "bisect", "random", "statistics", "fractions", "decimal", "datetime", "calendar", "csv",
    "shutil", "tempfile", "threading", "queue", "unittest", "inspect", "ast", "math",
    "operator", "copy", "pprint", "difflib", "hashlib", "base64", "struct", "io", "zipfile",
    "tarfile", "gzip", "sqlite3", "urllib.parse", "email", "html", "xml.etree.ElementTree",
    "uuid", "types", "weakref", "traceback", "warnings", "gettext", "codecs", "shlex",
    "glob", "fnmatch", "configparser", "graphlib", "numbers", "secrets", "ipaddress",
)

README = """\
# openinfer demo model

THE WEIGHTS ARE RANDOM. This model was never trained: its output is gibberish.

It is a small `Qwen3ForCausalLM` ({params} parameters, {dtype}) built locally by
`openinfer.demo.build_demo_model` from a seeded random init (seed {seed}), with a byte-level BPE
tokenizer ({tok_vocab} tokens) trained on Python standard-library docstrings. It exists only to
exercise the inference engine (loading, paged KV cache, batching, sampling, serving) without
downloading anything. Do not use it to judge output quality.
"""


@dataclass(frozen=True)
class DemoModelSpec:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int | None = None
    """None: the tokenizer's size rounded up to a multiple of 64; larger values pad the vocab."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    seed: int = 0
    tokenizer_vocab_size: int = 4096
    dtype: str = "float32"
    """'float32' or 'bfloat16' (also accepted: 'float16')."""
    initializer_range: float = 0.05
    """Std of the random init; larger than HF's 0.02 so logits are peaked and greedy is stable."""
    rope_theta: float = 1_000_000.0


DEMO_PRESETS: dict[str, DemoModelSpec] = {
    "tiny": DemoModelSpec(),
    # ~0.27B parameters (untied embeddings: the lm_head is a separate 32000 x 1024 matrix, which
    # also exercises the untied-weights loading path). The tokenizer stays small; the model's
    # vocabulary is padded to 32000 as real checkpoints pad theirs.
    "bench-0.3b": DemoModelSpec(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        tokenizer_vocab_size=8192,
        dtype="bfloat16",
        initializer_range=0.02,
    ),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def get_demo_spec(name: str) -> DemoModelSpec:
    """The preset called `name` (see DEMO_PRESETS)."""
    try:
        return DEMO_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(DEMO_PRESETS))
        raise ValueError(f"unknown demo preset {name!r}; known: {known}") from None


# --------------------------------------------------------------------------- tokenizer


def _corpus() -> Iterator[str]:
    """Docstrings of _CORPUS_MODULES and of their public members, in a fixed order."""
    for module_name in _CORPUS_MODULES:
        module = importlib.import_module(module_name)
        doc = inspect.getdoc(module)
        if doc:
            yield doc
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            # Only members defined here: re-exports would repeat text and vary with imports.
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc:
                yield doc


def train_demo_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer`; special tokens get ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text (any bytes) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


def build_demo_tokenizer(vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """The demo tokenizer wrapped for transformers, with ChatML special tokens and template.

    The vocabulary may come out smaller than `vocab_size` when the corpus runs out of merges
    (about 10.9k tokens is the most it gives).
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=train_demo_tokenizer(vocab_size),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- model


def _model_vocab_size(spec: DemoModelSpec, tokenizer_size: int) -> int:
    if spec.vocab_size is None:
        return -(-tokenizer_size // 64) * 64
    if spec.vocab_size < tokenizer_size:
        raise ValueError(
            f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {tokenizer_size}"
        )
    return spec.vocab_size


def _qwen3_config(spec: DemoModelSpec, vocab_size: int, ids: dict[str, int]) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        max_window_layers=spec.num_hidden_layers,
    )
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x reads `rope_theta`.
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters["rope_theta"] = spec.rope_theta
    else:
        config.rope_theta = spec.rope_theta
    config.architectures = ["Qwen3ForCausalLM"]
    return config


@torch.no_grad()
def _random_model(config: Qwen3Config, spec: DemoModelSpec) -> Qwen3ForCausalLM:
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    # HF initializes every RMSNorm weight to exactly 1, which would hide an engine that forgets
    # to apply a norm's weight (q_norm/k_norm especially). Jitter them so such a bug shows.
    generator = torch.Generator().manual_seed(spec.seed + 1)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
    return model.to(_DTYPES[spec.dtype]).eval()


def _save_model(model: Qwen3ForCausalLM, out_dir: Path, rope_theta: float) -> None:
    # transformers 5 always writes safetensors and dropped the flag; 4.x needs it.
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    with _quiet_progress_bars():
        model.save_pretrained(out_dir, **kwargs)
    # transformers 5 writes only rope_parameters.rope_theta; 4.x (and simple config readers)
    # look for a top-level rope_theta and would silently use the default 10000 without it.
    _update_json(out_dir / "config.json", {"rope_theta": rope_theta})


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    # transformers 5 names the class "TokenizersBackend" and lists extra special tokens under
    # a key 4.x reads as a dict; the 4.x spelling below loads in both.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("extra_special_tokens", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = [IM_START]
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _update_json(path: Path, changes: dict[str, object]) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' "Writing model shards" bar, restoring the caller's setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_generation_config(out_dir: Path, ids: dict[str, int]) -> None:
    GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    ).save_pretrained(out_dir)


def _write_readme(out_dir: Path, model: Qwen3ForCausalLM, spec: DemoModelSpec, tok_vocab: int):
    params = sum(p.numel() for p in model.parameters())
    text = README.format(
        params=f"{params / 1e6:.1f}M", dtype=spec.dtype, seed=spec.seed, tok_vocab=tok_vocab
    )
    (out_dir / "README.md").write_text(text)
    spec_fields = {name: getattr(spec, name) for name in spec.__dataclass_fields__}
    (out_dir / "demo_spec.json").write_text(json.dumps(spec_fields, indent=2) + "\n")


def build_demo_model(out_dir: str | Path, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Write a random-weight Qwen3 checkpoint plus tokenizer to `out_dir`; returns the path.

    The directory loads with `AutoModelForCausalLM` / `AutoTokenizer`. It holds config.json,
    model.safetensors, generation_config.json (eos = [<|im_end|>, <|endoftext|>]), the
    tokenizer files, demo_spec.json and a README.md that says the weights are random.
    """
    if spec.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {spec.dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_demo_tokenizer(spec.tokenizer_vocab_size)
    tokenizer.model_max_length = spec.max_position_embeddings
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    vocab_size = _model_vocab_size(spec, len(tokenizer))

    model = _random_model(_qwen3_config(spec, vocab_size, ids), spec)
    _save_model(model, out, spec.rope_theta)
    _write_generation_config(out, ids)
    _save_tokenizer(tokenizer, out)
    _write_readme(out, model, spec, len(tokenizer))
    return out

