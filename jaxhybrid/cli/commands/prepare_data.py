"""``jaxhybrid prepare-data --out DIR [--input FILE ...] [--tokenizer byte|bpe] [--vocab-size N]
[--val-fraction F] [--overwrite]``: tokenize text (your files, or the built-in KJV corpus) into token memmaps."""
from __future__ import annotations

import argparse

from jaxhybrid.core.argtypes import check_writable
from jaxhybrid.runtime.data import prepare_data
from jaxhybrid.runtime.data.dataset import TokenDataset
from jaxhybrid.runtime.data.prepare import META


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (train.bin, val.bin, meta.json)")
    p.add_argument("--input", action="append", default=[], metavar="FILE",
                   help="UTF-8 text file (repeatable, concatenated in order); none = the built-in corpus")
    p.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte",
                   help="byte: 256 UTF-8 byte symbols; bpe: byte-level BPE trained here on the same text")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="BPE vocabulary including the 256 byte symbols (default 512); bpe only")
    p.add_argument("--val-fraction", type=float, default=0.02,
                   help="tail of the token stream held out as val.bin, in [0, 1) (default 0.02)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already prepared in --out (runs trained on it cannot resume)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    # A prepared dataset is what runs trained on it resume from (their fingerprint of its tokens): like
    # export's --out, replacing one takes asking for it.
    if (Path(args.out) / META).exists() and not args.overwrite:
        raise ValueError(f"--out {args.out} already holds a prepared dataset ({META}); choose another --out, "
                         f"or pass --overwrite to replace it")
    check_writable(args.out, "--out", directory=True)  # before the corpus is read and tokenized (BPE: trained)
    out = prepare_data(args.out, args.input or None, args.tokenizer, args.vocab_size, args.val_fraction)
    meta = TokenDataset(out).meta
    s = meta["splits"]
    src = "built-in corpus (KJV Bible)" if not args.input else f"{len(args.input)} file(s)"
    print(f"prepared {out}: {meta['n_tokens']:,} tokens (train {s['train']:,}, val {s['val']:,}) from {src}, "
          f"tokenizer {meta['tokenizer']}, vocab {meta['vocab_size']}, {meta['dtype']}")
    return 0
