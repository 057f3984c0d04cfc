"""Build a small random-weight Llama model directory that vLLM can serve, without any download.

Run it with the vLLM venv's python (it needs torch, transformers and tokenizers):

    "$(scripts/vllm-env)/bin/python" scripts/build_tiny_model.py            # ~/.cache/vsup/tiny-llama
    .../python scripts/build_tiny_model.py --hidden 1024 --layers 8 --heads 16 --out DIR   # for bench/

The directory is cached: when it already holds a complete model (its marker file), nothing is
rebuilt. It is built in a temporary sibling directory and renamed into place, so an interrupted
build never leaves a half model behind. The last line on stdout is the model directory.

Everything is deterministic (fixed seeds, generated training text), so two machines build the
same weights and tokenizer. The weights are random: the model "talks" nonsense, which is all a
serving test needs. vLLM's CPU attention accepts head sizes 32, 64, 80, 96, 112, 128 (checked below).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a progress bar per shard is noise in test logs

CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128)
MARKER = "vsup-model.json"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# A plain chat format the tokenizer knows as special tokens: <|role|>\ntext\n ... <|assistant|>\n
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in on for with by from at as is are was be been this that these those it its "
    "model server request response token stream core node memory cache process thread worker engine "
    "supervisor proxy instance health ready start stop restart signal port socket queue batch prompt "
    "answer question hello world cpu numa bind pin plan launch config value key error timeout retry "
    "fast slow small large first last next one two three four five six seven eight nine ten zero "
    "red green blue river mountain city window garden music paper light water stone bird tree road "
    "and or but if then else when while because so not no yes all any each every some many few more "
    "run runs ran send sends sent read reads write writes wrote keep keeps kept make makes made "
    "I you he she we they me him her us them my your our their what which who how why where"
).split()


def training_text(seed: int, lines: int = 20000) -> list[str]:
    """Deterministic English-like sentences plus digits and punctuation, for the BPE trainer."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10000)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".?!,;:")
        out.append(sentence)
    return out


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # byte-level: every input string can be encoded (no unknown token), like GPT-2/Llama-3 tokenizers
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, PAD, *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def build_model(args: argparse.Namespace, tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_out = Path(os.environ.get("HOME", ".")) / ".cache" / "vsup" / "tiny-llama"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help=f"model directory (default {default_out})")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=None, help="per-head size (default: hidden/heads, at least 32)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP size (default 4 x hidden)")
    parser.add_argument("--vocab", type=int, default=2048, help="tokenizer vocabulary (default 2048)")
    parser.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even when the directory is complete")
    args = parser.parse_args(argv)
    if args.head_dim is None:
        args.head_dim = max(32, args.hidden // args.heads)
    if args.head_dim not in CPU_ATTENTION_HEAD_SIZES:
        parser.error(f"--head-dim {args.head_dim}: vLLM's CPU attention takes one of {CPU_ATTENTION_HEAD_SIZES}")
    for name in ("hidden", "layers", "heads", "vocab", "max_positions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.kv_heads and args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads}: must divide --heads {args.heads}")
    if args.vocab < 300:
        parser.error(f"--vocab {args.vocab}: must be at least 300 (256 bytes + special tokens + merges)")
    return args


def spec_of(args: argparse.Namespace) -> dict:
    keys = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_positions", "seed")
    return {key: getattr(args, key) for key in keys}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.expanduser().absolute()
    marker = out / MARKER
    if marker.is_file() and not args.force:
        built = json.loads(marker.read_text())
        if built.get("spec") != spec_of(args):
            print(f"build_tiny_model: {out} holds a model built with {built.get('spec')}, not {spec_of(args)};"
                  " pass --force to rebuild it or --out for another directory", file=sys.stderr)
            return 1
        print(out)
        return 0

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared like any other
    try:
        tokenizer = build_tokenizer(args.vocab, args.seed)
        model = build_model(args, tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        params = sum(p.numel() for p in model.parameters())
        (tmp / MARKER).write_text(json.dumps({"spec": spec_of(args), "parameters": params}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"build_tiny_model: {params:,} parameters, float32, in {out}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
